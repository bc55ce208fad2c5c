"""Start and stop `seeupo-serve` processes for tests (loopback only, any free port)."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

SERVE = [sys.executable, "-m", "seeupo_gym.integrations.openenv_cli"]


class Served:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start(env_id: str, *args: str, env: dict[str, str] | None = None, startup_s: float = 120.0,
          max_open_files: int | None = None) -> Served:
    # The server's log goes to a file: a pipe nobody reads fills up and blocks the server.
    log = tempfile.TemporaryFile(mode="w+")

    def limit_open_files() -> None:
        if max_open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

    process = subprocess.Popen(
        [*SERVE, env_id, "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})},
        preexec_fn=limit_open_files,
    )
    process.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + startup_s
    assert process.stdout is not None
    while True:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready or process.poll() is not None:
            process.kill()
            log.seek(0)
            raise RuntimeError(f"seeupo-serve did not start: {log.read()[-3000:]}")
        line = process.stdout.readline()
        match = re.search(r"at (http://\S+)", line)
        if match:
            break
    url = match.group(1)
    headers = {}
    while time.monotonic() < deadline:  # the socket is bound before uvicorn serves it
        try:
            if httpx.get(f"{url}/health", timeout=5, headers=headers).status_code == 200:
                return Served(process, url)
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("seeupo-serve never answered /health")


@contextlib.contextmanager
def serving(env_id: str, *args: str, **kwargs) -> Iterator[Served]:
    served = start(env_id, *args, **kwargs)
    try:
        yield served
    finally:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait(timeout=30)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def serving_in_process(app, startup_s: float = 30.0) -> Iterator[str]:
    """`app` (from `openenv_server.create_app`) on 127.0.0.1, any free port, in a thread of this
    process: no interpreter start and no imports to pay again. Yields the URL; closes every env."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        app.state.close_all()
