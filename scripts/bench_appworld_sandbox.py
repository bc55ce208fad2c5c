"""What gVisor costs an AppWorld server against bubblewrap: start-up, reset, step and memory, in one
alternating run (both see the same machine load).

    .venv/bin/python scripts/bench_appworld_sandbox.py [--blocks 3 --block 3]

One server per backend (`sandbox="bwrap"`, `sandbox="gvisor"`), started one after the other;
then blocks of `--block` resets (a fresh episode: `open_episode`) and API-call steps, taking
turns block by block. Memory: the resident memory of every host process of the server (bwrap
or runsc, its gofer and Sentry, the workers), summed (USS where psutil can read it, which does
not count shared pages twice), after the last block. Prints p50/p95 and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

from seeupo_gym.appworld import find_data_dir, find_python
from seeupo_gym.appworld.server import AppWorldServer


def percentiles(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    return f"p50 {statistics.median(ms):8.1f} ms  p95 {ms[int(0.95 * (len(ms) - 1))]:8.1f} ms  (n={len(ms)})"


def server_memory_mb(server: AppWorldServer) -> tuple[float, float]:
    """(RSS, USS) in MiB of every host process whose command line names the server's folder or
    descends from its workers."""
    root, rss, uss, seen = str(server.root), 0, 0, set()
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if root not in " ".join(process.info["cmdline"] or []):
                continue
            for one in [process, *process.children(recursive=True)]:
                if one.pid in seen:
                    continue
                seen.add(one.pid)
                info = one.memory_full_info()
                rss, uss = rss + info.rss, uss + info.uss
        except psutil.Error:
            continue
    # The bwrap workers' command lines do not name the folder: add their trees.
    for pid in (server.pid, server._grader.pid):  # noqa: SLF001  the bench reads the host processes
        try:
            for one in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                if one.pid not in seen:
                    seen.add(one.pid)
                    info = one.memory_full_info()
                    rss, uss = rss + info.rss, uss + info.uss
        except (psutil.Error, TypeError):
            pass
    return rss / 2**20, uss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    data = find_data_dir("mini")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    servers, startup = {}, {}
    try:
        for mode in ("bwrap", "gvisor"):
            began = time.monotonic()
            servers[mode] = AppWorldServer(find_python(), data, sandbox=mode)
            servers[mode].start()
            servers[mode].wait_ready()
            startup[mode] = time.monotonic() - began
        times = {mode: {"reset": [], "step": []} for mode in servers}
        for _ in range(args.blocks):
            for mode, server in servers.items():
                for _ in range(args.block):
                    began = time.monotonic()
                    server.open_episode("mininote_1", timeout_seconds=10, max_interactions=1000)
                    times[mode]["reset"].append(time.monotonic() - began)
                    began = time.monotonic()
                    server.execute("profile = apis.supervisor.show_profile()", timeout=60)
                    times[mode]["step"].append(time.monotonic() - began)
                    server.close_episode(collect=False)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for mode, server in servers.items():
            rss, uss = server_memory_mb(server)
            print(f"{mode}:")
            print(f"  start-up (both workers ready)       {1000 * startup[mode]:8.0f} ms")
            print(f"  reset (fresh episode + open world)  {percentiles(times[mode]['reset'])}")
            print(f"  API-call step (execute)             {percentiles(times[mode]['step'])}")
            print(f"  host memory of the server           RSS {rss:6.0f} MiB  USS {uss:6.0f} MiB")
        for key in ("reset", "step"):
            ratio = statistics.median(times["gvisor"][key]) / statistics.median(times["bwrap"][key])
            print(f"{key} p50 gvisor / bwrap: {ratio:.2f}x")
    finally:
        for server in servers.values():
            server.shutdown()


if __name__ == "__main__":
    main()
