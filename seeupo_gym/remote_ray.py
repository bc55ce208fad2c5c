"""`seeupo/Ray-v0`: a registered env running in a Ray actor, as a local gymnasium env.

    env = gym.make("seeupo/Ray-v0", env_id="seeupo/AppWorld-v0", env_kwargs={"split": "mini"})

Each instance starts one actor (placed by Ray: `actor_options` are Ray's, e.g.
`{"num_cpus": 1}` or `{"resources": {"envs": 1}}` to keep envs off the GPU nodes) holding
the real env; reset/step/close are calls to it. A step's deadline follows the env's own: an env
that bounds its steps (`step_deadline_s`, or AppWorld's `timeout_seconds + response_grace_s`) gets
that plus `STEP_MARGIN_S` (Ray's call and the env's bookkeeping around it), so a stopped actor
costs a step seconds, not `timeout_s`; an env that declares no bound is taken to step within
`UNDECLARED_STEP_S` (ours without one are pure Python: TurnBandit in microseconds, BFCL's calls
start within its `call_seconds_per_step`), the same margin added; resets wait `timeout_s`. The
client also keeps the env's turn limit (its `max_turns`): a step that reaches it without the
episode ending is a `RemoteEnvError`, so an episode costs at most `max_turns` step deadlines. Ray is joined
as `ray.init()` finds it (`$RAY_ADDRESS` for a cluster); without one, a local instance is started on 127.0.0.1
(`start_local_ray`), not on the machine's network address. Exceptions the env raises come
back as they are; an actor that dies (its process killed, its node lost) or does not answer
within its deadline (stopped, hung: it is then killed), or answers with something an env does
not return (`seeupo_gym.remote.checked_step`), is a `RemoteEnvError`, and the vectorized agent
then ends the episode as an env error and makes a new env, so a new actor. Every worker needs
seeupo-gym installed (the `ray` extra).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import gymnasium as gym

from seeupo_gym.options import task_id_option
from seeupo_gym.remote import RemoteEnvError, checked_reset, checked_step, turn_cap

STEP_MARGIN_S = 30.0
# The step bound assumed for an env that declares none (see the module docstring).
UNDECLARED_STEP_S = 30.0


def own_step_deadline_s(env: Any) -> float | None:
    """The longest one step of `env` takes by its own bounds: its `step_deadline_s`, or an env with
    a code time limit and a grace after it (AppWorld) their sum; None when it declares none."""
    declared = getattr(env, "step_deadline_s", None)
    if declared is None and hasattr(env, "timeout_seconds") and hasattr(env, "response_grace_s"):
        declared = env.timeout_seconds + env.response_grace_s
    try:
        declared = float(declared) if declared is not None else None
    except (TypeError, ValueError):
        return None
    return declared if declared is not None and declared > 0 else None


class EnvWorker:
    """The actor's body: one env made in the worker process."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any]) -> None:
        import seeupo_gym  # noqa: F401  (registers the ids)

        self.env = gym.make(env_id, **env_kwargs)

    def describe(self) -> dict[str, Any]:
        ids = getattr(self.env.unwrapped, "task_ids", None)
        return {
            "pid": os.getpid(),
            "observation_space": self.env.observation_space,
            "action_space": self.env.action_space,
            "task_ids": tuple(str(t) for t in (ids() if callable(ids) else ids or ())),
            "step_deadline_s": own_step_deadline_s(self.env.unwrapped),
            "max_turns": getattr(self.env.unwrapped, "max_turns", None),
        }

    def reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, ...]:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


@functools.cache
def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError("env workers on Ray need the ray extra: pip install 'seeupo-gym[ray]'") from error
    return ray


@functools.cache
def _actor_class() -> Any:
    return _ray().remote(EnvWorker)


def start_local_ray(**init_kwargs: Any) -> None:
    """Start a Ray instance on this machine, its services bound to 127.0.0.1.

    Ray resolves a loopback node address to the machine's network address unless its
    one-machine switch (`ENABLE_RAY_CLUSTER`, read from the environment at import) is off;
    it is turned off for this call only and restored, since the value is Ray's."""
    ray = _ray()
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(_node_ip_address="127.0.0.1", **{"include_dashboard": False, "log_to_driver": False, **init_kwargs})
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


class RayEnv(gym.Env[str, str]):
    """`env_id` (made with `env_kwargs`) in a Ray actor started with `actor_options`; `timeout_s`
    bounds a reset, and caps a step's deadline (`step_timeout_s`: the env's own step bound, or
    `UNDECLARED_STEP_S`, plus `STEP_MARGIN_S`; see the module)."""

    metadata = {"render_modes": []}

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any] | None = None, *,
                 actor_options: Mapping[str, Any] | None = None, timeout_s: float = 600.0,
                 start_timeout_s: float = 300.0) -> None:
        ray = _ray()
        if not ray.is_initialized():
            # Ray's start prints nothing for up to a minute: say what is being waited for.
            import sys
            import time

            started = time.perf_counter()
            where = os.environ.get("RAY_ADDRESS")
            print(f"seeupo: joining the Ray cluster at {where} ..." if where else
                  "seeupo: starting a local Ray instance for the env workers (127.0.0.1; up to a minute) ...",
                  file=sys.stderr, flush=True)
            if where:
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                start_local_ray()
            print(f"seeupo: Ray is up ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        self.timeout_s = timeout_s
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self._actor = _actor_class().options(**dict(actor_options or {})).remote(env_id, self.env_kwargs)
        self._source = f"the Ray env worker for {env_id}"
        described = self._get("describe", (), start_timeout_s)
        self.observation_space = described["observation_space"]
        self.action_space = described["action_space"]
        self.task_ids: tuple[str, ...] = described["task_ids"]
        own = described.get("step_deadline_s")
        self.step_timeout_s = min(timeout_s, (own if own is not None else UNDECLARED_STEP_S) + STEP_MARGIN_S)
        self.max_turns: int = turn_cap(self.env_kwargs.get("max_turns"), described.get("max_turns"))
        self._turns = 0

    @property
    def actor(self) -> Any:
        """The Ray actor holding the env."""
        return self._actor

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task_id_option(options)  # refused here as the env would refuse it
        self._turns = 0
        result = self._get("reset", (seed, options), self.timeout_s)
        return checked_reset(result, self.observation_space, self._source)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        result = checked_step(self._get("step", (action,), self.step_timeout_s), self.observation_space, self._source)
        self._turns += 1
        if self._turns >= self.max_turns and not (result[2] or result[3]):
            raise RemoteEnvError(f"{self._source} did not end the episode at its turn limit (max_turns={self.max_turns})")
        return result

    def close(self) -> None:
        actor, self._actor = getattr(self, "_actor", None), None
        if actor is not None:
            ray = _ray()
            try:
                ray.get(actor.close.remote(), timeout=min(60.0, self.timeout_s))
            except Exception:  # dead already, or stuck: the kill below ends it either way
                pass
            ray.kill(actor, no_restart=True)
        super().close()

    def _get(self, what: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        """The actor's `what(*args)`, waited for at most `timeout_s`."""
        ray = _ray()
        stage = "start" if what == "describe" else what
        if self._actor is None:
            raise RemoteEnvError(f"the Ray env worker for {self.env_id} is closed")
        try:
            return ray.get(getattr(self._actor, what).remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            # A stopped or hung actor: end it, so that its env and the trainer's wait end here.
            actor, self._actor = self._actor, None
            ray.kill(actor, no_restart=True)
            raise RemoteEnvError(f"the Ray env worker for {self.env_id} did not answer {stage} within {timeout_s:g} s; "
                                 f"it was killed") from error
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as error:
            raise RemoteEnvError(f"the Ray env worker for {self.env_id} died during {stage}: {error}") from error
        except ray.exceptions.RayTaskError as error:
            # The env itself raised (a bad task id...): the caller gets that exception, as locally.
            cause = getattr(error, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
