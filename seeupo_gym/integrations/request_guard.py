"""The ASGI guard in front of seeupo-serve's app (`openenv_server.create_app`): origins, the
token, bodies and their deadline, and the MCP session guard (`mcp_sessions`), before openenv-core
sees a request. The connection caps and the request-head deadline are the CLI's (`connections.py`).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
from typing import Any, Callable

from seeupo_gym.integrations.mcp_sessions import (BadSessionId, http_session_request, query_session_id,
                                                  tracking_created_session)
from seeupo_gym.text import valid_unicode


class BoundedRequests:
    """ASGI guard in front of the app, in this order:

    - a request (a WebSocket upgrade included) with an `Origin` header that is neither the
      server's own (`http://host:port` it was reached at, on loopback also `localhost`) nor one of
      `allowed_origins` is refused (403; a WebSocket before it is accepted): a web page of another
      origin may not play the env, token or none (non-browser clients send no `Origin`);
    - with a token, `Authorization: Bearer <token>` (or HTTP basic auth with the token as the
      password, which WebSocket clients send from a `ws://user:token@host` URL) on every route but
      /health (401 / a refused WebSocket handshake);
    - a WebSocket naming `session_id` twice or empty is refused (400), and may attach only to a
      session made over HTTP (`mcp_sessions`);
    - no body is read for a route that takes none (GET, HEAD, and /health, which is GET only): one
      declared there is refused at once (400, or 405 for any other method on /health) and the
      connection closed, so it holds no slot while a body drips;
    - request bodies at most `max_request_bytes` (413) and complete within `body_timeout_s` (408);
    - an HTTP MCP request may address a session only while its WebSocket is attached, and names
      `session_id` once (400);
    - where the env has no tools (not `action_format=tools`), `tools/*` requests get an error
      naming that fix and the MCP WebSocket (`/mcp`) is refused (409) (`mcp_sessions`)."""

    def __init__(self, app: FastAPI, *, max_request_bytes: int, token: str | None, body_timeout_s: float = 60.0,
                 allowed_origins: tuple[str, ...] | list[str] = ()) -> None:
        self.app = app
        self.state = app.state
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self._token = token.encode() if token else None
        self._allowed_origins = frozenset(normal_origin(origin) for origin in allowed_origins)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        origins = [value for name, value in scope.get("headers", []) if name == b"origin"]
        if origins and not self._origin_allowed(scope, origins):
            shown = valid_unicode(origins[0].decode("latin-1"))[:100]
            return await _refuse(scope, send, 403, f"refused: a request from a web page of another origin ({shown!r}); "
                                                   "the operator may allow an origin with --allow-origin")
        path, method = scope.get("path"), scope.get("method")
        if self._token is not None and path != "/health" and not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong token"})
            else:
                await _send_json(send, 401, "missing or wrong token: send Authorization: Bearer <token>", close=True)
            return
        if scope["type"] == "websocket":
            if path == "/mcp" and self.state.openenv.without_mcp_tools is not None:
                return await _refuse(scope, send, 409, self.state.openenv.without_mcp_tools)  # no session made
            try:
                attach = query_session_id(scope)
            except BadSessionId as error:
                return await _refuse(scope, send, 400, str(error))
            if attach is not None and not self.state.openenv.is_http_session(attach):
                await send({"type": "websocket.close", "code": 1008,
                            "reason": "no such session to attach to (make one with openenv/session/create)"})
                return
            try:
                return await self.app(scope, receive, send)
            except WebSocketDisconnect:
                # openenv-core closes the socket again after its client left; nothing is lost.
                return
        headers = dict(scope.get("headers", []))
        if path == "/health" or method in ("GET", "HEAD"):
            if path == "/health" and method not in ("GET", "HEAD"):
                return await _send_json(send, 405, "/health answers GET only", close=True)
            if headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
                return await _send_json(send, 400, f"{method} {path} takes no request body", close=True)
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return await _send_json(send, 413, f"request body over {self.max_request_bytes} bytes", close=True)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while more:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await _send_json(send, 408, f"request body not complete within {self.body_timeout_s:g} s",
                                        close=True)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return await _send_json(send, 413, f"request body over {self.max_request_bytes} bytes", close=True)
        if path == "/mcp" and method == "POST":
            status, refusal, creates = http_session_request(bytes(body), self.state.openenv)
            if refusal is not None:
                return await _send_json(send, status, refusal)
            if creates:
                send = tracking_created_session(send, self.state.openenv)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _origin_allowed(self, scope: dict[str, Any], origins: list[bytes]) -> bool:
        if len(origins) != 1:
            return False
        origin = origins[0].decode("latin-1").strip().lower()
        return origin in self._allowed_origins or origin in _own_origins(scope)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        assert self._token is not None
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, credentials = header.partition(b" ")
        if scheme.lower() == b"bearer":
            return hmac.compare_digest(credentials.strip(), self._token)
        if scheme.lower() == b"basic":
            try:
                password = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except ValueError:
                return False
            return hmac.compare_digest(password, self._token)
        return False


def normal_origin(origin: str) -> str:
    """`origin` as browsers send it (`scheme://host[:port]`, lower case), or a ValueError."""
    from urllib.parse import urlsplit

    parts = urlsplit(origin.strip())
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ValueError(f"an allowed origin is scheme://host[:port] (http or https, no path), got {origin!r}")
    return f"{parts.scheme}://{parts.netloc}".lower()


def _own_origins(scope: dict[str, Any]) -> tuple[str, ...]:
    """The origins of a page this server itself would serve: the address this request reached,
    and on loopback its other names (`localhost`, which some clients send, e.g. websocket-client;
    a local process needs no browser to reach the port anyway)."""
    import ipaddress

    server = scope.get("server")
    if not server or server[1] is None:
        return ()
    host, port = server
    hosts = [f"[{host}]" if ":" in host else host]
    try:
        if ipaddress.ip_address(host).is_loopback:
            hosts += ["localhost", "127.0.0.1", "[::1]"]
    except ValueError:
        pass
    own = [f"http://{name}:{port}".lower() for name in hosts]
    return tuple(own + [f"http://{name}".lower() for name in hosts] if port == 80 else own)


async def _refuse(scope: dict[str, Any], send: Callable, status: int, detail: str) -> None:
    """An HTTP answer `status`; for a WebSocket, in place of its handshake (before any accept)."""
    if scope["type"] == "http":
        return await _send_json(send, status, detail, close=True)
    if "websocket.http.response" not in scope.get("extensions", {}):
        return await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})  # a 403
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "websocket.http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})


async def _send_json(send: Callable, status: int, detail: str | dict[str, Any], close: bool = False) -> None:
    """`detail` as a JSON answer; `close`: the connection closes after it (a body left unread
    would otherwise keep it, and its slot, for as long as the client drips it)."""
    body = json.dumps(detail if isinstance(detail, dict) else {"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})
