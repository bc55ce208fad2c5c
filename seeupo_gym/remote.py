"""`seeupo/Remote-v0`: an env served by `seeupo-serve`, as a local gymnasium env.

    env = gym.make("seeupo/Remote-v0", url="http://127.0.0.1:8000", env_id="seeupo/BFCL-v4-v0",
                   env_kwargs={"max_turns": 10})

Each instance holds one OpenEnv WebSocket session (one env on the server), opened at the first
reset. Observations, rewards, `terminated`/`truncated`, info (same keys and JSON types) and
spaces are the served env's. `env_id` / `env_kwargs`, when given, must be what the server
serves (checked at construction), so a run cannot train on another env than it names.

Failures are `RemoteEnvError`: an unreachable server at construction, and a lost session
(server gone, connection dropped, no answer within `timeout_s`) at reset or step; the episode
is lost with it and the next reset opens a new session. The vectorized agent ends such an
episode as an env error and makes a new env. An action that is not a string is a `TypeError`
(the wire carries text only).

Needs the `serve` extra (`websockets`). `env_target` maps the trainer's `env.workers` /
`env.url` choice to the id and kwargs `gym.make` takes.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Mapping

import gymnasium as gym

from seeupo_gym.spaces import UnicodeText

TOKEN_ENV = "SEEUPO_SERVE_TOKEN"


class RemoteEnvError(RuntimeError):
    """The env's server or worker is unreachable, or the session with it is lost."""


def env_target(
    env_id: str,
    env_kwargs: Mapping[str, Any] | None = None,
    *,
    workers: str = "local",
    url: str | None = None,
    worker_options: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The (id, kwargs) to `gym.make` for `env_id` run locally, on Ray workers, or behind `url`."""
    kwargs = dict(env_kwargs or {})
    if workers not in ("local", "ray"):
        raise ValueError(f"env workers must be 'local' or 'ray', got {workers!r}")
    if url:
        if workers != "local":
            raise ValueError("an env url (a seeupo-serve server) and Ray workers exclude each other; set one")
        return "seeupo/Remote-v0", {"url": url, "env_id": env_id, "env_kwargs": kwargs}
    if workers == "ray":
        return "seeupo/Ray-v0", {"env_id": env_id, "env_kwargs": kwargs, "actor_options": dict(worker_options or {})}
    return env_id, kwargs


def _space(description: Mapping[str, Any]) -> UnicodeText:
    if description.get("type") != "UnicodeText":
        raise RemoteEnvError(f"the server describes a space this client does not know: {description}")
    return UnicodeText(int(description["max_length"]), min_length=int(description.get("min_length", 0)))


class RemoteEnv(gym.Env[str, str]):
    """A `seeupo-serve` env over one OpenEnv WebSocket session.

    Args:
        url: the server, e.g. "http://127.0.0.1:8000".
        env_id, env_kwargs: what the caller expects the server to serve (None: whatever it serves).
        token: sent as `Authorization: Bearer <token>` (default `$SEEUPO_SERVE_TOKEN`).
        timeout_s: longest wait for one answer (an AppWorld step can take its code timeout).
        connect_timeout_s: longest wait to reach the server.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        url: str,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            answer = httpx.get(f"{self.url}/seeupo/env", headers=self._headers, timeout=connect_timeout_s)
            answer.raise_for_status()
            served = answer.json()
        except (httpx.HTTPError, ValueError) as error:
            raise RemoteEnvError(f"cannot reach the env server at {self.url}: {error}") from error
        if env_id is not None and served["env_id"] != env_id:
            raise ValueError(f"the server at {self.url} serves {served['env_id']!r}, not {env_id!r}")
        if env_kwargs is not None and served["env_kwargs"] != json.loads(json.dumps(dict(env_kwargs))):
            raise ValueError(
                f"the server at {self.url} serves {served['env_id']} with kwargs {served['env_kwargs']}, not "
                f"{dict(env_kwargs)}; start it with the same key=value pairs"
            )
        self.env_id: str = served["env_id"]
        self.env_kwargs: dict[str, Any] = served["env_kwargs"]
        self.task_ids: tuple[str, ...] = tuple(served["task_ids"])
        self.observation_space = _space(served["observation_space"])
        self.action_space = _space(served["action_space"])
        self._ws: Any = None
        self._connection = contextlib.ExitStack()

    # ------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"reset(options=...) must be a dict such as {{'task_id': ...}}, got {type(options).__name__}")
        data: dict[str, Any] = dict(options or {})
        if seed is not None:
            data["seed"] = int(seed)
        if self._ws is None:
            self._connect()
        result = self._call({"type": "reset", "data": data})
        return result["observation"]["text"], result["observation"]["info"]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"a remote env's action must be a string (the model's response), got {type(action).__name__}")
        if self._ws is None:
            raise RemoteEnvError(f"no session with the env server at {self.url}: call reset() first")
        result = self._call({"type": "step", "data": {"response": action}})
        observation = result["observation"]
        truncated = bool(observation["truncated"])
        terminated = bool(result["done"]) and not truncated
        return observation["text"], float(result.get("reward") or 0.0), terminated, truncated, observation["info"]

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._ws.send(json.dumps({"type": "close"}))
            except Exception:  # the server may be gone already; the session ends with the socket anyway
                pass
        self._drop()
        super().close()

    # ------------------------------------------------------------------ wire

    def _connect(self) -> None:
        try:
            from websockets.sync.client import connect
        except ImportError as error:
            raise ImportError("seeupo/Remote-v0 needs the serve extra: pip install 'seeupo-gym[serve]'") from error
        ws_url = "ws" + self.url[len("http"):] if self.url.startswith("http") else self.url
        try:
            self._ws = self._connection.enter_context(connect(
                f"{ws_url}/ws", additional_headers=self._headers, open_timeout=self.connect_timeout_s, max_size=None
            ))
        except Exception as error:
            raise RemoteEnvError(f"cannot open a session with the env server at {self.url}: {error}") from error

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            try:
                self._ws.send(json.dumps(message))
            except Exception:
                # A server that refuses the session (at capacity) says why, then closes.
                answer = json.loads(self._ws.recv(timeout=1.0))
            else:
                answer = json.loads(self._ws.recv(timeout=self.timeout_s))
        except Exception as error:  # connection closed, timeout, garbage: the session is gone
            self._drop()
            raise RemoteEnvError(
                f"lost the session with the env server at {self.url} ({type(error).__name__}: {error}); "
                f"the episode is gone, reset to start a new one"
            ) from error
        if answer.get("type") == "error":
            details = answer.get("data", {})
            if details.get("code") in ("CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"):
                self._drop()  # the server closed this session
            raise RemoteEnvError(f"the env server at {self.url} refused {message['type']}: "
                                 f"{details.get('message', details)} ({details.get('code', '?')})")
        if answer.get("type") != "observation":
            self._drop()
            raise RemoteEnvError(f"the env server at {self.url} answered {message['type']} with {str(answer)[:200]}")
        return answer["data"]

    def _drop(self) -> None:
        self._ws = None
        try:
            self._connection.close()
        except Exception:  # a broken socket may fail to close cleanly; it is gone either way
            pass
