"""Running the installed commands as a user does: a subprocess, its exit status and its output.

`command(name)` is the console script of this interpreter's environment (`.venv/bin/seeupo-eval`);
`start(...)` resets SIGINT to its default before exec (a background job of a non-interactive shell
inherits it ignored, and Python then raises no KeyboardInterrupt), in a session of its own so that
a test can signal the whole group as a terminal's Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

BIN = Path(sys.executable).parent


def command(name: str) -> str:
    return str(BIN / name)


def dead_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra}
    return env


def run(name: str, *args: str, timeout: float = 120, cwd: str | Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([command(name), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=quiet_env(**env))


_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


def start(name: str, *args: str, cwd: str | Path | None = None, **env: str) -> subprocess.Popen:
    """The command with SIGINT at its default, in its own process group, output in pipes."""
    return subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGINT, command(name), *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env(**env),
                            start_new_session=True)


def signal_group(process: subprocess.Popen, signum: int = signal.SIGINT) -> None:
    """What a terminal's Ctrl-C does: the signal to every process of the group."""
    os.killpg(process.pid, signum)


class ModelServer:
    """An OpenAI-compatible stand-in on 127.0.0.1 (real HTTP): `GET /v1/models` lists `model`, and
    `chat(body) -> (status, reply)` answers each `POST /v1/chat/completions`."""

    def __init__(self, chat: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]], model: str = "m") -> None:
        outer = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                outer.requests += 1
                self._send(*chat(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ModelServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def chat_reply(content: str) -> tuple[int, dict[str, Any]]:
    return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}
