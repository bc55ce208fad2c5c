"""MCP sessions made over HTTP, as openenv's `MCPToolClient` makes them: the session table and the
guard in front of openenv's routes for them.

A server whose env is in a format without tools (ReAct, the default) answers `tools/*` and the
reset of an HTTP-made session with an error naming the fix (serve with `action_format=tools`);
openenv would answer "Environment does not support MCP", and `MCPToolClient.list_tools` turns any
error into `[]`, so the reset is where its user first learns why.

`MCPToolClient` creates a session with `POST /mcp` (`openenv/session/create`), attaches a
WebSocket to it (`/ws?session_id=...`) and then addresses it by id in `tools/*` requests. Here
such a session lives only as long as that WebSocket: closed when it leaves, or `attach_timeout_s`
after creation if none came (openenv would keep it until its idle reaper runs). A WebSocket may
attach only to a session made over HTTP, and an HTTP request may address a session only while its
WebSocket is attached. The guard reads `session_id` with the parser openenv reads it with and
refuses one named twice or empty. `BoundedRequests` (`request_guard`) calls the guard functions
below.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from seeupo_gym.integrations import import_openenv_core

import_openenv_core()  # before any openenv import: skips its web playground

from openenv.core.env_server.http_server import HTTPEnvServer  # noqa: E402
from starlette.datastructures import QueryParams  # noqa: E402

logger = logging.getLogger(__name__)


class SessionServer(HTTPEnvServer):
    """openenv's server with two watches, every half second:

    - a request in flight counts as activity: openenv's reaper measures idleness from a session's
      last answered request, so it would close a session in the middle of a long reset (an
      AppWorld server starting);
    - a session made over HTTP (`openenv/session/create`, as `MCPToolClient` does) lives only as
      long as the WebSocket attached to it: closed when it leaves, or `attach_timeout_s` after
      creation if none came (openenv would keep it until its idle reaper runs)."""

    _watch_task: asyncio.Task | None = None
    attach_timeout_s = 10.0
    # Why an MCP client gets no tools here (the env is served in a format without tools, and how to
    # serve it with them), or None when it has them.
    without_mcp_tools: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._http_sessions: dict[str, float | None] = {}  # id -> attach deadline; None once attached

    def track_http_session(self, session_id: str) -> None:
        self._http_sessions[session_id] = time.monotonic() + self.attach_timeout_s
        env = self._sessions.get(session_id)
        if env is not None:  # only MCPToolClient makes sessions over HTTP: its reset gets the refusal
            env.mcp_refusal = self.without_mcp_tools

    def is_http_session(self, session_id: str) -> bool:
        return session_id in self._http_sessions

    def is_attached(self, session_id: str) -> bool:
        return session_id in self._session_websocket_attachments

    def _start_reaper(self) -> None:
        super()._start_reaper()
        if self._watch_task is None:
            self._watch_task = asyncio.create_task(self._watch_sessions())

    def _stop_reaper(self) -> None:
        super()._stop_reaper()
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None

    async def _watch_sessions(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                now = time.time()
                for session_id, env in list(self._sessions.items()):
                    info = self._session_info.get(session_id)
                    if info is not None and getattr(env, "busy", False):
                        info.last_activity_at = now
                for session_id, deadline in list(self._http_sessions.items()):
                    if session_id not in self._sessions:
                        self._http_sessions.pop(session_id, None)
                    elif self.is_attached(session_id):
                        self._http_sessions[session_id] = None
                    elif deadline is None or time.monotonic() > deadline:
                        self._http_sessions.pop(session_id, None)
                        await self._destroy_session(session_id)
            except Exception:  # the watch must go on
                logger.exception("watching sessions failed")



class BadSessionId(ValueError):
    """A request names `session_id` twice (or empty): the guard and openenv might read different ones."""


def query_session_id(scope: dict[str, Any]) -> str | None:
    """The `session_id` a WebSocket's query names, read by starlette's `QueryParams`, the parser
    openenv's `/ws` reads it with (`websocket.query_params.get`), so that the guard checks the
    session openenv attaches to; None when the query names none.

    Raises `BadSessionId` when it is named more than once (starlette would take the last, another
    parser the first) or is empty (openenv would make a new session instead)."""
    values = QueryParams(scope.get("query_string", b"")).getlist("session_id")
    if len(values) > 1:
        raise BadSessionId(f"the query names session_id {len(values)} times; name one session")
    if values and not values[0]:
        raise BadSessionId("the query's session_id is empty; name a session or leave session_id out")
    return values[0] if values else None


def _refusing_duplicate_session_ids(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if [key for key, _ in pairs].count("session_id") > 1:
        raise BadSessionId("the request names session_id more than once in one object; name one session")
    return dict(pairs)


def http_session_request(body: bytes, server: SessionServer) -> tuple[int, dict[str, Any] | None, bool]:
    """(the HTTP status and JSON-RPC error refusing an HTTP MCP request that addresses a session
    with no WebSocket attached or names `session_id` twice, or (200, None); whether the request
    creates a session)."""
    try:
        request = json.loads(body, object_pairs_hook=_refusing_duplicate_session_ids)
    except BadSessionId as error:
        try:
            request_id = json.loads(body).get("id")
        except (ValueError, RecursionError, AttributeError):
            request_id = None
        return 400, _jsonrpc_error(request_id, -32600, str(error)), False
    except (ValueError, RecursionError):
        return 200, None, False  # openenv answers a parse error itself
    if not isinstance(request, dict):
        return 200, None, False
    method, params = request.get("method"), request.get("params")
    if method == "openenv/session/create":
        return 200, None, True
    target = params.get("session_id") if isinstance(params, dict) else None
    if method == "openenv/session/close":
        return 200, None, False
    if target is not None and not (isinstance(target, str) and server.is_http_session(target)
                                   and server.is_attached(target)):
        return 200, _jsonrpc_error(request.get("id"), -32600, (
            "this session has no WebSocket attached: attach one at /ws?session_id=<id> (MCPToolClient does) "
            "before addressing it; a session lives as long as that connection")), False
    if server.without_mcp_tools is not None and isinstance(method, str) and method.startswith("tools/"):
        # openenv would answer "Environment does not support MCP" (and MCPToolClient list no tools)
        return 200, _jsonrpc_error(request.get("id"), -32601, server.without_mcp_tools), False
    return 200, None, False


def _jsonrpc_error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id if isinstance(request_id, (str, int)) else None,
            "error": {"code": code, "message": message}}


def tracking_created_session(send: Callable, server: SessionServer) -> Callable:
    """`send`, noting the id of the session an `openenv/session/create` answer carries."""
    chunks: list[bytes] = []

    async def tracking(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                try:
                    answer = json.loads(b"".join(chunks))
                    session_id = (answer.get("result") or {}).get("session_id")
                except (ValueError, AttributeError):
                    session_id = None
                if isinstance(session_id, str):
                    server.track_http_session(session_id)
        await send(message)

    return tracking


