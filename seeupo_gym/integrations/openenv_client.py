"""Typed OpenEnv clients of `seeupo-serve`: the wire models, an `EnvClient`, and a resource session
for OpenEnv's harness API (TRL's AsyncGRPO OpenEnv harness drives these). Needs the serve extra;
imports nothing of the server, so a client machine needs no env code.

- `ResponseAction` / `TextObservation` / `SeeupoState`: what a `/ws` session sends and receives
  (the server validates with these same models);
- `SeeupoEnv(base_url=...)`: the typed client (`reset(seed=..., task_id=...)`, `step(ResponseAction(
  response=...))` or `step("...")`, `state()`); `.sync()` for the blocking version;
- `SeeupoToolSessionFactory(base_url=...)`: per-rollout `ResourceSession`s over the MCP tools of an
  env served in the tools format (`openenv.core.mcp_client.MCPToolClient` underneath); a tool call is
  one step of the env, its result carries the step's reward, and `verify()` returns the episode's.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Mapping
from urllib.parse import urlsplit

from seeupo_gym.integrations import import_openenv_core, is_loopback

import_openenv_core()  # before any openenv import: skips its web playground

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.mcp_types import Tool
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult
from openenv.core.mcp_client import MCPToolClient
from pydantic import Field, ValidationError

ACTION_SHAPE = '{"response": "<the model\'s whole response for this turn>"}'


class ActionShapeError(ValueError):
    """A step's data is not a `ResponseAction`; the message names the field it expects."""


class ResponseAction(Action):
    """One turn: the model's whole response."""

    response: str = Field(description="the model's whole response for this turn")

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> "ResponseAction":
        # openenv answers a pydantic error with a bare "Invalid message"; this one says what to send.
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError:
            raise ActionShapeError(action_shape_problem(obj)) from None


def action_shape_problem(data: Any) -> str:
    """Why `data` is not a step's action, naming the `response` field it must hold."""
    if not isinstance(data, dict):
        return f"a step's data must be an object {ACTION_SHAPE}, got {type(data).__name__}"
    if "response" not in data:
        return f"a step's data must be {ACTION_SHAPE}: the field `response` is missing (got {sorted(map(str, data))[:8]})"
    if not isinstance(data["response"], str):
        return f"a step's `response` must be a string, got {type(data['response']).__name__}"
    extra = sorted(set(map(str, data)) - {"response", "metadata"})
    return f"a step's data must be {ACTION_SHAPE} and nothing else; unexpected field(s) {extra[:8]}"


class TextObservation(Observation):
    """What the env returned: its observation string, whether it truncated, and its info."""

    text: str = Field(default="", description="the env's observation string")
    truncated: bool = Field(default=False, description="the episode ended at a limit (max_turns), not by itself")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's info, JSON-safe, same keys as locally")


class SeeupoState(State):
    """A session's state: the episode's id, its turn (responses so far), its task and whether it is over."""

    turn: int = Field(default=0, ge=0, description="responses in this episode so far")
    task_id: str | None = Field(default=None, description="the episode's task id")
    done: bool = Field(default=True, description="no episode is running (none started, or it ended)")


def refuse_proxied_credentials(base_url: str | None, headers: Mapping[str, str] | None) -> None:
    """Refuse credentials that OpenEnv's client would send through a proxy.

    Its WebSocket connect bypasses proxies for loopback only and otherwise follows the proxy variables
    (websockets' rule: urllib's `getproxies`, `proxy_bypass`). A token in `headers` would then reach the
    proxy's host as well as the server: refused in one line naming the proxy and the way out."""
    if not base_url or not headers or not any(k.lower() in ("authorization", "cookie") for k in headers):
        return
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if is_loopback(host):
        return
    secure = parts.scheme in ("https", "wss")
    try:
        port = parts.port or (443 if secure else 80)
    except ValueError:
        return  # not a URL a connect could use; the client's own error names it
    if urllib.request.proxy_bypass(f"{host}:{port}"):
        return
    proxies = urllib.request.getproxies()
    schemes = ("wss", "socks", "https") if secure else ("ws", "socks", "https", "http")
    proxy = next((proxies[s] for s in schemes if proxies.get(s)), None)
    if proxy:
        raise ValueError(
            f"refusing to send credentials to {host} through the proxy {urlsplit(proxy).hostname!r} (from the "
            f"proxy variables): add {host} to NO_PROXY, or unset the proxy variables"
        )


class SeeupoEnv(EnvClient[ResponseAction, TextObservation, SeeupoState]):
    """OpenEnv client of a `seeupo-serve` session: `SeeupoEnv(base_url="http://host:port")`."""

    def __init__(self, base_url: str | None = None, *args: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> None:
        refuse_proxied_credentials(base_url, headers)
        super().__init__(base_url, *args, headers=headers, **kwargs)

    def _step_payload(self, action: ResponseAction | str) -> dict[str, Any]:
        if isinstance(action, str):
            return {"response": action}
        return {"response": action.response}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TextObservation]:
        fields = dict(payload.get("observation") or {})
        fields.pop("metadata", None)
        observation = TextObservation(**fields, reward=payload.get("reward"), done=bool(payload.get("done")))
        return StepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done")))

    def _parse_state(self, payload: dict[str, Any]) -> SeeupoState:
        return SeeupoState(**payload)


# ------------------------------------------------------------------------------------- harness


class SeeupoToolSession(ResourceSession):
    """One rollout over the MCP tools of an env `seeupo-serve` serves in the tools format."""

    def __init__(self, base_url: str, reset_kwargs: dict[str, Any], **client_kwargs: Any) -> None:
        refuse_proxied_credentials(base_url, client_kwargs.get("headers"))
        self._client = MCPToolClient(base_url=base_url, **client_kwargs).sync()
        self._closed = False
        self._reward: float | None = None
        self._done = False
        try:
            self._client.connect()
            result = self._client.reset(**reset_kwargs)
            self._first = result.observation
            self._tools = self._client.list_tools(use_cache=False)
        except BaseException:
            self.close()
            raise

    def initial_messages(self) -> list[dict[str, Any]]:
        """The env's chat so far (system prompt and first user message), as its info holds it."""
        info = getattr(self._first, "info", None) or {}
        return [dict(message) for message in info.get("messages") or []]

    def list_tools(self) -> list[Tool]:
        return list(self._tools)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            step = self._client.call_tool(name, **arguments)
        except RuntimeError as error:  # the server refused the call: nothing ran
            return ToolResult(data=f"Error: {error}", error=str(error))
        if not isinstance(step, dict) or "observation" not in step:
            raise RuntimeError(f"seeupo-serve answered {name} with {json.dumps(step)[:200]}, not a step result")
        self._done = bool(step.get("done"))
        if self._done:
            self._reward = float(step.get("reward") or 0.0)
        return ToolResult(data=step["observation"], done=self._done,
                          metadata={"reward": step.get("reward"), "truncated": bool(step.get("truncated"))})

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        """The env's reward for the episode (None while it is still running: unscored, not 0)."""
        return VerifyResult(env_reward=self._reward, done=self._done)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()


class SeeupoToolSessionFactory(ResourceSessionFactory[SeeupoToolSession]):
    """Sessions over `seeupo-serve`'s MCP tools; `task` is a task id, or a dict of reset kwargs
    (`{"task_id": ...}`, with `seed` and any options the env takes)."""

    def __init__(self, base_url: str, **client_kwargs: Any) -> None:
        self.base_url = base_url
        self.client_kwargs = client_kwargs

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> SeeupoToolSession:
        reset_kwargs = dict(task) if isinstance(task, dict) else {"task_id": task} if task is not None else {}
        if seed is not None:
            reset_kwargs.setdefault("seed", seed)
        if episode_id is not None:
            reset_kwargs["episode_id"] = episode_id
        return SeeupoToolSession(self.base_url, reset_kwargs, **self.client_kwargs)
