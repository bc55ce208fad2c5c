"""Compare AppWorld reset and step cost of two checkouts, in alternating blocks.

    .venv/bin/python scripts/bench_appworld_ab.py --a /path/to/old/checkout --b . [--rounds 6]

Each checkout runs its own driver process (its `.venv/bin/python`, its own code, its own
sandboxed server) that waits for orders on stdin; blocks of resets and steps alternate between
the two (A, B, B, A, ...), so both see the same machine load. A reset opens a fresh episode of
`--task-id`; a step is `env.step` of one small cell (`--cell`: a trivial assignment by
default). Prints per checkout the median and p90 of each, the ratio B / A, and the load
average beside each block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

DRIVER = r"""
import json, sys, time
import gymnasium as gym
import seeupo_gym
from seeupo_gym.appworld import render_action
env = gym.make("seeupo/AppWorld-v0", split="mini", max_turns=1000, timeout_seconds=10)
env.reset(options={"task_id": sys.argv[1]})
print(json.dumps({"ready": seeupo_gym.__file__}), flush=True)
for line in sys.stdin:
    order = json.loads(line)
    resets, steps = [], []
    for _ in range(order["resets"]):
        start = time.perf_counter()
        env.reset(options={"task_id": sys.argv[1]})
        resets.append(time.perf_counter() - start)
        for _ in range(order["steps"]):
            start = time.perf_counter()
            env.step(render_action(order["cell"]))
            steps.append(time.perf_counter() - start)
    print(json.dumps({"reset": resets, "step": steps}), flush=True)
env.close()
"""


def start(root: Path, task_id: str) -> subprocess.Popen[str]:
    driver = subprocess.Popen(
        [str(root / ".venv" / "bin" / "python"), "-c", DRIVER, task_id], cwd=root, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    ready = json.loads(driver.stdout.readline())
    print(f"{root}: seeupo_gym from {ready['ready']}")
    return driver


def block(driver: subprocess.Popen[str], resets: int, steps: int, cell: str) -> dict[str, list[float]]:
    driver.stdin.write(json.dumps({"resets": resets, "steps": steps, "cell": cell}) + "\n")
    driver.stdin.flush()
    return json.loads(driver.stdout.readline())


def figures(seconds: list[float]) -> tuple[float, float]:
    ms = sorted(1000 * s for s in seconds)
    return statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the reference)")
    parser.add_argument("--b", type=Path, default=Path("."), help="checkout B")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per checkout")
    parser.add_argument("--resets", type=int, default=5, help="resets per block")
    parser.add_argument("--steps", type=int, default=10, help="steps after each reset")
    parser.add_argument("--task-id", default="mininote_1")
    parser.add_argument("--cell", default="x = 1")
    args = parser.parse_args()
    drivers = {"A": start(args.a.resolve(), args.task_id), "B": start(args.b.resolve(), args.task_id)}
    times: dict[str, dict[str, list[float]]] = {name: {"reset": [], "step": []} for name in drivers}
    try:
        for number in range(args.rounds):
            for name in ("AB" if number % 2 == 0 else "BA"):
                got = block(drivers[name], args.resets, args.steps, args.cell)
                load = Path("/proc/loadavg").read_text().split()[0]
                for kind in ("reset", "step"):
                    times[name][kind] += got[kind]
                print(f"round {number} {name}: reset {figures(got['reset'])[0]:7.1f} ms  "
                      f"step {figures(got['step'])[0]:6.2f} ms  (load {load})")
    finally:
        for driver in drivers.values():
            driver.stdin.close()
            driver.wait(timeout=60)
    for kind in ("reset", "step"):
        (a50, a90), (b50, b90) = figures(times["A"][kind]), figures(times["B"][kind])
        print(f"{kind:5s}  A median {a50:7.2f} ms p90 {a90:7.2f}  |  B median {b50:7.2f} ms p90 {b90:7.2f}  "
              f"|  B/A median {b50 / a50:.3f}")


if __name__ == "__main__":
    main()
