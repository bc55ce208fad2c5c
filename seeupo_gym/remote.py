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
(`GET /seeupo/env`: connecting, status line, headers, `100 Continue`s and body) within
`connect_timeout_s`, however slowly its bytes come; each reset or step answer within `timeout_s`. The client keeps its own turn limit (the caller's `max_turns`, else
the server's, at most `MAX_TURNS_CAP`) whatever the server says: a step that reaches it without the
episode ending is a `RemoteEnvError`. The token goes only to `url`: never to a proxy (neither request reads proxy
settings from the environment), WebSocket redirects to another origin drop it, the description
request follows none.

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
# The local turn cap: the most turns an episode may take where our own config sets none. A limit a
# server or worker declares is capped by it (a declared 10**9 would keep a closing loop stepping).
MAX_TURNS_CAP = 256


def turn_cap(configured: Any, declared: Any = None) -> int:
    """An episode's turn limit: the caller's own `max_turns` when it set one (an int >= 1), else
    what the server or worker declares, at most `MAX_TURNS_CAP`."""
    if type(configured) is int and configured >= 1:
        return configured
    if type(declared) is int and declared >= 1:
        return min(declared, MAX_TURNS_CAP)
    return MAX_TURNS_CAP


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


class _Deadline:
    """httpcore's network backend with one deadline (`time.monotonic()`) for a whole answer:
    connecting, sending, and every read (status line, headers, `100 Continue`s, body) waits at most
    until it, so a server dripping a byte at a time cannot stretch the answer past it."""

    def __init__(self, deadline: float) -> None:
        import httpcore

        self.deadline, self._inner, self._httpcore = deadline, httpcore.SyncBackend(), httpcore

    def left(self, timeout: float | None, expired: type[Exception]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise expired("the answer's deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> Any:
        stream = self._inner.connect_tcp(host, port, self.left(timeout, self._httpcore.ConnectTimeout),
                                         local_address, socket_options)
        return _DeadlineStream(stream, self)

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise self._httpcore.UnsupportedProtocol("a unix socket is not an env server url")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(min(seconds, max(0.0, self.deadline - time.monotonic())))


class _DeadlineStream:
    """One connection under a `_Deadline` (httpcore's `NetworkStream` contract)."""

    def __init__(self, inner: Any, clock: _Deadline) -> None:
        self._inner, self._clock = inner, clock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._clock.left(timeout, self._clock._httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._clock.left(timeout, self._clock._httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        left = self._clock.left(timeout, self._clock._httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left), self._clock)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def get_json(url: str, headers: Mapping[str, str], *, deadline_s: float, limit: int, source: str,
             late: Exception) -> tuple[int, Any]:
    """`GET url` as (status, its JSON body), the whole answer within `deadline_s` (raising `late`
    past it), the body at most `limit` bytes raw and decompressed. httpcore, not httpx: it reads no
    proxy settings from the environment (the token goes to `url` only) and takes the deadline's
    network backend; it follows no redirects."""
    import httpcore

    clock = _Deadline(time.monotonic() + deadline_s)
    try:
        with httpcore.ConnectionPool(network_backend=clock, retries=0) as pool:
            with pool.stream("GET", url, headers={**headers, "Accept-Encoding": "gzip"}) as answer:
                encoding = next((value.decode("latin-1") for name, value in answer.headers
                                 if name.lower() == b"content-encoding"), "identity")
                if answer.status != 200:
                    return answer.status, None
                return answer.status, _bounded_json(encoding, answer.iter_stream(), limit, source)
    except httpcore.TimeoutException:
        raise late from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as error:
        raise RemoteEnvError(f"cannot reach {source}: {type(error).__name__}: {error}"[:500]) from None


def _bounded_json(encoding: str, chunks: Any, limit: int, source: str) -> Any:
    """The JSON of a body read raw (`chunks`) and decompressed by us, each at most `limit` bytes."""
    encoding = encoding.strip().lower()
    if encoding not in ("identity", "gzip"):
        raise RemoteEnvError(f"{source} sent a body encoded as {encoding!r:.40}; expected identity or gzip")
    raw = bytearray()
    for chunk in chunks:
        raw += chunk
        if len(raw) > limit:
            raise RemoteEnvError(f"{source} sent a body over {limit} bytes")
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
        connect_timeout_s: longest wait to reach the server; its whole description is read within it.
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
        own = (env_kwargs or {}).get("max_turns")
        self.max_turns: int = turn_cap(own, self.env_kwargs.get("max_turns"))
        self._turns = 0
        self._ws: Any = None
        self._connection = contextlib.ExitStack()

    def _describe(self) -> dict[str, Any]:
        """The server's description, its whole answer (connecting, status line, headers, body)
        within `connect_timeout_s`. Read in the calling thread: this runs in forked vector-env
        workers, where a helper thread could meet a lock another thread held at the fork."""
        late = RemoteEnvError(f"the env server at {self.url} did not describe its env within "
                              f"connect_timeout_s={self.connect_timeout_s:g} s")
        status, served = get_json(f"{self.url}/seeupo/env", self._headers, deadline_s=self.connect_timeout_s,
                                  limit=MAX_DESCRIPTION_BYTES, source=self._source, late=late)
        if status != 200:
            raise RemoteEnvError(f"cannot reach the env server at {self.url}: GET /seeupo/env answered HTTP {status}")
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
            if self._turns >= self.max_turns and not done:
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
            # max_size bounds each message after permessage-deflate too (websockets stops inflating there);
            # proxy=None: websockets would take $HTTP_PROXY/$ALL_PROXY, and the token with it.
            self._ws = self._connection.enter_context(connect(
                f"{ws_url}/ws", additional_headers=self._headers, open_timeout=self.connect_timeout_s,
                max_size=self.max_message_bytes, close_timeout=5, proxy=None,
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
