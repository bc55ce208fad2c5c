"""Env workers on Ray (`seeupo/Ray-v0`, `env.workers: ray`) on a local Ray instance with 2 CPUs:
the same batch as local envs, a worker killed mid-episode ends that episode as an env error and
is replaced, and `seeupo-train --config tiny-turnbandit env.workers=ray` collects what the local
run collects. Ray takes seconds to start: few tests, one instance for the module."""

from __future__ import annotations

import json
import os
import signal
import time

import gymnasium as gym
import psutil
import pytest

ray = pytest.importorskip("ray")

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.agents.backends import Backend, HFBackend, SamplingParams  # noqa: E402
from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent  # noqa: E402
from seeupo_gym.remote import RemoteEnvError  # noqa: E402
from seeupo_gym.remote_ray import RayEnv, start_local_ray  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BANDIT = "seeupo/TurnBandit-v0"
KWARGS = {"variant": "easy", "num_tasks": 8, "max_turns": 2}


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=2)  # what RayEnv starts when no cluster address is given
    yield
    ray.shutdown()


def trajectories(batch):
    return [(t.task_id, t.rollout_id, t.reward, t.success, t.truncated, t.info["end"], t.info["actions"],
             t.info["messages"], [(turn.context_ids, turn.response_ids) for turn in t.turns]) for t in batch]


def collect(tiny, **where):
    model, tokenizer = tiny
    with VectorAgent(BANDIT, HFBackend(model, tokenizer), tokenizer, num_envs=2, env_kwargs=KWARGS,
                     sampling=SamplingParams(max_new_tokens=4), **where) as agent:
        assert all(isinstance(env.unwrapped, RayEnv) == (where.get("workers") == "ray") for env in agent.envs)
        return agent.collect([None, "easy-0-3"], group_size=2, seed=5)


def test_ray_workers_collect_the_same_batch_as_local_envs(local_ray, tiny):
    on_ray = trajectories(collect(tiny, workers="ray"))
    assert on_ray == trajectories(collect(tiny))
    assert len(on_ray) == 4 and END_ENV_ERROR not in [t[5] for t in on_ray]  # no env error on either side


class KillsAWorker(Backend):
    """Wraps the real backend; before its second call it kills the Ray actor of env slot 0."""

    def __init__(self, backend):
        self.backend, self.agent, self.calls, self.killed = backend, None, 0, []

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == 2:
            actor = self.agent.envs[0].unwrapped.actor
            self.killed.append(actor)
            ray.kill(actor, no_restart=True)
        return self.backend.generate(prompts, sampling)

    def update_weights(self, state_dict_or_model):
        self.backend.update_weights(state_dict_or_model)


def test_a_worker_killed_mid_episode_ends_it_as_an_env_error_and_is_replaced(local_ray, tiny):
    model, tokenizer = tiny
    backend = KillsAWorker(HFBackend(model, tokenizer))
    with VectorAgent(BANDIT, backend, tokenizer, num_envs=2, env_kwargs=KWARGS, workers="ray",
                     sampling=SamplingParams(max_new_tokens=4)) as agent:
        backend.agent = agent
        batch = agent.collect(["easy-0-1", "easy-0-2"], group_size=1, seed=0).trajectories
        ends = [t.info["end"] for t in batch]
        assert ends[0] == END_ENV_ERROR and "RemoteEnvError" in batch[0].info["error"]
        assert "died during step" in batch[0].info["error"] and ends[1] != END_ENV_ERROR
        replacement = agent.envs[0].unwrapped.actor
        assert replacement != backend.killed[0]
        again = agent.collect(["easy-0-1", "easy-0-2"], group_size=1, seed=0)  # the new worker serves
        assert END_ENV_ERROR not in [t.info["end"] for t in again]
        with pytest.raises(RemoteEnvError, match="died"):
            dead = gym.make("seeupo/Ray-v0", env_id=BANDIT, env_kwargs=KWARGS)
            ray.kill(dead.unwrapped.actor, no_restart=True)
            dead.reset(seed=0)


# Slow suite: a training run on Ray, ~20 s; Ray collecting the local batch stays.
@pytest.mark.slow
def test_seeupo_train_on_ray_workers_collects_the_local_runs_first_step(local_ray, tmp_path, monkeypatch):
    from seeupo_gym.training.cli import train_main

    batches = []
    original = VectorAgent.collect

    def recording(self, *args, **kwargs):  # observes collection, changes nothing
        batch = original(self, *args, **kwargs)
        batches.append((self.envs[0].unwrapped.__class__.__name__, trajectories(batch)))
        return batch

    monkeypatch.setattr(VectorAgent, "collect", recording)
    runs = {}
    for workers in ("local", "ray"):
        out = tmp_path / workers
        code = train_main(["--config", "tiny-turnbandit", f"env.workers={workers}", f"log.output_dir={out}",
                           "train.steps=1", "log.progress_bars=false"])
        assert code == 0
        runs[workers] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    (local_kind, local_batch), (ray_kind, ray_batch) = batches
    assert (local_kind, ray_kind) == ("TurnBanditEnv", "RayEnv")
    assert ray_batch == local_batch and len(local_batch) == 4
    rollout = {k: v for k, v in runs["local"].items() if k.startswith("rollout/") or k.startswith("update/")}
    # Sampled logprobs carry the decode batch's shape in their last bits (per-episode joins rows as
    # they come), hence approx; the rollouts themselves are equal (above).
    assert {k: v for k, v in runs["ray"].items() if k in rollout} == pytest.approx(rollout, rel=1e-6)


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def test_a_local_ray_instance_started_without_an_address_listens_on_loopback_only(local_ray):
    node = ray._private.worker.global_worker.node
    assert node.node_ip_address == "127.0.0.1" and node.gcs_address.startswith("127.0.0.1:")
    listening = set()
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:  # a short-lived worker may be gone by now
            listening |= {(process.name(), c.laddr.ip) for c in process.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    assert {name for name, _ in listening} >= {"gcs_server", "raylet"}
    assert {ip for _, ip in listening} <= LOOPBACK, listening


def test_a_stopped_worker_ends_its_step_at_the_deadline_and_is_killed(local_ray):
    env = gym.make("seeupo/Ray-v0", env_id=BANDIT, env_kwargs=KWARGS, timeout_s=3)
    pid = ray.get(env.unwrapped.actor.describe.remote())["pid"]
    env.reset(seed=0)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteEnvError, match="did not answer step within 3 s; it was killed"):
            env.step("A")
        assert 3 <= time.monotonic() - start < 15
        with pytest.raises(RemoteEnvError, match="is closed"):
            env.step("A")
        start = time.monotonic()
        env.close()  # no graceful close to wait for: the worker is gone
        assert time.monotonic() - start < 2
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_unknown_reset_options_are_refused_as_the_local_env_refuses_them(local_ray):
    env = gym.make("seeupo/Ray-v0", env_id=BANDIT, env_kwargs=KWARGS)
    try:
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['task'\] \(did you mean 'task_id'\?\)"):
            env.reset(options={"task": "easy-0-1"})
        assert env.reset(seed=0, options={"task_id": "easy-0-1"})[1]["task_id"] == "easy-0-1"
    finally:
        env.close()


def test_a_stopped_worker_ends_its_step_at_the_envs_own_deadline_not_the_default(local_ray, monkeypatch):
    import seeupo_gym.remote_ray as remote_ray

    # The env bounds its steps at 2 s (`step_deadline_s`); with a 1 s margin for Ray's call, a
    # stopped worker costs a step 3 s where the default timeout_s (600 s) would wait.
    monkeypatch.setattr(remote_ray, "STEP_MARGIN_S", 1.0)
    tests = os.path.dirname(__file__)
    env = gym.make("seeupo/Ray-v0", env_id="ray_deadline_env:test/DeadlineBandit-v0", env_kwargs=KWARGS,
                   actor_options={"runtime_env": {"env_vars": {"PYTHONPATH": tests}}})
    assert env.unwrapped.timeout_s == 600 and env.unwrapped.step_timeout_s == 3.0
    pid = ray.get(env.unwrapped.actor.describe.remote())["pid"]
    env.reset(seed=0)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteEnvError, match="did not answer step within 3 s; it was killed"):
            env.step("A")
        assert time.monotonic() - start < 15
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        env.close()


def test_an_envs_own_step_deadline_is_read_from_what_it_declares():
    from types import SimpleNamespace

    from seeupo_gym.remote_ray import own_step_deadline_s

    assert own_step_deadline_s(SimpleNamespace(step_deadline_s=5)) == 5.0
    assert own_step_deadline_s(SimpleNamespace(timeout_seconds=10, response_grace_s=10.0)) == 20.0  # AppWorld's
    assert own_step_deadline_s(SimpleNamespace()) is None
    assert own_step_deadline_s(SimpleNamespace(step_deadline_s="soon")) is None
