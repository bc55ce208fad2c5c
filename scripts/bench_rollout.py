"""Rollout cost: tokens fed to the model per token of the minimum, and generated tokens per second.

Collects B tasks x G rollouts of a multi-turn env with `VectorAgent` and the HF backend, and
counts every token id that goes into a forward pass of the model (prefills, decode steps,
padding included). The minimum is each group's first prompt once plus each trajectory's new
tokens (responses and observation deltas): what a backend that never recomputes a KV entry
would feed. Also prints generated tokens per wall and per CPU second, peak resident memory and,
with a prefix cache, the cache's size against its bound.

    # BFCL base, the paper's 10 turns and group size 8, tiny model
    .venv/bin/python scripts/bench_rollout.py --tasks 2 --group-size 8 --max-turns 10 --max-new-tokens 32
    # the same without the prefix cache (every turn prefills its whole context), and with a small bound
    .venv/bin/python scripts/bench_rollout.py --tasks 2 --group-size 8 --max-turns 10 --max-new-tokens 32 \
        --prefix-cache-mib 0
    .venv/bin/python scripts/bench_rollout.py --tasks 2 --group-size 8 --max-turns 10 --max-new-tokens 32 \
        --prefix-cache-mib 4
    # embedded 0.5B model, kept small: 1 task x 8 rollouts x 3 turns
    .venv/bin/python scripts/bench_rollout.py --model embedded --tasks 1 --group-size 8 --max-turns 3 \
        --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import gymnasium as gym
import psutil
import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.vector import VectorAgent
from seeupo_gym.algorithms.rollout import RolloutBatch


@contextmanager
def peak_rss() -> Iterator[dict[str, float]]:
    """Peak resident set size (GiB) of this process while the block runs."""
    process = psutil.Process()
    result = {"peak_rss_gib": process.memory_info().rss / 2**30}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            result["peak_rss_gib"] = max(result["peak_rss_gib"], process.memory_info().rss / 2**30)
            stop.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()


@contextmanager
def fed_tokens(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Counts the token ids of every forward call of `model` (the padding too: it costs compute)."""
    count = {"fed_tokens": 0, "forward_calls": 0}

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            count["fed_tokens"] += input_ids.numel()
            count["forward_calls"] += 1

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def minimum_tokens(batch: RolloutBatch) -> int:
    """Each group's first prompt once, then every trajectory's tokens beyond what it already held."""
    total = 0
    for members in batch.groups().values():
        prompts = [t.turns[0].context_ids for t in members if t.turns]
        total += len(prompts[0]) if prompts else 0
        for trajectory in members:
            held = trajectory.turns[0].context_ids if trajectory.turns else []
            for turn in trajectory.turns:
                sequence = turn.context_ids + turn.response_ids
                total += len(sequence) - common_prefix(held, sequence)
                held = sequence
    return total


def uncached_tokens(batch: RolloutBatch) -> int:
    """What a backend without prefix reuse feeds: every turn's whole context, then decoding."""
    return sum(len(t.context_ids) + len(t.response_ids) - 1 for trajectory in batch for t in trajectory.turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | embedded | HF id or local path")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--env", default="seeupo/BFCL-v4-base-v0")
    parser.add_argument("--tasks", type=int, default=2, help="B: tasks (the env's first B)")
    parser.add_argument("--group-size", type=int, default=8, help="G: rollouts per task")
    parser.add_argument("--num-envs", type=int, default=None, help="env slots (default: B x G, all at once)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--max-context-tokens", type=int, default=16384)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedule", choices=("per_episode", "lockstep"), default="per_episode")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--prefix-cache-mib", type=float, default=None,
                        help="HF backend prefix cache bound in MiB (0: off; default: the backend's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with peak_rss() as load_memory:
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    probe = gym.make(args.env, max_turns=args.max_turns)
    task_ids = getattr(probe.unwrapped, "task_ids", None)
    probe.close()
    tasks: list[str | None] = list(task_ids[: args.tasks]) if task_ids else [None] * args.tasks
    num_envs = args.num_envs or args.tasks * args.group_size
    backend_kwargs = {} if args.prefix_cache_mib is None else {"prefix_cache_bytes": int(args.prefix_cache_mib * 2**20)}
    backend = HFBackend(model, tokenizer, **backend_kwargs)

    print(f"model={args.model} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} "
          f"env={args.env} tasks={args.tasks} group_size={args.group_size} envs={num_envs} "
          f"max_turns={args.max_turns} max_new_tokens={args.max_new_tokens} schedule={args.schedule} backend={backend_kwargs or 'default'}")
    print(f"model load peak RSS {load_memory['peak_rss_gib']:.2f} GiB")
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    with VectorAgent(
        args.env, backend, tokenizer, num_envs=num_envs, sampling=sampling,
        max_context_tokens=args.max_context_tokens, env_kwargs={"max_turns": args.max_turns}, schedule=args.schedule,
    ) as agent, peak_rss() as memory, fed_tokens(model) as fed:
        cpu_start = time.process_time()
        batch = agent.collect(tasks, group_size=args.group_size, seed=args.seed)
        cpu_seconds = time.process_time() - cpu_start
        stats = agent.last_stats
    minimum = minimum_tokens(batch)
    result: dict[str, Any] = {
        "episodes": stats.episodes,
        "turns": stats.turns,
        "backend_calls": stats.backend_calls,
        "generated_tokens": stats.generated_tokens,
        "fed_tokens": fed["fed_tokens"],
        "forward_calls": fed["forward_calls"],
        "minimum_tokens": minimum,
        "fed_over_minimum": round(fed["fed_tokens"] / minimum, 3),
        # The same trajectories fed by a backend that prefills every context whole.
        "uncached_over_minimum": round(uncached_tokens(batch) / minimum, 3),
        "wall_s": round(stats.wall_seconds, 2),
        "generate_s": round(stats.generate_seconds, 2),
        "tokens_per_s": round(stats.tokens_per_second, 2),
        # CPU seconds of this process (all threads): steadier than wall time on a shared machine.
        "cpu_s": round(cpu_seconds, 2),
        "tokens_per_cpu_s": round(stats.generated_tokens / cpu_seconds, 2) if cpu_seconds else 0.0,
        "peak_rss_gib": round(memory["peak_rss_gib"], 3),
    }
    cache = getattr(backend, "prefix_cache", None)
    if cache is not None:
        result.update(cache.stats())
    print(json.dumps(result))
    print(f"\ntokens fed / minimum: {result['fed_over_minimum']:.2f}x ({fed['fed_tokens']:,} / {minimum:,})")
    print(f"generated: {stats.generated_tokens:,} tokens, {result['tokens_per_s']:.1f} tok/s wall, "
          f"{result['tokens_per_cpu_s']:.1f} tok/CPU-s ({result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU)")
    if cache is not None:
        print(f"prefix cache: {cache.stats()}")


if __name__ == "__main__":
    main()
