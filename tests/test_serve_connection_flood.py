"""Red team: half-open connections (request heads that never end) from many loopback peers, each
under the per-peer limit, held every one of `seeupo-serve`'s connection slots, and `/health` was
refused for as long as they were held; a `--max-connections` above the process's open-file limit let
them exhaust its descriptors instead. A real `seeupo-serve` process (`serve_helpers.serving`)."""

from __future__ import annotations

import resource
import select
import socket
import subprocess
import time

import httpx
import pytest

pytest.importorskip("openenv.core")

from serve_helpers import SERVE, serving  # noqa: E402

MAX_CONNECTIONS, HEAD_S = 40, 8


def connect_from(url: str, source_ip: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30, source_address=(source_ip, 0))


def still_open(sockets: list[socket.socket]) -> int:
    """How many of `sockets` the server has not closed (no end of file or reset waiting)."""
    readable = set(select.select(sockets, [], [], 0)[0])
    return sum(sock not in readable for sock in sockets)


def test_half_open_connections_from_many_peers_cannot_keep_health_out():
    with serving("seeupo/TurnBandit-v0", "--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-peer", "4",
                 "--header-timeout", str(HEAD_S), max_open_files=1024) as served:
        # 4 per peer from 127.0.0.10, .11, ...: every slot, and more, each peer within its limit
        attacker = [connect_from(served.url, f"127.0.0.{10 + i // 4}") for i in range(MAX_CONNECTIONS + 8)]
        try:
            for sock in attacker:
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # a head that never ends
                except OSError:
                    pass
            time.sleep(0.5)
            held = still_open(attacker)
            assert held >= MAX_CONNECTIONS - 1  # the flood holds (nearly) every slot
            start = time.monotonic()
            answers = [httpx.get(f"{served.url}/health", timeout=HEAD_S / 2).status_code for _ in range(5)]
            waited = time.monotonic() - start
            # answered while the flood is held (before: refused until the head deadline freed its slots)
            assert answers == [200] * 5 and waited < HEAD_S / 2
            assert still_open(attacker) >= MAX_CONNECTIONS - 6  # each newcomer closed one waiting head, no more
        finally:
            for sock in attacker:
                sock.close()


def test_a_connection_cap_the_open_file_limit_cannot_hold_is_refused_in_one_line():
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    result = subprocess.run([*SERVE, "seeupo/TurnBandit-v0", "--port", "0", "--max-connections", "2000"],
                            capture_output=True, text=True, timeout=300, preexec_fn=low_limit)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "--max-connections 2000 needs 2256 open files" in last and "lower --max-connections to 768" in last, last
