"""Rollout throughput: N envs batched by VectorAgent versus the same N episodes one after another.

Same model, sampling, tasks and seed in both runs; the batched run makes one backend call per
step for all N envs, the sequential run uses one env slot (N episodes in turn). Prints
generated tokens per second of each, the speed-up, and the peak resident memory of each phase
(sampled every 20 ms; GPU peak too when on CUDA).

    .venv/bin/python scripts/bench_rollout.py --threads 1          # tiny model, BFCL base, 8 envs
    .venv/bin/python scripts/bench_rollout.py --model embedded --max-new-tokens 32 --max-turns 1
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import gymnasium as gym
import psutil
import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.vector import VectorAgent


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
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        if torch.cuda.is_available():
            result["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30


def run(args: argparse.Namespace, model, tokenizer, tasks: list[str | None], num_envs: int) -> dict[str, float]:
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    with VectorAgent(
        args.env, HFBackend(model, tokenizer), tokenizer, num_envs=num_envs, sampling=sampling,
        max_context_tokens=args.max_context_tokens, env_kwargs={"max_turns": args.max_turns},
    ) as agent, peak_rss() as memory:
        cpu_start = time.process_time()
        agent.collect(tasks, group_size=1, seed=args.seed)
        cpu_seconds = time.process_time() - cpu_start
        stats = agent.last_stats
    return {
        "envs": num_envs,
        "episodes": stats.episodes,
        "turns": stats.turns,
        "backend_calls": stats.backend_calls,
        "generated_tokens": stats.generated_tokens,
        "wall_s": round(stats.wall_seconds, 2),
        "generate_s": round(stats.generate_seconds, 2),
        "env_s": round(stats.env_seconds, 3),
        "tokens_per_s": round(stats.tokens_per_second, 2),
        # CPU seconds of this process (all threads): steadier than wall time on a shared machine.
        "cpu_s": round(cpu_seconds, 2),
        "tokens_per_cpu_s": round(stats.generated_tokens / cpu_seconds, 2) if cpu_seconds else 0.0,
        **{k: round(v, 3) for k, v in memory.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | embedded | HF id or local path")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--env", default="seeupo/BFCL-v4-base-v0")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-context-tokens", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with peak_rss() as load_memory:
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    probe = gym.make(args.env, max_turns=args.max_turns)
    task_ids = getattr(probe.unwrapped, "task_ids", None)
    probe.close()
    tasks: list[str | None] = list(task_ids[: args.num_envs]) if task_ids else [None] * args.num_envs

    print(f"model={args.model} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} "
          f"env={args.env} envs={args.num_envs} max_new_tokens={args.max_new_tokens} max_turns={args.max_turns}")
    print(f"model load peak RSS {load_memory['peak_rss_gib']:.2f} GiB")
    batched = run(args, model, tokenizer, tasks, args.num_envs)
    print("batched   ", json.dumps(batched))
    sequential = run(args, model, tokenizer, tasks, 1)
    print("sequential", json.dumps(sequential))
    speedup = batched["tokens_per_s"] / sequential["tokens_per_s"] if sequential["tokens_per_s"] else float("nan")
    cpu_speedup = (
        batched["tokens_per_cpu_s"] / sequential["tokens_per_cpu_s"] if sequential["tokens_per_cpu_s"] else float("nan")
    )
    print(f"\n{args.num_envs} envs batched: {batched['tokens_per_s']:.1f} tok/s, peak RSS {batched['peak_rss_gib']:.2f} GiB")
    print(f"{args.num_envs} envs one after another: {sequential['tokens_per_s']:.1f} tok/s, "
          f"peak RSS {sequential['peak_rss_gib']:.2f} GiB")
    print(f"speed-up: {speedup:.2f}x wall-clock, {cpu_speedup:.2f}x per CPU second")


if __name__ == "__main__":
    main()
