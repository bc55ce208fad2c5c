"""`seeupo-serve`: any registered env over the OpenEnv protocol, on openenv-core's own server.

The wire contract (docs/integrations.md, "Envs beyond one process"):

- a WebSocket session at `/ws` is one env instance; `{"type": "reset", "data": {"seed": 3,
  "task_id": "..."}}` starts an episode, `{"type": "step", "data": {"response": "..."}}` sends
  one whole model response;
- an observation is `{"text", "truncated", "info"}` with the step's `reward` and `done`
  (terminated or truncated) beside it; `info` is the env's info made JSON-safe, same keys.
  openenv-core's serializer leaves `Observation.metadata` off the wire, so the info travels in
  the `info` field (in-process it is also the observation's metadata);
- `/health`, `/schema`, `/metadata`, `/state` are openenv-core's; POST `/reset` works as
  there (a fresh env per request, closed after answering); POST `/step` has no episode to
  step (OpenEnv's HTTP endpoints are stateless) and says so;
- GET `/seeupo/env` describes the served env (id, kwargs, the env's defaults, the kwargs a
  session may set, spaces, task ids) for the gymnasium client `seeupo/Remote-v0`;
- a reset may carry `"env_kwargs": {...}`: the session's env is then made with the server's
  kwargs updated by these, for keys the operator allowed (`session_kwargs`); reset options
  are the env's own (`seeupo_gym.options`: an unknown one is refused).

Bounds: at most `max_sessions` live envs (WebSocket sessions and HTTP resets together;
openenv-core refuses a session past it with CAPACITY_REACHED), idle sessions closed by
openenv-core's reaper, request bodies and WebSocket messages at most `max_request_bytes`, a
request body complete within `body_timeout_s`, a bearer token required on every route but
`/health` when one is set. A session lives as long as the WebSocket that made it: HTTP
`POST /mcp` may not create or address sessions (they would outlive their connection). The
connection cap and the request-head deadline are the CLI's (`connections.py`). Every string
sent is valid Unicode (lone surrogates escaped). Errors a client causes come back as error
messages (WebSocket) or 4xx answers (HTTP); the server goes on.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import inspect
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, Callable, Mapping

import gymnasium as gym
from fastapi import FastAPI, Request, WebSocketDisconnect
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, ConcurrencyConfig, EnvironmentMetadata, Observation, State
from pydantic import Field

from seeupo_gym.text import valid_unicode

logger = logging.getLogger(__name__)

# The reset field that carries a session's env kwargs (not an env option).
SESSION_KWARGS_FIELD = "env_kwargs"


class SessionError(RuntimeError):
    """A request this session cannot serve: closed, at capacity, no episode, a bad option."""


class ResponseAction(Action):
    """One turn: the model's whole response."""

    response: str = Field(description="the model's whole response for this turn")


class TextObservation(Observation):
    """What the env returned: its observation string, whether it truncated, and its info."""

    text: str = Field(default="", description="the env's observation string")
    truncated: bool = Field(default=False, description="the episode ended at a limit (max_turns), not by itself")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's info, JSON-safe, same keys as locally")


def json_safe(value: Any) -> Any:
    """`value` as JSON types: tuples become lists, keys strings, numpy scalars Python numbers,
    strings valid Unicode (a lone surrogate cannot be encoded, so it would fail this answer
    and, kept in the env's messages, every later one)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {json_safe(str(key)): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return json_safe(item())
        except (TypeError, ValueError):
            pass
    return valid_unicode(str(value))


def default_kwargs(env_id: str) -> dict[str, Any]:
    """The kwargs `gym.make(env_id)` makes the env with: its constructor's defaults updated by
    the registration's kwargs (JSON-safe), so that clients compare kwargs by value."""
    from gymnasium.envs.registration import load_env_creator

    spec = gym.spec(env_id)
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    defaults = {name: parameter.default for name, parameter in inspect.signature(creator).parameters.items()
                if parameter.default is not inspect.Parameter.empty
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)}
    return json_safe({**defaults, **spec.kwargs})


class Slots:
    """Counts live envs against the server's bound (WebSocket sessions and HTTP resets alike)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self._used >= self.limit:
                raise SessionError(f"the server is at capacity ({self.limit} live envs); retry later or raise --max-sessions")
            self._used += 1

    def give_back(self) -> None:
        with self._lock:
            self._used -= 1

    @property
    def used(self) -> int:
        return self._used


class GymSession(Environment[ResponseAction, TextObservation, State]):
    """One OpenEnv session over one gymnasium env, made at the first reset (so that openenv-core's
    per-request probes, `/state` and `/metadata`, cost nothing) and closed with the session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own env instance

    def __init__(self, env_id: str, make_env: Callable[[dict[str, Any]], gym.Env], slots: Slots,
                 live: set["GymSession"], lock: threading.Lock, session_kwargs: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.env_id = env_id
        self._make_env = make_env
        self._session_kwargs = session_kwargs
        self._env_kwargs: dict[str, Any] = {}  # what this session's env was made with, beyond the server's
        self._slots = slots
        self._live, self._live_lock = live, lock
        self._env: gym.Env | None = None
        self._closed = False
        self._episode_id: str | None = None
        self._turn = 0
        self._task_id: str | None = None
        self._done = True
        self._busy = 0
        with lock:
            live.add(self)

    @property
    def busy(self) -> bool:
        """A reset or step is running (the session is not idle, however long it takes)."""
        return self._busy > 0

    def reset(self, seed: Any = None, episode_id: Any = None, **options: Any) -> TextObservation:
        self._busy += 1
        try:
            return self._reset(seed, episode_id, options)
        finally:
            self._busy -= 1

    def step(self, action: ResponseAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._busy += 1
        try:
            return self._step(action)
        finally:
            self._busy -= 1

    def _reset(self, seed: Any, episode_id: Any, options: dict[str, Any]) -> TextObservation:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise SessionError(f"reset: seed must be a non-negative integer or null, got {seed!r}")
        if episode_id is not None and not isinstance(episode_id, str):
            raise SessionError(f"reset: episode_id must be a string, got {episode_id!r}")
        env_kwargs = self._checked_env_kwargs(options.pop(SESSION_KWARGS_FIELD, None))
        if self._env is not None and env_kwargs != self._env_kwargs:
            self._close_env()
        self._env_kwargs = env_kwargs
        env = self._ensure_env()
        self._done = True  # until the env's reset succeeds (it refuses unknown options itself)
        observation, info = env.reset(seed=seed, options=options or None)
        # An id per episode even when the client names none, so /state can tell episodes apart.
        self._episode_id, self._turn, self._done = episode_id or uuid.uuid4().hex, 0, False
        self._task_id = str(info.get("task_id")) if isinstance(info, dict) else None
        return self._observation(observation, None, False, False, info)

    def _step(self, action: ResponseAction) -> TextObservation:
        if self._closed:
            raise SessionError(self._closed_message())
        if self._env is None or self._done:
            raise SessionError(
                "step: no episode is running in this session; send a reset first. (POST /step is stateless in "
                "OpenEnv, a fresh env per request: run episodes over the WebSocket session at /ws)"
            )
        observation, reward, terminated, truncated, info = self._env.step(action.response)
        self._turn += 1
        self._done = bool(terminated or truncated)
        return self._observation(observation, float(reward), bool(terminated), bool(truncated), info)

    @property
    def state(self) -> State:
        return State(episode_id=self._episode_id, step_count=self._turn, turn=self._turn, task_id=self._task_id,
                     done=self._done)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=self.env_id, description=f"{self.env_id} served by seeupo-serve (seeupo-gym)")

    def close(self) -> None:
        """Close the env (an AppWorld env kills its servers); later requests get a clear error."""
        if self._closed:
            return
        self._closed = True
        with self._live_lock:
            self._live.discard(self)
        self._close_env()

    # ------------------------------------------------------------------ helpers

    def _checked_env_kwargs(self, requested: Any) -> dict[str, Any]:
        if requested is None:
            return {}
        if not isinstance(requested, dict):
            raise SessionError(f"reset: {SESSION_KWARGS_FIELD} must be an object of env kwargs, got {requested!r:.100}")
        refused = sorted(set(requested) - set(self._session_kwargs))
        if refused:
            allowed = list(self._session_kwargs) or "none (the operator allows them with --session-kwargs)"
            raise SessionError(f"reset: this server does not let a session set env kwargs {refused[:8]}; "
                               f"a session may set: {allowed}")
        return dict(requested)

    def _close_env(self) -> None:
        env, self._env = self._env, None
        self._done = True
        if env is not None:
            try:
                env.close()
            except Exception:  # closing must go on for the other sessions
                logger.exception("closing a session's env failed")
            finally:
                self._slots.give_back()

    def _ensure_env(self) -> gym.Env:
        if self._closed:
            raise SessionError(self._closed_message())
        if self._env is None:
            self._slots.take()
            try:
                self._env = self._make_env(self._env_kwargs)
            except BaseException as error:
                self._slots.give_back()
                if self._env_kwargs and isinstance(error, Exception):
                    raise SessionError(f"reset: cannot make {self.env_id} with the session's env kwargs "
                                       f"{json_safe(self._env_kwargs)}: {error}") from None
                raise
        return self._env

    def _closed_message(self) -> str:
        return ("this session is closed (idle past the server's --idle-timeout, or the server is stopping); "
                "open a new session (reconnect)")

    def _observation(self, text: Any, reward: float | None, terminated: bool, truncated: bool,
                     info: Any) -> TextObservation:
        safe = json_safe(info if isinstance(info, dict) else {})
        return TextObservation(text=valid_unicode(str(text)), truncated=truncated, info=safe, done=terminated or truncated,
                               reward=reward, metadata=safe)


class SessionServer(HTTPEnvServer):
    """openenv-core's server, where a request in flight counts as activity: its reaper measures
    idleness from a session's last answered request, so it would close a session in the middle
    of a long reset (an AppWorld server starting). Busy sessions are marked active every second."""

    _busy_task: asyncio.Task | None = None

    def _start_reaper(self) -> None:
        super()._start_reaper()
        if self._session_idle_timeout_s is not None and self._busy_task is None:
            self._busy_task = asyncio.create_task(self._mark_busy_sessions_active())

    def _stop_reaper(self) -> None:
        super()._stop_reaper()
        if self._busy_task is not None:
            self._busy_task.cancel()
            self._busy_task = None

    async def _mark_busy_sessions_active(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for session_id, env in list(self._sessions.items()):
                info = self._session_info.get(session_id)
                if info is not None and getattr(env, "busy", False):
                    info.last_activity_at = now


def space_description(space: gym.Space) -> dict[str, Any]:
    """A text space as the gymnasium client rebuilds it."""
    from seeupo_gym.spaces import UnicodeText

    if isinstance(space, UnicodeText):
        return {"type": "UnicodeText", "min_length": space.min_length, "max_length": space.max_length}
    raise TypeError(f"seeupo-serve serves text envs; this env's space is {space!r}")


def create_app(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    max_sessions: int = 32,
    idle_timeout_s: float = 600.0,
    max_request_bytes: int = 1 << 20,
    body_timeout_s: float = 60.0,
    token: str | None = None,
    session_kwargs: tuple[str, ...] | list[str] = (),
) -> FastAPI:
    """The FastAPI app serving `env_id` (made with `env_kwargs`); one env per session.

    `session_kwargs` names the env kwargs a session may set at reset (default: none).
    The env is made once here, to fail early on bad kwargs and to describe its spaces and tasks.
    """
    import seeupo_gym  # noqa: F401  (registers the ids)

    env_kwargs = dict(env_kwargs or {})
    session_kwargs = tuple(session_kwargs)
    defaults = default_kwargs(env_id)
    unknown = sorted(set(session_kwargs) - set(defaults))
    if unknown:
        raise ValueError(f"session_kwargs {unknown} are not kwargs of {env_id}; it takes {sorted(defaults)}")
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
    if idle_timeout_s < 5:
        raise ValueError(f"idle_timeout_s must be at least 5 seconds, got {idle_timeout_s}")
    probe = gym.make(env_id, **env_kwargs)
    try:
        task_ids = getattr(probe.unwrapped, "task_ids", None)
        description = {
            "env_id": env_id,
            "env_kwargs": json_safe(env_kwargs),
            "default_kwargs": defaults,
            "resolved_kwargs": {**defaults, **json_safe(env_kwargs)},
            "session_kwargs": list(session_kwargs),
            "observation_space": space_description(probe.observation_space),
            "action_space": space_description(probe.action_space),
            "task_ids": [str(t) for t in (task_ids() if callable(task_ids) else task_ids or [])],
            "max_sessions": max_sessions,
        }
    finally:
        probe.close()

    slots = Slots(max_sessions)
    live: set[GymSession] = set()
    live_lock = threading.Lock()

    def make_env(overrides: Mapping[str, Any]) -> gym.Env:
        # The probe above ran gymnasium's checker. Its passive checker breaks an env whose first
        # reset raised (a client's bad task id): every later step fails unpacking None.
        return gym.make(env_id, disable_env_checker=True, **{**env_kwargs, **overrides})

    def session() -> GymSession:
        return GymSession(env_id, make_env, slots, live, live_lock, session_kwargs)

    app = FastAPI(title=f"seeupo-serve {env_id}", docs_url=None, redoc_url=None)
    server = SessionServer(
        session,
        ResponseAction,
        TextObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=idle_timeout_s),
    )
    server.register_routes(app)
    app.state.openenv = server
    app.state.slots = slots

    @app.get("/seeupo/env")
    async def describe() -> dict[str, Any]:
        return {**description, "live_envs": slots.used}

    @app.exception_handler(SessionError)
    async def session_error(request: Request, error: SessionError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(error)})

    @app.exception_handler(ValueError)
    async def value_error(request: Request, error: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(error)})

    def close_all() -> None:
        with live_lock:
            sessions = list(live)
        for each in sessions:
            each.close()

    app.router.on_shutdown.append(close_all)
    app.state.close_all = close_all
    return BoundedRequests(app, max_request_bytes=max_request_bytes, body_timeout_s=body_timeout_s,  # type: ignore[return-value]
                           token=token)


class BoundedRequests:
    """ASGI guard in front of the app: request bodies at most `max_request_bytes` (413) and
    complete within `body_timeout_s` (408); with a token, `Authorization: Bearer <token>` (or
    HTTP basic auth with the token as the password, which WebSocket clients send from a
    `ws://user:token@host` URL) on every route but /health (401 / a refused WebSocket
    handshake); HTTP `POST /mcp` refused when it would create, close or address a session."""

    def __init__(self, app: FastAPI, *, max_request_bytes: int, token: str | None, body_timeout_s: float = 60.0) -> None:
        self.app = app
        self.state = app.state
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self._token = token.encode() if token else None

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self._token is not None and scope.get("path") != "/health" and not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong token"})
            else:
                await _send_json(send, 401, "missing or wrong token: send Authorization: Bearer <token>")
            return
        if scope["type"] == "websocket":
            try:
                return await self.app(scope, receive, send)
            except WebSocketDisconnect:
                # openenv-core closes the socket again after its client left; nothing is lost.
                return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return await _send_json(send, 413, f"request body over {self.max_request_bytes} bytes")
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while more:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await _send_json(send, 408, f"request body not complete within {self.body_timeout_s:g} s")
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return await _send_json(send, 413, f"request body over {self.max_request_bytes} bytes")
        if scope.get("path") == "/mcp" and scope.get("method") == "POST":
            refusal = _http_session_request(bytes(body))
            if refusal is not None:
                return await _send_json(send, 200, refusal)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

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


def _http_session_request(body: bytes) -> dict[str, Any] | None:
    """A JSON-RPC error for an HTTP MCP request that creates, closes or addresses a session, else None.

    openenv-core keeps such sessions until its idle reaper runs, however soon their client
    goes, and lets any request that names a session id use it; over a WebSocket (/ws, /mcp) a
    session is freed when its connection closes and no other connection reaches it."""
    try:
        request = json.loads(body)
    except ValueError:
        return None  # openenv-core answers a parse error itself
    if not isinstance(request, dict):
        return None
    method, params = request.get("method"), request.get("params")
    if not (isinstance(method, str) and method.startswith("openenv/session/")) and not (
            isinstance(params, dict) and "session_id" in params):
        return None
    request_id = request.get("id")
    return {"jsonrpc": "2.0", "id": request_id if isinstance(request_id, (str, int)) else None, "error": {
        "code": -32600,
        "message": "sessions over HTTP POST /mcp would outlive their connection: open a WebSocket session at /ws "
                   "(or /mcp); it lasts as long as that connection",
    }}


async def _send_json(send: Callable, status: int, detail: str | dict[str, Any]) -> None:
    body = json.dumps(detail if isinstance(detail, dict) else {"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
