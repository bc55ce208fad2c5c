"""Benchmark envs beyond one process: `seeupo-serve` (OpenEnv over WebSocket) and Ray env workers.

    .venv/bin/python scripts/bench_serve.py [--levels 1,8,32] [--seconds 20] [--ray-levels 1,8,32]

Workload: BFCL v4 base ground-truth replays (each episode a reset, its call lists and
turn-ending replies, BFCL's checker at the end; every episode scores 1.0, checked).

Prints, with the load average beside each figure:
- BFCL step latency p50 / p90, in-process env vs `seeupo/Remote-v0` (a loopback `seeupo-serve`)
  vs `seeupo/Ray-v0` (one actor), the variants alternating episode by episode;
- episodes per second with K concurrent sessions (K threads, each driving its own
  `seeupo/Remote-v0` session), K Ray actors, and K in-process envs in K threads (the baseline),
  for K in --levels, the three alternating level by level, each for --seconds.

The server and Ray run on this machine: client, server and workers share its cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end  # noqa: E402
from serve_helpers import serving  # noqa: E402

KWARGS = {"max_turns": 12}
TASKS = [f"multi_turn_base_{i}" for i in range(40)]


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def script(task_id: str) -> list[str]:
    actions = []
    for calls in get_entry(task_id).ground_truth:
        if calls:
            actions.append(render_action(list(calls), thought="calls"))
        actions.append(render_turn_end("Done.", thought="done"))
    return actions


SCRIPTS = {task_id: script(task_id) for task_id in TASKS}
TASKS = [t for t in TASKS if len(SCRIPTS[t]) <= KWARGS["max_turns"]]


def episode(env: gym.Env, task_id: str, step_times: list[float] | None = None) -> None:
    env.reset(seed=0, options={"task_id": task_id})
    for action in SCRIPTS[task_id]:
        start = time.perf_counter()
        _, reward, terminated, truncated, _ = env.step(action)
        if step_times is not None:
            step_times.append(time.perf_counter() - start)
        if terminated or truncated:
            break
    if reward != 1.0:
        raise AssertionError(f"{task_id}: ground truth scored {reward}")


def step_latency(makers: dict[str, callable], episodes: int) -> None:
    envs = {name: make() for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in envs}
    for name, env in envs.items():  # warm-up
        episode(env, TASKS[0])
    for k in range(episodes):
        for name, env in envs.items():  # alternate variants episode by episode
            episode(env, TASKS[k % len(TASKS)], times[name])
    for name, env in envs.items():
        env.close()
        xs = sorted(times[name])
        p50, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
        print(f"  BFCL step, {name:<11} p50 {p50 * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms  ({len(xs)} steps)  [{load()}]")


def throughput(name: str, make, level: int, seconds: float) -> None:
    envs = [make() for _ in range(level)]
    for env in envs:
        env.reset(seed=0, options={"task_id": TASKS[0]})  # sessions / actors up before the clock starts
    done = [0] * level
    deadline = time.perf_counter() + seconds

    def drive(i: int) -> None:
        k = i
        while time.perf_counter() < deadline:
            episode(envs[i], TASKS[k % len(TASKS)])
            done[i] += 1
            k += level

    start = time.perf_counter()
    threads = [threading.Thread(target=drive, args=(i,)) for i in range(level)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for env in envs:
        env.close()
    print(f"  {name:<11} {level:3d} concurrent: {sum(done) / elapsed:7.1f} episodes/s "
          f"({sum(done)} in {elapsed:.1f} s)  [{load()}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--ray-levels", default=None, help="default: --levels")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--latency-episodes", type=int, default=30)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    ray_levels = [int(x) for x in (args.ray_levels or args.levels).split(",")]

    use_ray = not args.no_ray
    if use_ray:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
    print(f"seeupo-serve / Ray benchmark, BFCL base ground truth, {os.cpu_count()} CPUs  [{load()}]", flush=True)
    with serving("seeupo/BFCL-v4-v0", "--max-sessions", str(max(levels) + 2), "max_turns=12") as served:
        local = lambda: gym.make("seeupo/BFCL-v4-v0", **KWARGS)  # noqa: E731
        remote = lambda: gym.make("seeupo/Remote-v0", url=served.url, env_id="seeupo/BFCL-v4-v0",  # noqa: E731
                                  env_kwargs=KWARGS)
        on_ray = lambda: gym.make("seeupo/Ray-v0", env_id="seeupo/BFCL-v4-v0", env_kwargs=KWARGS)  # noqa: E731
        makers = {"in-process": local, "seeupo-serve": remote}
        if use_ray:
            makers["Ray actor"] = on_ray
        print("Step latency (variants alternate episode by episode):", flush=True)
        step_latency(makers, args.latency_episodes)
        print(f"Episodes per second, {args.seconds:.0f} s per figure:", flush=True)
        for level in sorted(set(levels) | set(ray_levels)):  # the variants alternate level by level
            if level in levels:
                throughput("seeupo-serve", remote, level, args.seconds)
            if use_ray and level in ray_levels:
                throughput("Ray actors", on_ray, level, args.seconds)
            if level in levels:
                throughput("in-process", local, level, args.seconds)


if __name__ == "__main__":
    main()
