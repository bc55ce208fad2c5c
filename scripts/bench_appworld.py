"""Benchmark the sandboxed AppWorld server against AppWorld in-process.

    .venv/bin/python scripts/bench_appworld.py [--n 200] [--episodes 300] [--task-id mininote_1]

Prints, for the same code on the same mini task:
- `execute` latency through the sandboxed server (Unix socket to a fresh episode process),
- `env.step` latency (adds parsing, the code guard and the task-completed check),
- `world.execute` latency in-process (run under the AppWorld interpreter in a subprocess;
  timed with CLOCK_MONOTONIC because an open world freezes `time.perf_counter`), in blocks
  alternating with the server's, so both see the same machine load,
and the ratio server / in-process; then server start-up (both sandboxes answering), reset
latency (a fresh episode process per reset; p50/p95 after 5 warm-up resets), the grader's
latency, and the memory of the server's processes over `--episodes` episodes. `execute` through the
server includes the warm parent's sweep after every cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from seeupo_gym.appworld import AppWorldEnv, AppWorldServer, find_data_dir, find_python, render_action

BLOCK = 10  # executions per block; server and in-process blocks alternate
SNIPPETS = {
    "trivial": "x = 1",
    "api_call": "profile = apis.supervisor.show_profile()",
    "print": "print(apis.api_docs.show_api_descriptions(app_name='supervisor'))",
}

IN_PROCESS = r"""
import json, sys, time
from appworld import AppWorld
clock = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)  # not frozen by freezegun
with AppWorld(task_id=sys.argv[1], experiment_name="bench", timeout_seconds=10) as world:
    print("READY", flush=True)
    for line in sys.stdin:  # one {"code", "n"} per line; answers with the n times
        request = json.loads(line)
        times = []
        for _ in range(request["n"]):
            start = clock()
            world.execute(request["code"])
            times.append(clock() - start)
        print(json.dumps(times), flush=True)
"""


def summary(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    p95 = ms[int(0.95 * (len(ms) - 1))]
    return f"mean {statistics.fmean(ms):7.2f} ms  median {statistics.median(ms):7.2f} ms  p95 {p95:7.2f} ms"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def tree_pss_mb(pid: int) -> float:
    """Proportional set size of a process and all its descendants (the sandbox's PID 1, warm
    parent, episode): pages shared after a fork count once in the sum, as they do in RAM."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def cgroup_mb(server: AppWorldServer) -> str:
    """What the cell sandbox's memory cgroup is charged now (page cache of files it read and its
    tmpfs scratch included) and at its peak, or why there is none."""
    group = server._cells.cgroup
    if group is None:
        return "no memory cgroup"
    return f"cgroup charge {group.usage_bytes() / 2**20:5.0f} MB (peak {(group.peak_bytes() or 0) / 2**20:5.0f} MB)"


def bench_server(server: AppWorldServer, task_id: str, episodes: int) -> None:
    """Reset and grading latency and memory over `episodes` episodes; prints them."""
    resets, grades, memory = [], [], []
    for episode in range(episodes):
        start = time.monotonic()
        server.open_episode(task_id, timeout_seconds=10, max_interactions=10)
        resets.append(time.monotonic() - start)
        server.execute("profile = apis.supervisor.show_profile()", timeout=60)
        start = time.monotonic()
        server.grade(task_id, server.close_episode(collect=True))
        grades.append(time.monotonic() - start)
        if episode in (0, 9, 99, 199, episodes - 1):
            memory.append((episode + 1, tree_pss_mb(server.pid), tree_pss_mb(server._grader.pid), cgroup_mb(server)))
    warm = resets[5:] or resets
    print(f"reset (fresh episode process + open world), {len(warm)} after warm-up: "
          f"p50 {1000 * percentile(warm, 0.5):6.1f} ms  p95 {1000 * percentile(warm, 0.95):6.1f} ms  "
          f"(first {1000 * resets[0]:.0f} ms)")
    print(f"grade (fresh grader fork, final state only): p50 {1000 * percentile(grades, 0.5):6.1f} ms")
    for count, cells_mb, grader_mb, charged in memory:
        print(f"after {count:4d} episodes: cell sandbox PSS {cells_mb:6.0f} MB ({charged}), "
              f"grader sandbox PSS {grader_mb:6.0f} MB")


class InProcess:
    """AppWorld in a plain subprocess of its interpreter (no sandbox, no server), driven over
    stdin so its timings interleave with the sandbox's: both see the same machine load."""

    def __init__(self, python: Path, data_dir: Path, task_id: str) -> None:
        # AppWorld saves the world's DB changes after every execute; the sandbox saves them to
        # its tmpfs scratch, so this run gets a RAM-backed root too.
        ram = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self._root = tempfile.TemporaryDirectory(prefix="seeupo-appworld-bench-", dir=ram)
        root = Path(self._root.name)
        (root / "data").symlink_to(data_dir, target_is_directory=True)
        env = {"APPWORLD_ROOT": str(root), "IPYTHONDIR": str(root / ".ipython"), "HOME": str(Path.home()),
               "PATH": "/usr/bin:/bin"}
        self._process = subprocess.Popen(
            [str(python), "-P", "-c", IN_PROCESS, task_id], cwd=root, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        while (line := self._process.stdout.readline()) and not line.startswith("READY"):
            pass

    def time(self, code: str, n: int) -> list[float]:
        self._process.stdin.write(json.dumps({"code": code, "n": n}) + "\n")
        self._process.stdin.flush()
        while not (line := self._process.stdout.readline()).startswith("["):
            if not line:
                raise RuntimeError("the in-process AppWorld run died")
        return json.loads(line)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._root.cleanup()


def time_server(server: AppWorldServer, code: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.monotonic()
        server.execute(code, timeout=60)
        times.append(time.monotonic() - start)
    return times


def bench_env_step(data_dir: Path, task_id: str, n: int) -> dict[str, list[float]]:
    env = AppWorldEnv(split="mini", data_dir=data_dir, max_turns=10 * n + 10)
    try:
        env.reset(options={"task_id": task_id})
        results = {}
        for name, code in SNIPPETS.items():
            action = render_action(code, thought="benchmark")
            times = []
            for _ in range(n):
                start = time.monotonic()
                env.step(action)
                times.append(time.monotonic() - start)
            results[name] = times
        return results
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="executions per snippet")
    parser.add_argument("--task-id", default="mininote_1")
    parser.add_argument("--episodes", type=int, default=300, help="episodes for reset latency and memory")
    args = parser.parse_args()
    python, data_dir = find_python(), find_data_dir("mini")
    print(f"AppWorld interpreter {python}; data {data_dir}; task {args.task_id}; n={args.n}; "
          f"load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs\n")

    server = AppWorldServer(python, data_dir)
    start = time.monotonic()
    server.start()
    server.wait_ready()
    print(f"server start-up (spawn -> both sandboxes ready): {time.monotonic() - start:6.2f} s")
    local = InProcess(python, data_dir, args.task_id)
    try:
        bench_server(server, args.task_id, args.episodes)
        server.open_episode(args.task_id, timeout_seconds=10, max_interactions=10 * args.n + 10)
        via, there = {name: [] for name in SNIPPETS}, {name: [] for name in SNIPPETS}
        for name, code in SNIPPETS.items():
            time_server(server, code, 1)
            local.time(code, 1)
            for _ in range(0, args.n, BLOCK):  # alternate blocks: load changes hit both alike
                via[name] += time_server(server, code, BLOCK)
                there[name] += local.time(code, BLOCK)
    finally:
        server.shutdown()
        local.close()
    step = bench_env_step(data_dir, args.task_id, args.n)
    print(f"\nload average {psutil.getloadavg()[0]:.1f} at the end")
    for name, code in SNIPPETS.items():
        ratio = statistics.median(via[name]) / statistics.median(there[name])
        print(f"[{name}] {code}")
        print(f"  world.execute in-process  {summary(there[name])}")
        print(f"  execute via sandbox       {summary(via[name])}")
        print(f"  env.step (gym)            {summary(step[name])}")
        print(f"  server / in-process (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
