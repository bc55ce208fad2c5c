"""AppWorld server processes and the pool that manages them.

An open AppWorld freezes time for its whole process, allows one world per process and needs
the main thread for its code timeout (FACTS.md), so worlds never run in the caller's
process: each concurrent env talks over loopback HTTP to its own server, AppWorld's own
`appworld.serve.environment` app run by the AppWorld interpreter on 127.0.0.1.

Server hazards handled here:
- A failed request can leave uvicorn's keep-alive socket closed: the client is rebuilt after
  every error.
- AppWorld's code timeout cannot interrupt C loops and a busy server answers nothing else:
  every request has a client-side deadline, after which the server is SIGKILLed (SIGTERM can
  take minutes) and restarted.
- Each server has a private root folder (its experiment outputs and `IPYTHONDIR`), with the
  task data linked in read-only.
- No orphans: the pool kills its servers at `shutdown()`, an atexit hook kills whatever is
  still running, and a server exits by itself when its parent process dies (see `_serve.py`).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from seeupo_gym.appworld.paths import find_python

logger = logging.getLogger(__name__)

_SERVE_SCRIPT = Path(__file__).with_name("_serve.py")
_EXPERIMENT = "seeupo"
_LOG_TAIL_CHARS = 2000


class ServerError(RuntimeError):
    """The server answered a request with an error status."""


class ServerDied(RuntimeError):
    """The server process is gone (killed, crashed or never came up)."""


class ServerTimeout(RuntimeError):
    """The server gave no answer within the deadline; it has been killed."""


# Servers still running, killed at interpreter exit. Global because atexit is: contained here.
_LIVE: weakref.WeakSet[AppWorldServer] = weakref.WeakSet()


@atexit.register
def _kill_live_servers() -> None:
    for server in list(_LIVE):
        server.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class AppWorldServer:
    """One AppWorld environment server process bound to 127.0.0.1, and an HTTP client for it.

    Args:
        python: the AppWorld interpreter.
        data_dir: the AppWorld `data` folder (linked read-only into the server's own root).
        startup_timeout: seconds to wait for the server to answer after a start.
    """

    def __init__(self, python: Path, data_dir: Path, startup_timeout: float = 180.0) -> None:
        self.python = Path(python)
        self.data_dir = Path(data_dir)
        self.startup_timeout = startup_timeout
        self.episodes = 0  # worlds opened since the last (re)start
        self.restarts = 0
        self.experiment_name = _EXPERIMENT
        self._owner_pid = os.getpid()
        self._root = Path(tempfile.mkdtemp(prefix="seeupo-appworld-"))
        (self._root / "data").symlink_to(self.data_dir, target_is_directory=True)
        self._process: subprocess.Popen[bytes] | None = None
        self._parent_pipe: int | None = None
        self._client: httpx.Client | None = None
        self.port = 0
        _LIVE.add(self)

    # ------------------------------------------------------------------ process

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Spawn the process without waiting for it to come up (see `wait_ready`)."""
        if self.alive:
            return
        self._close_pipe()
        self.port = _free_port()
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(APPWORLD_ROOT=str(self._root), IPYTHONDIR=str(self._root / ".ipython"))
        read_end, self._parent_pipe = os.pipe()
        with open(self._root / "server.log", "wb") as log:
            self._process = subprocess.Popen(
                [str(self.python), "-P", str(_SERVE_SCRIPT), str(self.port), str(read_end)],
                cwd=self._root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(read_end,),
                start_new_session=True,  # a Ctrl-C meant for the caller does not hit a request mid-way
            )
        os.close(read_end)
        self.episodes = 0

    def wait_ready(self) -> None:
        """Block until the server answers; raise ServerDied if it exits or never answers."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise ServerDied(f"the AppWorld server exited during start-up:\n{self.log_tail()}")
            try:
                answer = httpx.get(self.url + "/", timeout=2.0)
                if answer.status_code == 200 and "AppWorld" in answer.text:  # ours, not a port squatter
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise ServerDied(f"the AppWorld server did not answer within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def ensure_running(self) -> None:
        """Start the server if it is not running (e.g. after a crash or a kill) and wait for it."""
        if self.alive:
            self.wait_ready()
            return
        if self._process is not None:
            self.restarts += 1
        self._boot()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self._boot()

    def _boot(self, attempts: int = 3) -> None:
        # The free port is chosen before the server binds it; if another process takes it
        # in between, try another.
        for attempt in range(attempts):
            self.start()
            try:
                self.wait_ready()
                return
            except ServerDied:
                if attempt == attempts - 1 or "address already in use" not in self.log_tail().lower():
                    raise

    def kill(self) -> None:
        """SIGKILL the server (SIGTERM can take minutes; all state is on disk after each execute)."""
        self._drop_client()
        process = self._process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: takes any child with it
            except ProcessLookupError:
                pass
            process.wait()
        self._close_pipe()

    def shutdown(self) -> None:
        """Kill the server and delete its root folder. Only the process that started it does this."""
        if os.getpid() != self._owner_pid:
            return
        self.kill()
        shutil.rmtree(self._root, ignore_errors=True)
        _LIVE.discard(self)

    def log_tail(self) -> str:
        try:
            text = (self._root / "server.log").read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return text[-_LOG_TAIL_CHARS:]

    def _close_pipe(self) -> None:
        if self._parent_pipe is not None:
            os.close(self._parent_pipe)
            self._parent_pipe = None

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, payload: dict[str, Any], timeout: float, *, idempotent: bool = True) -> Any:
        """POST to the server and return the response's "output".

        Retries (tenacity, bounded) when the request surely did not run: a refused connection,
        or for idempotent calls a dropped keep-alive socket. A request that gets no answer
        within `timeout` seconds kills the server (ServerTimeout): it is stuck, e.g. in a C loop
        AppWorld's own timeout cannot interrupt.
        """
        retry_on: tuple[type[Exception], ...] = (httpx.ConnectError,)
        if idempotent:
            retry_on += (httpx.RemoteProtocolError, httpx.ReadError)

        @retry(
            retry=retry_if_exception_type(retry_on),
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.1, max=1.0),
            reraise=True,
        )
        def send() -> httpx.Response:
            if not self.alive:
                raise ServerDied(self._death_message())
            try:
                return self._http().post(path, json=payload, timeout=timeout)
            except httpx.TransportError:
                self._drop_client()
                raise

        try:
            response = send()
        except httpx.TimeoutException as error:
            self.kill()
            raise ServerTimeout(f"the AppWorld server gave no answer to {path} within {timeout:.1f} s; killed it") from error
        except httpx.TransportError as error:
            if self._exits_within(2.0):  # a dying server drops the connection before it is reaped
                raise ServerDied(self._death_message()) from error
            self.kill()  # alive but not answering: its state is unknown
            raise ServerDied(f"the AppWorld server at {self.url} stopped answering ({error!r}); killed it") from error
        if response.status_code != 200:
            self._drop_client()  # uvicorn closes the socket after a 5xx
            raise ServerError(f"{path} failed with HTTP {response.status_code}: {response.text[:500]}")
        return response.json()["output"]

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.url)
        return self._client

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _exits_within(self, seconds: float) -> bool:
        if self._process is None:
            return True
        try:
            self._process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _death_message(self) -> str:
        code = self._process.poll() if self._process is not None else None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f"the AppWorld server (pid {self.pid}) is not running ({how})"


class ServerPool:
    """AppWorld servers for one interpreter and data folder, handed out one per env.

    `acquire` returns an idle server (restarted if it died, or recycled after
    `recycle_after` episodes: each world leaks ~1.5 MB) or starts a new one; `release` gives
    it back; `shutdown` kills them all. Sharing one pool among envs (or tests) reuses warm
    servers; an env without a pool makes its own and shuts it down at `close()`.

    Args:
        python: the AppWorld interpreter; None searches as `paths.find_python` does.
        data_dir: the AppWorld `data` folder the servers serve.
        startup_timeout: seconds to wait for a server to come up.
        recycle_after: episodes after which a server is restarted on its next acquire.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 180.0,
        recycle_after: int = 300,
    ) -> None:
        self.python = find_python(python)
        self.data_dir = Path(data_dir).resolve()
        self.startup_timeout = startup_timeout
        self.recycle_after = recycle_after
        self._idle: list[AppWorldServer] = []
        self._busy: list[AppWorldServer] = []
        self._lock = threading.Lock()

    @property
    def servers(self) -> list[AppWorldServer]:
        with self._lock:
            return self._idle + self._busy

    def acquire(self) -> AppWorldServer:
        with self._lock:
            server = self._idle.pop() if self._idle else None
        if server is None:
            server = AppWorldServer(self.python, self.data_dir, self.startup_timeout)
        try:
            self.prepare(server)
        except BaseException:
            server.shutdown()
            raise
        with self._lock:
            self._busy.append(server)
        return server

    def prepare(self, server: AppWorldServer) -> None:
        """Make a server fit for the next episode: running, answering, not overdue for recycling."""
        if server.alive and server.episodes >= self.recycle_after:
            logger.info("recycling AppWorld server pid %s after %d episodes", server.pid, server.episodes)
            server.restart()
        else:
            server.ensure_running()

    def release(self, server: AppWorldServer) -> None:
        with self._lock:
            if server in self._busy:
                self._busy.remove(server)
                self._idle.append(server)

    def shutdown(self) -> None:
        with self._lock:
            servers, self._idle, self._busy = self._idle + self._busy, [], []
        for server in servers:
            server.shutdown()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
