"""`seeupo/Remote-v0`: an env served by `seeupo-serve`, as a local gymnasium env.

    env = gym.make("seeupo/Remote-v0", url="http://127.0.0.1:8000", env_id="seeupo/BFCL-v4-v0",
                   env_kwargs={"max_turns": 10})

Each instance holds one OpenEnv WebSocket session (one env on the server), opened at the first
reset. Observations, rewards, `terminated`/`truncated`, info (same keys and JSON types) and
spaces are the served env's. `env_id` / `env_kwargs`, when given, must be what the server
serves (checked at construction), so a run cannot train on another env than it names. Kwargs
compare by value after the env's defaults (`{"max_turns": 10}` matches a server started with
defaults); one that differs is sent with each reset when the server lets sessions set it
(`seeupo-serve --session-kwargs`), and refused otherwise.

The server is not trusted: every answer is bounded (`max_message_bytes`, after permessage-deflate
or gzip decompression too) and checked (the observation in its space, a finite reward of at most
`MAX_ABS_REWARD` in size, boolean `terminated`/`truncated`, a dict info; strings made valid
Unicode) before the caller sees it. Every wait has a whole-answer deadline: the description
(`GET /seeupo/env`) within 1.5 x `connect_timeout_s` in all, however slowly its bytes come; each reset
or step answer within `timeout_s`. The client keeps the env's own turn limit (`max_turns` of the
agreed kwargs) whatever the server says: a step that reaches it without the episode ending is a
`RemoteEnvError`. The token goes only to `url` (WebSocket redirects to another origin drop it;
the description request follows none).

Failures are `RemoteEnvError`: an unreachable server at construction, and a lost session
(server gone, connection dropped, no answer within `timeout_s`, an answer over the bound or
of the wrong shape) at reset or step; the episode is lost with it and the next reset opens a
new session. The vectorized agent ends such an episode as an env error and makes a new env.
An action that is not a string is a `TypeError` (the wire carries text only); reset options
are checked as every env checks them (`seeupo_gym.options`).

Needs the `serve` extra (`websockets`). `env_target` maps the trainer's `env.workers` /
`env.url` choice to the id and kwargs `gym.make` takes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import zlib
from typing import Any, Mapping

import gymnasium as gym

from seeupo_gym.options import task_id_option
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.text import valid_unicode

TOKEN_ENV = "SEEUPO_SERVE_TOKEN"
# The server's description (task ids, spaces, kwargs): BFCL's 800 ids take ~25 kB.
MAX_DESCRIPTION_BYTES = 8 << 20
# The largest reward taken from outside. Our envs score in [-1, 1]; the bound keeps every reward,
# and sums and squares of a batch of them, finite in the float32 tables trainers keep (verl's scores).
MAX_ABS_REWARD = 1e6


class RemoteEnvError(RuntimeError):
    """The env's server or worker is unreachable, the session with it is lost, or it answered
    with something an env does not return."""


def _valid_strings(value: Any, depth: int = 0) -> Any:
    """`value` (decoded JSON, or a Ray worker's info) with every string valid Unicode."""
    if isinstance(value, str):
        return valid_unicode(value)
    if depth > 64:
        raise RemoteEnvError("info nests deeper than 64 levels")
    if isinstance(value, dict):
        return {valid_unicode(str(key)): _valid_strings(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_valid_strings(item, depth + 1) for item in value]
    if isinstance(value, tuple):  # from a Ray worker: kept a tuple, as the local env returns it
        return tuple(_valid_strings(item, depth + 1) for item in value)
    return value


def checked_reset(result: Any, space: gym.Space, source: str) -> tuple[str, dict[str, Any]]:
    """`(observation, info)` from a remote env's reset, or `RemoteEnvError` naming what is wrong."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise RemoteEnvError(f"{source} answered reset with {type(result).__name__}, not (observation, info)")
    return _checked_observation(result[0], space, source), _checked_info(result[1], source)


def checked_step(result: Any, space: gym.Space, source: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """`(observation, reward, terminated, truncated, info)` from a remote env's step, each
    checked (the observation in `space`, a finite reward, two bools, a dict), or `RemoteEnvError`."""
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        raise RemoteEnvError(f"{source} answered step with {type(result).__name__}, not a 5-tuple")
    observation, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise RemoteEnvError(f"{source} sent reward {reward!r:.60}; a reward is a finite number")
    if abs(reward) > MAX_ABS_REWARD:
        raise RemoteEnvError(f"{source} sent reward {float(reward):.3g}; a reward is at most {MAX_ABS_REWARD:g} in size")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool):
            raise RemoteEnvError(f"{source} sent {name}={flag!r:.60}; it must be true or false")
    return _checked_observation(observation, space, source), float(reward), terminated, truncated, _checked_info(info, source)


def _checked_observation(observation: Any, space: gym.Space, source: str) -> str:
    if not isinstance(observation, str):
        raise RemoteEnvError(f"{source} sent an observation of type {type(observation).__name__}, not text")
    if not space.contains(observation):
        raise RemoteEnvError(f"{source} sent an observation of {len(observation)} characters, outside {space}")
    return valid_unicode(observation)


def _checked_info(info: Any, source: str) -> dict[str, Any]:
    if not isinstance(info, dict):
        raise RemoteEnvError(f"{source} sent info of type {type(info).__name__}, not a dict")
    return _valid_strings(info)


def _bounded_json(response: Any, limit: int, source: str, deadline: float = math.inf,
                  late: Exception | None = None) -> Any:
    """The JSON body of a streamed httpx response, read raw and decompressed by us, each at most
    `limit` bytes; reading stops at `deadline` (`time.monotonic()`), raising `late` if given."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        raise RemoteEnvError(f"{source} sent a body encoded as {encoding!r:.40}; expected identity or gzip")
    raw = bytearray()
    for chunk in response.iter_raw():
        raw += chunk
        if len(raw) > limit:
            raise RemoteEnvError(f"{source} sent a body over {limit} bytes")
        if time.monotonic() > deadline:
            raise late or RemoteEnvError(f"{source} did not finish its answer in time ({len(raw)} bytes so far)")
    body = bytes(raw)
    if encoding == "gzip":
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            body = inflate.decompress(body, limit + 1)
        except zlib.error as error:
            raise RemoteEnvError(f"{source} sent a broken gzip body: {error}") from None
        if len(body) > limit or inflate.unconsumed_tail:
            raise RemoteEnvError(f"{source} sent a gzip body over {limit} bytes once decompressed")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise RemoteEnvError(f"{source} sent a body that is not JSON: {error}"[:300]) from None


def _json_value(value: Any) -> Any:
    """`value` as it travels (tuples as lists...), to compare kwargs by value."""
    return json.loads(json.dumps(value, default=str))


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


def _space(description: Any) -> UnicodeText:
    if not isinstance(description, dict) or description.get("type") != "UnicodeText":
        raise RemoteEnvError(f"the server describes a space this client does not know: {str(description)[:200]}")
    try:
        return UnicodeText(int(description["max_length"]), min_length=int(description.get("min_length", 0)))
    except (KeyError, TypeError, ValueError) as error:
        raise RemoteEnvError(f"the server describes a text space without valid lengths: {str(description)[:200]}") from error


class RemoteEnv(gym.Env[str, str]):
    """A `seeupo-serve` env over one OpenEnv WebSocket session.

    Args:
        url: the server, e.g. "http://127.0.0.1:8000".
        env_id, env_kwargs: what the caller expects the server to serve (None: whatever it serves).
        token: sent as `Authorization: Bearer <token>` to `url` only (default `$SEEUPO_SERVE_TOKEN`).
        timeout_s: longest wait for one answer (an AppWorld step can take its code timeout).
        connect_timeout_s: longest wait to reach the server; its description is read within 1.5 x this in all.
        max_message_bytes: largest answer accepted (a WebSocket message, decompressed); an
            episode's info carries its whole conversation, hence the generous default.
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
        max_message_bytes: int = 32 << 20,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_message_bytes = max_message_bytes
        self._source = f"the env server at {self.url}"
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        served = self._describe()
        if env_id is not None and served["env_id"] != env_id:
            raise ValueError(f"the server at {self.url} serves {served['env_id']!r}, not {env_id!r}")
        self.env_id: str = served["env_id"]
        self.env_kwargs, self._session_kwargs = self._agreed_kwargs(served, env_kwargs)
        self.task_ids: tuple[str, ...] = tuple(str(t) for t in served["task_ids"])
        self.observation_space = _space(served["observation_space"])
        self.action_space = _space(served["action_space"])
        limit = self.env_kwargs.get("max_turns")
        self.max_turns: int | None = limit if type(limit) is int and limit >= 1 else None
        self._turns = 0
        self._ws: Any = None
        self._connection = contextlib.ExitStack()

    def _describe(self) -> dict[str, Any]:
        """The server's description, read within 1.5 x `connect_timeout_s` in all: httpx bounds each
        read (half the timeout here) and the clock is checked between reads, so a server dripping
        its body is cut. Read in the calling thread: this runs in forked vector-env workers, where a
        helper thread could meet a lock another thread held at the fork."""
        import httpx

        deadline = time.monotonic() + self.connect_timeout_s
        late = RemoteEnvError(f"the env server at {self.url} did not describe its env within "
                              f"connect_timeout_s={self.connect_timeout_s:g} s")
        timeout = httpx.Timeout(self.connect_timeout_s, read=self.connect_timeout_s / 2)
        try:
            with httpx.stream("GET", f"{self.url}/seeupo/env", headers={**self._headers, "Accept-Encoding": "gzip"},
                              timeout=timeout, follow_redirects=False) as answer:
                answer.raise_for_status()
                served = _bounded_json(answer, MAX_DESCRIPTION_BYTES, self._source, deadline, late)
        except httpx.ReadTimeout:
            raise late from None
        except httpx.HTTPError as error:
            raise RemoteEnvError(f"cannot reach the env server at {self.url}: {error}") from error
        fields = {"env_id": str, "env_kwargs": dict, "task_ids": list, "observation_space": dict, "action_space": dict}
        if not isinstance(served, dict) or any(not isinstance(served.get(k), t) for k, t in fields.items()):
            raise RemoteEnvError(f"{self._source} describes its env without {sorted(fields)}: {str(served)[:200]}")
        return served

    def _agreed_kwargs(self, served: dict[str, Any],
                       env_kwargs: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the kwargs this env runs with, those each reset must ask the server for)."""
        defaults = served.get("default_kwargs") if isinstance(served.get("default_kwargs"), dict) else {}
        resolved = {**defaults, **served["env_kwargs"]}
        if env_kwargs is None:
            return resolved, {}
        wanted = {**defaults, **_json_value(dict(env_kwargs))}
        differ = sorted(key for key in wanted.keys() | resolved.keys() if wanted.get(key, ...) != resolved.get(key, ...))
        allowed = served.get("session_kwargs") if isinstance(served.get("session_kwargs"), list) else []
        refused = [key for key in differ if key not in allowed]
        if refused:
            raise ValueError(
                f"the server at {self.url} serves {served['env_id']} with "
                f"{ {key: resolved.get(key, '(unset)') for key in refused} }, not "
                f"{ {key: wanted.get(key, '(unset)') for key in refused} }, and lets sessions set only {allowed}; "
                f"start it with the same key=value pairs, or let sessions set these with --session-kwargs"
            )
        return wanted, {key: wanted[key] for key in differ}

    # ------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task_id_option(options)  # refused here as the env would refuse it
        data: dict[str, Any] = dict(options or {})
        if seed is not None:
            data["seed"] = int(seed)
        if self._session_kwargs:
            data["env_kwargs"] = self._session_kwargs
        if self._ws is None:
            self._connect()
        self._turns = 0
        observation = self._observation(self._call({"type": "reset", "data": data}), "reset")
        try:
            return checked_reset((observation.get("text"), observation.get("info")), self.observation_space, self._source)
        except RemoteEnvError:
            self._drop()
            raise

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"a remote env's action must be a string (the model's response), got {type(action).__name__}")
        if self._ws is None:
            raise RemoteEnvError(f"no session with the env server at {self.url}: call reset() first")
        result = self._call({"type": "step", "data": {"response": action}})
        observation = self._observation(result, "step")
        done, truncated = result.get("done"), observation.get("truncated")
        if not isinstance(done, bool) or not isinstance(truncated, bool):
            self._drop()
            raise RemoteEnvError(f"{self._source} sent done={done!r:.40}, truncated={truncated!r:.40}; both must be "
                                 f"true or false")
        step = (observation.get("text"), result.get("reward"), done and not truncated, truncated, observation.get("info"))
        self._turns += 1
        try:
            checked = checked_step(step, self.observation_space, self._source)
            if self.max_turns is not None and self._turns >= self.max_turns and not done:
                raise RemoteEnvError(f"{self._source} did not end the episode at its turn limit "
                                     f"(max_turns={self.max_turns}); the episode is ended here")
            return checked
        except RemoteEnvError:
            self._drop()  # a server that sends such answers is not one to go on with
            raise

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
            # max_size bounds each message after permessage-deflate too (websockets stops inflating there).
            self._ws = self._connection.enter_context(connect(
                f"{ws_url}/ws", additional_headers=self._headers, open_timeout=self.connect_timeout_s,
                max_size=self.max_message_bytes, close_timeout=5,
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
        except Exception as error:  # connection closed, timeout, over max_size, garbage: the session is gone
            self._drop()
            raise RemoteEnvError(
                f"lost the session with the env server at {self.url} ({type(error).__name__}: {error}); "
                f"the episode is gone, reset to start a new one"
            ) from error
        if not isinstance(answer, dict):
            answer = {"type": None, "data": answer}
        details = answer.get("data")
        if answer.get("type") == "error" and isinstance(details, dict):
            if details.get("code") in ("CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"):
                self._drop()  # the server closed this session
            said = valid_unicode(str(details.get("message", details)))[:2000]
            raise RemoteEnvError(f"the env server at {self.url} refused {message['type']}: "
                                 f"{said} ({valid_unicode(str(details.get('code', '?')))[:40]})")
        if answer.get("type") != "observation" or not isinstance(details, dict):
            self._drop()
            raise RemoteEnvError(f"the env server at {self.url} answered {message['type']} with "
                                 f"{valid_unicode(str(answer))[:200]}")
        return details

    def _observation(self, result: dict[str, Any], what: str) -> dict[str, Any]:
        observation = result.get("observation")
        if not isinstance(observation, dict):
            self._drop()
            raise RemoteEnvError(f"{self._source} answered {what} without an observation object")
        return observation

    def _drop(self) -> None:
        self._ws = None
        try:
            self._connection.close()
        except Exception:  # a broken socket may fail to close cleanly; it is gone either way
            pass
