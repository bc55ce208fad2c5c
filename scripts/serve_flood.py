"""`/health` of a `seeupo-serve` process (default caps) while half-open connections, request heads
that never end, from many loopback peers hold or exceed every connection slot.

    .venv/bin/python scripts/serve_flood.py [--peers 8] [--per-peer 64] [--requests 50]

Prints the load average, how many of the flood's connections the server still holds, and the
latency of `--requests` sequential `/health` requests from another peer (all must be answered).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_helpers import serving  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--per-peer", type=int, default=64)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    with serving("seeupo/TurnBandit-v0", max_open_files=1024) as served:
        host, port = served.url.removeprefix("http://").split(":")
        flood = []
        for peer in range(args.peers):
            for _ in range(args.per_peer):
                sock = socket.create_connection((host, int(port)), timeout=30, source_address=(f"127.0.1.{10 + peer}", 0))
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                except OSError:
                    pass
                flood.append(sock)
        time.sleep(0.5)
        held = sum(sock not in set(select.select(flood, [], [], 0)[0]) for sock in flood)
        latencies, statuses = [], []
        for _ in range(args.requests):
            start = time.perf_counter()
            statuses.append(httpx.get(f"{served.url}/health", timeout=30).status_code)
            latencies.append(time.perf_counter() - start)
        still = sum(sock not in set(select.select(flood, [], [], 0)[0]) for sock in flood)
        for sock in flood:
            sock.close()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"flood: {len(flood)} half-open connections from {args.peers} peers; held by the server: {held} "
          f"before, {still} after the /health requests")
    print(f"/health: {statuses.count(200)}/{len(statuses)} answered 200; latency median "
          f"{statistics.median(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
