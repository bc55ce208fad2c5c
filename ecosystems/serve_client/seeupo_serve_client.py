"""One `seeupo-serve` episode over its OpenEnv WebSocket session (`/ws`), from a venv that holds
neither seeupo-gym nor openenv (NeMo Gym needs Python >= 3.13 and its own pins; verifiers pins
mcp==2.0.0, which openenv's fastmcp 3 refuses). The wire contract is docs/integrations.md's
"Envs beyond one process"; `seeupo_gym.integrations.openenv_client` is the full typed client.

    async with ServeSession("http://127.0.0.1:8000") as env:
        first = await env.reset(task_id="multi_turn_base_0")
        step = await env.step("<the model's whole response>")   # step.reward, step.done, step.info

The model's text only ever travels as `{"response": text}`: it is never parsed into an action.
The server is not trusted either: an answer that is not JSON, over `max_message_bytes`, with a
reward that is not a finite number or a `done` that is not a bool is a `ServeError`, and so is an
answer not whole within its deadline (`served_env`: connecting, status line, headers, `100 Continue`s
and body within `timeout_s`; a session's answer within `timeout_s`). The token (`token=` or
$SEEUPO_SERVE_TOKEN) goes as `Authorization: Bearer` to the server only, never to a proxy (no
request here reads the proxy variables).
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import connect

TOKEN_ENV = "SEEUPO_SERVE_TOKEN"
MAX_MESSAGE_BYTES = 32 << 20


class ServeError(RuntimeError):
    """The server refused a request, or answered something no seeupo-serve session answers."""


@dataclass(frozen=True)
class Step:
    """One answer of the session: the env's observation text, the step's reward, whether the
    episode ended (`done`: terminated or truncated; `truncated`: at a limit) and the env's info."""

    text: str
    reward: float
    done: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The env's chat so far (system prompt, user turns, the responses, tool results)."""
        return [dict(message) for message in self.info.get("messages") or [] if isinstance(message, dict)]


def system_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The env's system prompt, as chat messages."""
    return [{"role": "system", "content": str(m.get("content", ""))} for m in messages if m.get("role") == "system"]


def user_turn(messages: list[dict[str, Any]]) -> str:
    """What the env said (its messages other than the system prompt), as one user turn."""
    return "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") != "system")


class _DeadlineSocket:
    """A connected socket whose every wait (each read and write) ends at `deadline`
    (`time.monotonic()`): a server that drips its answer a byte at a time is cut there."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        self._files, self._closed = 0, False  # as a socket's: closed once it and its files are

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer's deadline passed")
        self._sock.settimeout(left)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return self._sock.recv_into(buffer, nbytes, flags)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._files += 1
        return io.BufferedReader(_Reads(self))

    def close(self) -> None:
        self._closed = True
        if self._files == 0:
            self._sock.close()

    def file_closed(self) -> None:
        self._files -= 1
        if self._closed and self._files == 0:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Reads(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock.file_closed()
        super().close()


def _deadline_connection(scheme: str, host: str, port: int | None, deadline: float) -> http.client.HTTPConnection:
    """An http.client connection (which reads no proxy variables) whose answer must be whole by `deadline`."""
    base = http.client.HTTPSConnection if scheme in ("https", "wss") else http.client.HTTPConnection

    class Connection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            self.timeout = max(0.001, deadline - time.monotonic())
            super().connect()
            self.sock = _DeadlineSocket(self.sock, deadline)

    return Connection(host, port)


def served_env(base_url: str, *, token: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """What the server serves (`GET /seeupo/env`): its env id, kwargs, default kwargs and task ids;
    the whole answer within `timeout_s`."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    ws_url(base_url)  # the same URL check
    parts = urlsplit(base_url)
    connection = _deadline_connection(parts.scheme, parts.hostname or "", parts.port, time.monotonic() + timeout_s)
    try:
        connection.request("GET", parts.path.rstrip("/") + "/seeupo/env",
                           headers={"Authorization": f"Bearer {token}"} if token else {})
        answer = connection.getresponse()
        if answer.status != 200:
            raise ServeError(f"cannot read what {base_url} serves (GET /seeupo/env): HTTP {answer.status}")
        body = answer.read(MAX_MESSAGE_BYTES + 1)
    except TimeoutError:
        raise ServeError(f"{base_url}/seeupo/env did not answer in whole within {timeout_s:g} s") from None
    except (http.client.HTTPException, OSError) as error:
        raise ServeError(f"cannot read what {base_url} serves (GET /seeupo/env): {type(error).__name__}: {error}") from None
    finally:
        connection.close()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ServeError(f"{base_url}/seeupo/env answered more than {MAX_MESSAGE_BYTES} bytes")
    try:
        served = json.loads(body)
    except ValueError:
        raise ServeError(f"{base_url}/seeupo/env answered something that is not JSON") from None
    if not isinstance(served, dict):
        raise ServeError(f"{base_url}/seeupo/env answered {type(served).__name__}, not an object")
    return served


def ws_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise ServeError(f"a seeupo-serve URL is http(s)://host:port, got {base_url!r}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/") + "/ws", "", ""))


def parse_step(raw: str | bytes) -> Step:
    """A server message as a `Step`, refusing what a session never sends."""
    try:
        message = json.loads(raw)
    except (TypeError, ValueError):
        raise ServeError(f"seeupo-serve answered something that is not JSON: {str(raw)[:200]!r}") from None
    if not isinstance(message, dict):
        raise ServeError(f"seeupo-serve answered {type(message).__name__}, not an object")
    data = message.get("data")
    if message.get("type") == "error":
        detail = data.get("message") if isinstance(data, dict) else data
        raise ServeError(f"seeupo-serve refused the request: {str(detail)[:500]}")
    if not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
        raise ServeError(f"seeupo-serve answered without an observation: {str(message)[:200]}")
    observation = data["observation"]
    reward, done = data.get("reward"), data.get("done")
    reward = 0.0 if reward is None else reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ServeError(f"seeupo-serve answered a reward that is not a finite number: {reward!r}")
    if not isinstance(done, bool):
        raise ServeError(f"seeupo-serve answered a `done` that is not a bool: {done!r}")
    text, truncated, info = observation.get("text", ""), observation.get("truncated", False), observation.get("info", {})
    if not isinstance(text, str) or not isinstance(truncated, bool) or not isinstance(info, dict):
        raise ServeError("seeupo-serve answered an observation that is not {text: str, truncated: bool, info: object}")
    return Step(text=text, reward=float(reward), done=done, truncated=truncated, info=info)


class ServeSession:
    """One WebSocket session of `seeupo-serve`: one env instance, one episode at a time."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.url = ws_url(base_url)
        self._token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._ws: Any = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> "ServeSession":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            self._ws = await asyncio.wait_for(
                connect(self.url, additional_headers=headers, max_size=self.max_message_bytes,
                        open_timeout=None, ping_interval=None, proxy=None),  # the token to the server only
                self.timeout_s)
        except (OSError, asyncio.TimeoutError) as error:
            raise ServeError(f"cannot reach seeupo-serve at {self.url}: {error}") from None
        except Exception as error:  # an HTTP refusal (401, 503) of the upgrade
            raise ServeError(f"seeupo-serve at {self.url} refused the session: {error}") from None

    async def close(self) -> None:
        if self._ws is not None:
            ws, self._ws = self._ws, None
            try:
                await ws.send(json.dumps({"type": "close"}))
            except Exception:  # already gone: nothing to close
                pass
            await ws.close()

    async def reset(self, **options: Any) -> Step:
        """Start an episode; `options` are the env's reset options (`task_id`, `seed`, ...)."""
        return await self._request({"type": "reset", "data": options})

    async def step(self, response: str) -> Step:
        """Play one turn: the model's whole response, as text."""
        if not isinstance(response, str):
            raise ServeError(f"a response is text, got {type(response).__name__}")
        return await self._request({"type": "step", "data": {"response": response}})

    async def _request(self, message: dict[str, Any]) -> Step:
        if self._ws is None:
            await self.connect()
        async with self._lock:
            try:
                await self._ws.send(json.dumps(message))
                raw = await asyncio.wait_for(self._ws.recv(), self.timeout_s)
            except asyncio.TimeoutError:
                await self.close()  # a late answer must not pair with the next request
                raise ServeError(f"seeupo-serve did not answer within {self.timeout_s} s") from None
            except Exception as error:
                await self.close()
                raise ServeError(f"the seeupo-serve session at {self.url} was lost: {error}") from None
        return parse_step(raw)
