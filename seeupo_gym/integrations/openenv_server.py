"""`seeupo-serve`: any registered env over the OpenEnv protocol, on openenv-core's own server.

The wire contract (docs/integrations.md, "Envs beyond one process"):

- a WebSocket session at `/ws` is one env instance; `{"type": "reset", "data": {"seed": 3,
  "task_id": "..."}}` starts an episode, `{"type": "step", "data": {"response": "..."}}` sends
  one whole model response;
- an observation is `{"text", "truncated", "info"}` with the step's `reward` and `done`
  (terminated or truncated) beside it; `info` is the env's info made JSON-safe, same keys. The
  models (`ResponseAction`, `TextObservation`, `SeeupoState`) live in `openenv_client`, which
  clients import without this module; a step whose data is not `{"response": ...}` is refused
  with a message naming `response`;
- an env in the tools format (`action_format=tools`) is also an MCP tool environment (openenv's
  `MCPEnvironment`): `tools/list` gives the episode's tools as JSON schemas (BFCL: the functions
  shown so far; AppWorld: `execute_python`; TurnBandit: `answer`; plus `end_turn(reply)` where a
  plain-text response ends a user turn), and each `tools/call` is one step of the env whose
  response makes that one call, read by the env's own tool-call parser and checks (the same
  bounds, the same `max_turns`); its result is `{"observation", "reward", "done", "truncated",
  "turn", "action_error"}`. A call with no episode running, after the episode ended, or naming
  no listed tool is refused (a JSON-RPC error) and runs nothing;
- `/health`, `/schema`, `/metadata`, `/state` are openenv's; POST `/reset` works as
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
request body complete within `body_timeout_s` (none read for GET or `/health`), a bearer token
required on every route but `/health` when one is set, an `Origin` other than the server's own
or `allowed_origins` refused (a web page of another origin). A session lives as long as the
WebSocket that made it or that attached to it: openenv's `MCPToolClient` creates a session over
HTTP `POST /mcp` (`openenv/session/create`), attaches a WebSocket to it (`/ws?session_id=...`)
and addresses it by id in `tools/*` requests; here such a session is closed when that WebSocket
leaves, or `attach_timeout_s` after its creation if none attached, and an HTTP request may
address a session only while its WebSocket is attached (the session table and that guard, one
`session_id` parser with openenv's: `mcp_sessions.py`; the guard in front of the app, origins,
token and bodies: `request_guard.py`). The connection cap, the per-peer cap and the request-head
deadline are the CLI's (`connections.py`). Every string sent is valid Unicode (lone surrogates
escaped). Errors a client causes come back as error messages (WebSocket) or 4xx answers (HTTP);
the server goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import uuid
from typing import Any, Callable, Mapping

import gymnasium as gym
from fastapi import FastAPI, Request, WebSocketDisconnect
from fastapi.responses import JSONResponse
from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.tools import Tool as MCPTool
from fastmcp.tools import ToolResult as MCPToolResult
from mcp.types import TextContent

# First of the openenv imports: the client module imports openenv.core without its web playground.
from seeupo_gym.integrations.openenv_client import ActionShapeError, ResponseAction, SeeupoState, TextObservation

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import RESERVED_TOOL_NAMES, CallToolAction, ListToolsAction
from openenv.core.env_server.types import ConcurrencyConfig, EnvironmentMetadata
from pydantic import PrivateAttr

from seeupo_gym.integrations.mcp_sessions import SessionServer
from seeupo_gym.integrations.request_guard import BoundedRequests, normal_origin
from seeupo_gym.text import valid_unicode
from seeupo_gym.tools import END_TURN_SCHEMA, END_TURN_TOOL, plain_reply, render_tool_calls, step_tool_result

logger = logging.getLogger(__name__)

# The reset field that carries a session's env kwargs (not an env option).
SESSION_KWARGS_FIELD = "env_kwargs"


class SessionError(RuntimeError):
    """A request this session cannot serve: closed, at capacity, no episode, a bad option."""


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


class GymSession(Environment[ResponseAction, TextObservation, SeeupoState]):
    """One OpenEnv session over one gymnasium env, made at the first reset (so that openenv-core's
    per-request probes, `/state` and `/metadata`, cost nothing) and closed with the session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own env instance
    mcp_refusal: str | None = None  # set on a session MCPToolClient made, where the env has no tools

    def __init__(self, env_id: str, make_env: Callable[[dict[str, Any]], gym.Env], slots: Slots,
                 live: set["GymSession"], lock: threading.Lock, session_kwargs: tuple[str, ...] = ()) -> None:
        Environment.__init__(self)  # not super(): a ToolSession's next base wants its MCP server
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
        self._env_lock = threading.Lock()  # one reset, step or tool call at a time (WebSocket and HTTP alike)
        with lock:
            live.add(self)

    @property
    def busy(self) -> bool:
        """A reset or step is running (the session is not idle, however long it takes)."""
        return self._busy > 0

    def reset(self, seed: Any = None, episode_id: Any = None, **options: Any) -> TextObservation:
        if self.mcp_refusal is not None:
            raise SessionError(self.mcp_refusal)
        self._busy += 1
        try:
            with self._env_lock:
                return self._reset(seed, episode_id, options)
        finally:
            self._busy -= 1

    def step(self, action: ResponseAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        if not isinstance(action, ResponseAction):  # openenv reads MCP actions out of any step's data
            raise SessionError(f"{self.env_id} is served in a format without tools: a step's data is {{\"response\": ...}}; "
                               "MCP tools need the env made with action_format=tools")
        self._busy += 1
        try:
            with self._env_lock:
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
    def state(self) -> SeeupoState:
        return SeeupoState(episode_id=self._episode_id, step_count=self._turn, turn=self._turn, task_id=self._task_id,
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
        # The info travels once, in `info` (openenv would send `metadata` twice more).
        safe = json_safe(info if isinstance(info, dict) else {})
        return TextObservation(text=valid_unicode(str(text)), truncated=truncated, info=safe, done=terminated or truncated,
                               reward=reward)


def without_mcp_tools_message(env_id: str, action_format: Any) -> str:
    """The error an MCP client gets from a server whose env has no tools."""
    shown = f"the {action_format!r} action format" if action_format else "a format without tools"
    return (f"{env_id} is served in {shown}, which has no MCP tools: for MCPToolClient (tools/list, tools/call) "
            f"serve it with action_format=tools (seeupo-serve {env_id} action_format=tools); in this format, "
            "play it over the WebSocket with {\"response\": ...} steps (GenericEnvClient)")


class EnvTool(MCPTool):
    """One tool of the current episode, as FastMCP lists it; a call steps the session's env."""

    _session: Any = PrivateAttr(default=None)

    async def run(self, arguments: dict[str, Any]) -> MCPToolResult:
        # The env's work (a checker, an AppWorld sandbox) must not hold up the server's event loop.
        step = await asyncio.to_thread(self._session.call_tool, self.name, arguments)
        return MCPToolResult(content=[TextContent(type="text", text=step["observation"])], structured_content=step)


class ToolSession(GymSession, MCPEnvironment):
    """A session of an env in the tools format, also an MCP tool environment (openenv's
    `MCPEnvironment`, its FastMCP server holding the episode's tools). A tool call is one env step
    whose response makes that one call (hermes markup, read back by the env's own parser and
    checks: no second parser); `end_turn(reply)` is a plain-text response (a reply the env's
    parser would read as calls is replaced by "Done.", as in the TRL adapter)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        GymSession.__init__(self, *args, **kwargs)
        MCPEnvironment.__init__(self, FastMCP(name="seeupo-serve"))
        self._listed: dict[str, EnvTool] = {}

    # MCPEnvironment routes ListTools / CallTool actions itself; a response goes to GymSession.
    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if isinstance(action, (ListToolsAction, CallToolAction)):
            return MCPEnvironment.step(self, action, timeout_s=timeout_s)
        return GymSession.step(self, action)

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if isinstance(action, (ListToolsAction, CallToolAction)):
            return await MCPEnvironment.step_async(self, action, timeout_s=timeout_s)
        return await asyncio.to_thread(GymSession.step, self, action)

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return GymSession.step(self, action)

    def _reset(self, seed: Any, episode_id: Any, options: dict[str, Any]) -> TextObservation:
        observation = super()._reset(seed, episode_id, options)
        self._list_tools(observation.info)
        return observation

    def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """One tool call as one env step; the step's outcome as the tool's structured result."""
        self._busy += 1
        try:
            with self._env_lock:
                if self._closed:
                    raise ToolError(self._closed_message())
                if self._env is None or self._done:
                    raise ToolError(f"{name}: no episode is running in this session (none started, or it ended); "
                                    "reset first")
                if name not in self._listed:  # a tool of an earlier episode
                    raise ToolError(f"`{name}` is not a tool of this episode (its tools: {sorted(self._listed)})")
                env = self._env.unwrapped
                if name == END_TURN_TOOL:
                    response = plain_reply(arguments.get("reply"), parser=env.tool_parser, template=env.template,
                                           max_chars=env.max_action_chars)
                else:
                    try:
                        response = render_tool_calls([(name, arguments)])
                    except (ValueError, RecursionError) as error:  # values json cannot write (too deep)
                        raise ToolError(f"{name}: the arguments cannot be written as JSON ({type(error).__name__})") from None
                observation = self._step(ResponseAction(response=response))
                self._list_tools(observation.info)
                return {"observation": step_tool_result(observation.text, observation.info),
                        "reward": observation.reward, "done": observation.done, "truncated": observation.truncated,
                        "turn": self._turn, "action_error": str(observation.info.get("action_error", ""))}
        finally:
            self._busy -= 1

    def close(self) -> None:
        GymSession.close(self)
        self._listed = {}
        MCPEnvironment.close(self)

    def _list_tools(self, info: dict[str, Any]) -> None:
        """Make the FastMCP server list the episode's tools now (BFCL reveals functions mid-episode)."""
        env = self._env.unwrapped if self._env is not None else None
        schemas = list(getattr(env, "visible_tools", None) or info.get("tools") or [])
        if getattr(env, "plain_text_ends_turn", False):
            schemas.append(END_TURN_SCHEMA)
        wanted = {schema["function"]["name"]: schema["function"] for schema in schemas}
        reserved = sorted(set(wanted) & RESERVED_TOOL_NAMES)
        if reserved:
            raise SessionError(f"{self.env_id} has tools named {reserved}, which MCP reserves; serve it as a WebSocket env")
        if self.mcp_server is None or set(wanted) == set(self._listed):
            return
        for name in set(self._listed) - set(wanted):
            self.mcp_server.remove_tool(name)
            del self._listed[name]
        for name in set(wanted) - set(self._listed):
            function = wanted[name]
            tool = EnvTool(name=name, description=str(function.get("description", "")),
                           parameters=dict(function.get("parameters") or {"type": "object", "properties": {}}))
            tool._session = self
            self.mcp_server.add_tool(tool)
            self._listed[name] = tool



def _check_reads_rendered_calls(env: Any) -> None:
    """MCP tool calls reach the env as hermes `<tool_call>` markup: its parser must read that."""
    from seeupo_gym.tools import tool_parser

    parsed = tool_parser(env.tool_parser)(render_tool_calls([("probe", {"x": 1})]))
    if parsed.error or [(call.name, dict(call.arguments)) for call in parsed.calls] != [("probe", {"x": 1})]:
        raise ValueError(f"MCP tools need a tool parser that reads <tool_call> blocks; {env.tool_parser!r} does not "
                         "(serve with tool_parser=hermes)")


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
    attach_timeout_s: float = 10.0,
    allowed_origins: tuple[str, ...] | list[str] = (),
) -> FastAPI:
    """The FastAPI app serving `env_id` (made with `env_kwargs`); one env per session.

    `session_kwargs` names the env kwargs a session may set at reset (default: none).
    `allowed_origins`: web origins (`scheme://host[:port]`) whose pages may use the server beside
    its own; a request carrying any other `Origin` is refused.
    The env is made once here, to fail early on bad kwargs and to describe its spaces and tasks.
    """
    import seeupo_gym  # noqa: F401  (registers the ids)

    env_kwargs = dict(env_kwargs or {})
    session_kwargs = tuple(session_kwargs)
    allowed_origins = tuple(normal_origin(origin) for origin in allowed_origins)
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
        action_format = getattr(probe.unwrapped, "action_format", None)
        tools = action_format == "tools"
        if tools:
            _check_reads_rendered_calls(probe.unwrapped)
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
            "mcp_tools": tools,
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

    session_class = ToolSession if tools else GymSession

    def session() -> GymSession:
        return session_class(env_id, make_env, slots, live, live_lock, session_kwargs)

    app = FastAPI(title=f"seeupo-serve {env_id}", docs_url=None, redoc_url=None)
    server = SessionServer(
        session,
        ResponseAction,
        TextObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=idle_timeout_s),
        env_name=env_id,
        state_cls=SeeupoState,
    )
    server.attach_timeout_s = attach_timeout_s
    if not tools:
        server.without_mcp_tools = without_mcp_tools_message(env_id, action_format)
    server.register_routes(app)
    app.state.openenv = server
    app.state.slots = slots

    @app.get("/seeupo/env")
    async def describe() -> dict[str, Any]:
        return {**description, "live_envs": slots.used}

    @app.exception_handler(SessionError)
    async def session_error(request: Request, error: SessionError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(error)})

    @app.exception_handler(ActionShapeError)
    async def action_shape_error(request: Request, error: ActionShapeError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(error)})

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
                           token=token, allowed_origins=allowed_origins)
