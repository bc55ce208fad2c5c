"""Reset and API-call step latency of the sandboxed AppWorld server: this checkout against another, in
alternating blocks (both see the same machine load).

    .venv/bin/python scripts/bench_appworld_reset.py --other /path/to/other/checkout [--blocks 8 --block 5]

Each variant runs in its own process (`PYTHONPATH=<checkout>`), with one server, serving blocks
of `--block` resets (a fresh episode: `open_episode`, then `close_episode`) and as many
API-call steps; the variants take turns block by block. Prints p50/p95 per variant and the
load average before and after. The other checkout needs `data/appworld-mini` and
`.venv-appworld` (symlinks will do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
from seeupo_gym.appworld import AppWorldServer, find_data_dir, find_python
server = AppWorldServer(find_python(), find_data_dir("mini"))
server.start(); server.wait_ready()
server.open_episode("mininote_1", timeout_seconds=10, max_interactions=1000)
server.close_episode(collect=False)
print("READY", flush=True)
for line in sys.stdin:
    n = int(line)
    resets, steps = [], []
    for _ in range(n):
        start = time.monotonic()
        server.open_episode("mininote_1", timeout_seconds=10, max_interactions=1000)
        resets.append(time.monotonic() - start)
        start = time.monotonic()
        server.execute("profile = apis.supervisor.show_profile()", timeout=60)
        steps.append(time.monotonic() - start)
        server.close_episode(collect=False)
    print(json.dumps({"reset": resets, "step": steps}), flush=True)
server.shutdown()
"""


def start(checkout: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    process = subprocess.Popen([sys.executable, "-c", WORKER], cwd=checkout, env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "READY":
            return process
    raise RuntimeError(f"the worker for {checkout} did not start")


def percentiles(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    return f"p50 {statistics.median(ms):7.1f} ms  p95 {ms[int(0.95 * (len(ms) - 1))]:7.1f} ms  (n={len(ms)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block", type=int, default=5)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    variants = {"this": here, "other": args.other.resolve()}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared with other work)")
    workers = {name: start(path) for name, path in variants.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"reset": [], "step": []} for name in variants}
    try:
        for _ in range(args.blocks):
            for name, worker in workers.items():
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write(f"{args.block}\n")
                worker.stdin.flush()
                block = json.loads(worker.stdout.readline())
                for key in ("reset", "step"):
                    times[name][key] += block[key]
    finally:
        for worker in workers.values():
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(timeout=60)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for name, path in variants.items():
        print(f"{name} ({path}):")
        print(f"  reset (fresh episode + open world)  {percentiles(times[name]['reset'])}")
        print(f"  API-call step (execute)             {percentiles(times[name]['step'])}")
    ratio = statistics.median(times["this"]["reset"]) / statistics.median(times["other"]["reset"])
    print(f"reset p50 this / other: {ratio:.2f}x")


if __name__ == "__main__":
    main()
