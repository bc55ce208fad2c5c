"""What the default sandbox (gVisor, a fresh kernel per episode) costs an AppWorld server against
bubblewrap: start-up, reset, step, host tasks and memory, in one alternating run (both see the
same machine load).

    .venv/bin/python scripts/bench_appworld_sandbox.py [--blocks 2 --block 2 --think-s 0,20]

One server per backend: `sandbox="bwrap"`, and the default settings (`sandbox="auto"`: gVisor
where runsc runs, each episode in a cell sandbox no episode ran in, started ahead while the
previous episode runs; `--shared-kernel` adds gVisor with `fresh_kernel_per_episode=False`, an
env's episodes in one kernel). Then blocks of `--block` episodes per backend, taking turns: a
reset (`open_episode`), an API-call step, `--think-s` seconds of the policy thinking (nothing
runs), the episode's end. Each think time is its own row: with 0 the next gVisor sandbox has
no time to start ahead, so its start-up lies on the reset's path; with a policy's think time
it does not. Host tasks (processes and threads) and memory (RSS; USS, which does not count
shared pages twice): every host process of the server (bwrap or runsc, its gofer, Sentry and
stubs, the workers, the sandbox started ahead), summed, while an episode is open. Prints p50/p95
and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

from seeupo_gym.appworld import find_data_dir, find_python
from seeupo_gym.appworld.sandbox import SandboxLimits
from seeupo_gym.appworld.server import AppWorldServer


def percentiles(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    return f"p50 {statistics.median(ms):8.1f} ms  p95 {ms[int(0.95 * (len(ms) - 1))]:8.1f} ms  (n={len(ms)})"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def server_processes(server: AppWorldServer) -> list[psutil.Process]:
    """Every host process whose command line names the server's folder, or descends from one of
    its workers (the bwrap workers' command lines do not name it)."""
    root, found = str(server.root), {}
    roots = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if root in " ".join(process.info["cmdline"] or []):
                roots.append(process)
        except psutil.Error:
            continue
    for pid in (server.pid, server._grader.pid):  # noqa: SLF001  the bench reads the host processes
        try:
            roots.append(psutil.Process(pid))
        except (psutil.Error, TypeError, ValueError):
            pass
    for process in roots:
        try:
            for one in [process, *process.children(recursive=True)]:
                found[one.pid] = one
        except psutil.Error:
            continue
    return list(found.values())


def footprint(server: AppWorldServer) -> tuple[int, float, float]:
    """(host tasks, RSS MiB, USS MiB) of the server's processes."""
    tasks, rss, uss = 0, 0, 0
    for process in server_processes(server):
        try:
            info = process.memory_full_info()
            tasks, rss, uss = tasks + process.num_threads(), rss + info.rss, uss + info.uss
        except psutil.Error:
            continue
    return tasks, rss / 2**20, uss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--think-s", default="0,20", help="comma-separated seconds between a step and the episode's end")
    parser.add_argument("--shared-kernel", action="store_true", help="add gVisor with one kernel for an env's episodes")
    args = parser.parse_args()
    thinks = [float(x) for x in args.think_s.split(",")]
    data = find_data_dir("mini")
    print(f"load average before: {load()} on {os.cpu_count()} CPUs")
    setups = {"bwrap": dict(sandbox="bwrap"), "default": {}}
    if args.shared_kernel:
        setups["gvisor-shared-kernel"] = dict(sandbox="gvisor", limits=SandboxLimits(fresh_kernel_per_episode=False))
    servers, startup, sizes = {}, {}, {}
    try:
        for name, options in setups.items():
            began = time.monotonic()
            servers[name] = AppWorldServer(find_python(), data, **options)
            servers[name].start()
            servers[name].wait_ready()
            startup[name] = time.monotonic() - began
        times = {name: {think: {"reset": [], "step": []} for think in thinks} for name in servers}
        for think in thinks:
            for _ in range(args.blocks):
                for name, server in servers.items():
                    for _ in range(args.block):
                        began = time.monotonic()
                        server.open_episode("mininote_1", timeout_seconds=10, max_interactions=1000)
                        times[name][think]["reset"].append(time.monotonic() - began)
                        began = time.monotonic()
                        server.execute("profile = apis.supervisor.show_profile()", timeout=60)
                        times[name][think]["step"].append(time.monotonic() - began)
                        time.sleep(think)
                        sizes.setdefault(name, []).append(footprint(server))
                        server.close_episode(collect=False)
        print(f"load average after: {load()}")
        for name, server in servers.items():
            print(f"{name} ({server.sandbox}{', fresh kernel per episode' if server.fresh_kernels else ''}):")
            print(f"  start-up (both workers ready)         {1000 * startup[name]:8.0f} ms")
            for think in thinks:
                print(f"  think {think:4.0f} s: reset (fresh episode)   {percentiles(times[name][think]['reset'])}")
                print(f"  think {think:4.0f} s: API-call step           {percentiles(times[name][think]['step'])}")
            tasks, rss, uss = (max(values) for values in zip(*sizes[name]))
            print(f"  host tasks, episode open (max)        {tasks:6d}")
            print(f"  host memory, episode open (max)       RSS {rss:6.0f} MiB  USS {uss:6.0f} MiB")
        for name in servers:
            if name == "bwrap":
                continue
            for think in thinks:
                for key in ("reset", "step"):
                    ratio = statistics.median(times[name][think][key]) / statistics.median(times["bwrap"][think][key])
                    print(f"think {think:g} s: {key} p50 {name} / bwrap: {ratio:.2f}x")
    finally:
        for server in servers.values():
            server.shutdown()


if __name__ == "__main__":
    main()
