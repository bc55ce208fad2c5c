"""Benchmark the AppWorld env's server path against AppWorld in-process, and server start-up.

    .venv/bin/python scripts/bench_appworld.py [--n 200] [--concurrent 4] [--task-id mininote_1]

Prints, for the same code on the same mini task:
- `/execute` latency through a loopback server (what the env pays per step, HTTP only),
- `env.step` latency (adds parsing, the code guard and the task-completed check),
- `world.execute` latency in-process (run under the AppWorld interpreter in a subprocess;
  timed with CLOCK_MONOTONIC because an open world freezes `time.perf_counter`),
and the ratio server / in-process; then server start-up: spawn to first answer, the first
`/initialize` (cold imports) and later ones, and `--concurrent` servers started at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from seeupo_gym.appworld import AppWorldEnv, AppWorldServer, find_data_dir, find_python, render_action

SNIPPETS = {
    "trivial": "x = 1",
    "api_call": "profile = apis.supervisor.show_profile()",
    "print": "print(apis.api_docs.show_api_descriptions(app_name='supervisor'))",
}

IN_PROCESS = r"""
import json, sys, time
from appworld import AppWorld
task_id, n, snippets = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
clock = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)  # not frozen by freezegun
out = {}
with AppWorld(task_id=task_id, experiment_name="bench", timeout_seconds=10) as world:
    for name, code in snippets.items():
        world.execute(code)
        times = []
        for _ in range(n):
            start = clock()
            world.execute(code)
            times.append(clock() - start)
        out[name] = times
print("RESULT " + json.dumps(out))
"""


def summary(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    p95 = ms[int(0.95 * (len(ms) - 1))]
    return f"mean {statistics.fmean(ms):7.2f} ms  median {statistics.median(ms):7.2f} ms  p95 {p95:7.2f} ms"


def timed_start(python: Path, data_dir: Path) -> tuple[AppWorldServer, float]:
    server = AppWorldServer(python, data_dir)
    start = time.monotonic()
    server.start()
    server.wait_ready()
    return server, time.monotonic() - start


def initialize(server: AppWorldServer, task_id: str) -> float:
    start = time.monotonic()
    server.post("/initialize", {"task_id": task_id, "experiment_name": server.experiment_name}, timeout=300)
    return time.monotonic() - start


def bench_server(python: Path, data_dir: Path, task_id: str, n: int) -> dict[str, list[float]]:
    server, startup = timed_start(python, data_dir)
    try:
        first_init = initialize(server, task_id)
        later_inits = [initialize(server, task_id) for _ in range(5)]
        rss_mb = psutil.Process(server.pid).memory_info().rss / 2**20
        print(f"server start-up (spawn -> answers): {startup:6.2f} s")
        print(f"first /initialize (cold imports):  {first_init:6.2f} s")
        print(f"later /initialize:                 {1000 * statistics.median(later_inits):6.1f} ms (median of 5)")
        print(f"server RSS after 6 worlds:         {rss_mb:6.0f} MB")
        results = {}
        for name, code in SNIPPETS.items():
            payload = {"task_id": task_id, "code": code}
            server.post("/execute", payload, timeout=60, idempotent=False)
            times = []
            for _ in range(n):
                start = time.monotonic()
                server.post("/execute", payload, timeout=60, idempotent=False)
                times.append(time.monotonic() - start)
            results[name] = times
        return results
    finally:
        server.shutdown()


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


def bench_in_process(python: Path, data_dir: Path, task_id: str, n: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="seeupo-appworld-bench-") as root:
        (Path(root) / "data").symlink_to(data_dir, target_is_directory=True)
        env = {"APPWORLD_ROOT": root, "IPYTHONDIR": str(Path(root) / ".ipython"), "HOME": str(Path.home()), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [str(python), "-P", "-c", IN_PROCESS, task_id, str(n), json.dumps(SNIPPETS)],
            cwd=root, env=env, capture_output=True, text=True, check=True,
        )
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def bench_concurrent_start(python: Path, data_dir: Path, task_id: str, count: int) -> None:
    start = time.monotonic()
    with ThreadPoolExecutor(count) as pool:
        started = list(pool.map(lambda _: timed_start(python, data_dir), range(count)))
        list(pool.map(lambda pair: initialize(pair[0], task_id), started))
    elapsed = time.monotonic() - start
    for server, _ in started:
        server.shutdown()
    print(f"{count} servers started at once, all past their first /initialize: {elapsed:6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="executions per snippet")
    parser.add_argument("--task-id", default="mininote_1")
    parser.add_argument("--concurrent", type=int, default=4, help="servers to start at once (0: skip)")
    args = parser.parse_args()
    python, data_dir = find_python(), find_data_dir("mini")
    print(f"AppWorld interpreter {python}; data {data_dir}; task {args.task_id}; n={args.n}; "
          f"load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs\n")

    server = bench_server(python, data_dir, args.task_id, args.n)
    step = bench_env_step(data_dir, args.task_id, args.n)
    local = bench_in_process(python, data_dir, args.task_id, args.n)
    print()
    for name, code in SNIPPETS.items():
        ratio = statistics.median(server[name]) / statistics.median(local[name])
        print(f"[{name}] {code}")
        print(f"  world.execute in-process  {summary(local[name])}")
        print(f"  /execute via server       {summary(server[name])}")
        print(f"  env.step (gym)            {summary(step[name])}")
        print(f"  server / in-process (median): {ratio:.2f}x")
    if args.concurrent:
        print()
        bench_concurrent_start(python, data_dir, args.task_id, args.concurrent)


if __name__ == "__main__":
    main()
