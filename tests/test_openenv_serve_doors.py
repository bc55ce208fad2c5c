"""Red team: `seeupo-serve`'s doors before any env runs (attacks that won on 2feb239).

- a web page from another origin (in headless Chromium, and as raw requests) opens `ws://127.0.0.1:<port>/ws` (a browser sends its `Origin`;
  loopback needs no token) or posts to `/mcp` (as text/plain, which needs no CORS preflight);
- connections that send a `/health` head and then drip a body hold every slot;
- one peer opens every slot with half-open connections;
- a WebSocket names `session_id` twice, so that the attach guard and openenv read different ones.

In-process servers (`serving_in_process`) for what the ASGI guard decides; a `seeupo-serve`
process for what its connection protocol decides (the cap, the per-peer limit, the head deadline).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openenv.core")
from starlette.websockets import WebSocket  # noqa: E402
from websockets.exceptions import InvalidStatus, WebSocketException  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.integrations.openenv_server import create_app  # noqa: E402
from serve_helpers import serving, serving_in_process  # noqa: E402

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRUSTED = "http://trusted.example:8080"
FOREIGN = ("http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1")
MAX_CONNECTIONS, HEAD_S, BODY_S = 80, 4, 30
PER_PEER_DEFAULT = 64
TOOLS = {"action_format": "tools"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def open_url():
    """Loopback, no token, the tools format (MCP sessions), one extra origin allowed."""
    app = create_app("seeupo/TurnBandit-v0", TOOLS, max_sessions=4, allowed_origins=[TRUSTED])
    with serving_in_process(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    with serving("seeupo/TurnBandit-v0", "--token-file", str(token_file), "--max-sessions", "4",
                 "--max-connections", str(MAX_CONNECTIONS), "--header-timeout", str(HEAD_S),
                 "--body-timeout", str(BODY_S), "--allow-origin", TRUSTED, max_open_files=1024) as served:
        yield served


def ws_url(url: str, path: str = "/ws") -> str:
    return url.replace("http", "ws") + path


def refused_status(url: str, **kwargs) -> int | None:
    """The HTTP status of a refused WebSocket handshake, or None when it was accepted."""
    try:
        with connect(url, open_timeout=30, **kwargs) as conn:
            conn.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
            assert json.loads(conn.recv(timeout=60))["type"] == "observation"
            return None
    except InvalidStatus as refusal:
        return refusal.response.status_code


def create_mcp_session(url: str, headers: dict | None = None) -> httpx.Response:
    create = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": {}}
    return httpx.post(f"{url}/mcp", json=create, headers=headers or {}, timeout=30)


# ---------------------------------------------------------------- Origin


def test_a_page_from_another_origin_cannot_open_a_websocket_session_and_other_clients_still_can(open_url):
    url, app = open_url
    own = url  # http://127.0.0.1:<port>, the address the server is bound to
    for path in ("/ws", "/mcp"):
        for origin in FOREIGN:
            assert refused_status(ws_url(url, path), origin=origin) == 403, (path, origin)
    assert not app.state.openenv._sessions  # refused before accept: no session was made
    assert refused_status(ws_url(url)) is None  # no Origin: not a browser
    assert refused_status(ws_url(url), origin=own) is None
    assert refused_status(ws_url(url), origin=own.replace("127.0.0.1", "localhost")) is None  # loopback's own name
    assert refused_status(ws_url(url), origin=TRUSTED) is None  # --allow-origin
    assert refused_status(ws_url(url), origin=TRUSTED.upper()) is None  # origins compare case-blind


def test_an_mcp_request_from_another_origin_is_refused_and_makes_no_session(open_url):
    url, app = open_url
    for origin in FOREIGN:
        answer = create_mcp_session(url, {"Origin": origin, "Content-Type": "text/plain"})
        assert answer.status_code == 403 and "origin" in answer.json()["detail"].lower(), (origin, answer.text)
    assert not app.state.openenv._sessions
    for headers in ({}, {"Origin": url}, {"Origin": TRUSTED}):
        made = create_mcp_session(url, headers).json()["result"]["session_id"]
        close = {"jsonrpc": "2.0", "id": 2, "method": "openenv/session/close", "params": {"session_id": made}}
        assert httpx.post(f"{url}/mcp", json=close, timeout=30).json()["result"]["closed"]


def test_a_foreign_origin_is_refused_even_with_the_token_and_the_cli_allows_origins(guarded):
    assert refused_status(ws_url(guarded.url), origin="http://evil.example", additional_headers=AUTH) == 403
    assert refused_status(ws_url(guarded.url), origin=TRUSTED, additional_headers=AUTH) is None
    assert refused_status(ws_url(guarded.url), origin=guarded.url, additional_headers=AUTH) is None
    assert refused_status(ws_url(guarded.url), additional_headers=AUTH) is None


PAGE = """<html><body><script>
const server = "SERVER", results = {};
let pending = 2;
function done(key, value) {
  if (key in results) return;
  results[key] = value;
  if (--pending === 0) fetch("/report", {method: "POST", body: JSON.stringify(results)});
}
const ws = new WebSocket(server.replace("http", "ws") + "/ws");
ws.onopen = () => ws.send(JSON.stringify({type: "reset", data: {seed: 0}}));
ws.onmessage = (event) => { done("ws", JSON.parse(event.data).type); ws.close(); };
ws.onclose = () => done("ws", "refused");
const create = {jsonrpc: "2.0", id: 1, method: "openenv/session/create", params: {}};
fetch(server + "/mcp", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
                        body: JSON.stringify(create)}).then(() => done("mcp", "sent"), () => done("mcp", "failed"));
</script></body></html>"""


@contextlib.contextmanager
def foreign_page():
    """A page on another origin (127.0.0.1, another port) that plays the env server
    `page.server_url`; yields (its origin, page), `page.reports` holding what the page reported."""
    page = types.SimpleNamespace(server_url="", reports=queue.Queue())

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = PAGE.replace("SERVER", page.server_url).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            page.reports.put(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", page
    finally:
        httpd.shutdown()
        httpd.server_close()


def chromium_report(page_url: str, reports: queue.Queue, profile: Path) -> dict:
    """What the page reports once headless Chromium ran it."""
    assert CHROMIUM is not None
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                f"--user-data-dir={profile}", page_url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return reports.get(timeout=90)
    finally:
        os.killpg(browser.pid, signal.SIGKILL)  # its own process group: the browser and its helpers
        browser.wait(timeout=30)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it)")
def test_a_page_of_another_origin_in_chromium_neither_plays_the_env_nor_makes_an_mcp_session(tmp_path):
    with foreign_page() as (origin, page):
        for allowed in (False, True):  # the control: the same page, its origin allowed, plays the env
            app = create_app("seeupo/TurnBandit-v0", TOOLS, max_sessions=4, allowed_origins=[origin] if allowed else [])
            with serving_in_process(app) as url:
                page.server_url = url
                report = chromium_report(origin + "/", page.reports, tmp_path / f"profile-{allowed}")
                sessions = len(app.state.openenv._sessions)  # the page's MCP session, had it been made
            if allowed:
                assert report == {"ws": "observation", "mcp": "sent"} and sessions == 1, (report, sessions)
            else:
                assert report == {"ws": "refused", "mcp": "sent"} and sessions == 0, (report, sessions)


def test_a_malformed_allowed_origin_is_refused_at_start():
    with pytest.raises(ValueError, match="scheme://host"):
        create_app("seeupo/TurnBandit-v0", allowed_origins=["trusted.example/path"])


# ---------------------------------------------------------------- slots


def connect_from(url: str, source_ip: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30, source_address=(source_ip, 0))


def served_within(url: str, seconds: float) -> float | None:
    """Seconds until an authorized request from 127.0.0.1 is answered, or None past `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if httpx.get(f"{url}/seeupo/env", headers=AUTH, timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            time.sleep(0.1)
    return None


class Dripper(threading.Thread):
    """Drips a byte every half second into each socket until the server answers it, and keeps
    what each received (a byte sent after the server's close would reset the connection and lose
    its answer)."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        super().__init__(daemon=True)
        self.sockets, self.answers = sockets, [b""] * len(sockets)
        self.ended = [False] * len(sockets)
        self.stop = threading.Event()
        for sock in sockets:
            sock.setblocking(False)

    def run(self) -> None:
        rounds = 0
        while not self.stop.wait(0.1):
            rounds += 1
            for i, sock in enumerate(self.sockets):
                if self.ended[i]:
                    continue
                try:
                    chunk = sock.recv(4096)
                    self.answers[i] += chunk
                    self.ended[i] = not chunk
                except BlockingIOError:
                    if not self.answers[i] and rounds % 5 == 0:
                        sock.send(b"x")
                except OSError:
                    self.ended[i] = True


def test_dripped_health_bodies_on_every_slot_keep_no_authorized_client_out(guarded):
    # One connection per peer address (127.0.0.10, .11, ...): the per-peer limit plays no part.
    # The third kind is refused for its missing token before its body is read.
    heads = {b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{": b"HTTP/1.1 405",
             b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{": b"HTTP/1.1 400",
             b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{": b"HTTP/1.1 401"}
    kinds = list(heads)
    sockets = [connect_from(guarded.url, f"127.0.0.{10 + i}") for i in range(MAX_CONNECTIONS)]
    try:
        for i, sock in enumerate(sockets):
            sock.sendall(kinds[i % 3])
        dripper = Dripper(sockets)
        dripper.start()
        waited = served_within(guarded.url, HEAD_S + 3)
        assert waited is not None and waited < HEAD_S, f"an authorized client waited {waited} s"
        deadline = time.monotonic() + 10
        while not all(dripper.ended) and time.monotonic() < deadline:
            time.sleep(0.1)
        dripper.stop.set()
        for i, answer in enumerate(dripper.answers):  # each answered at once without its body, and closed
            assert dripper.ended[i] and answer.startswith(heads[kinds[i % 3]]), answer[:200]
            assert b"connection: close" in answer.lower()
    finally:
        for sock in sockets:
            sock.close()


def closed_now(sockets: list[socket.socket]) -> list[bool]:
    """Whether the server has closed each socket (its end of file or reset is waiting)."""
    readable = set(select.select(sockets, [], [], 0)[0])
    return [sock in readable for sock in sockets]


def test_one_peer_cannot_take_every_connection_slot(guarded):
    attacker = [connect_from(guarded.url, "127.0.0.2") for _ in range(MAX_CONNECTIONS + 20)]
    try:
        for sock in attacker:  # half-open: a request head that never ends
            try:
                sock.sendall(b"GET /schema HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            except OSError:
                pass
        time.sleep(0.3)
        assert closed_now(attacker).count(False) == PER_PEER_DEFAULT
        waited = served_within(guarded.url, HEAD_S + 3)  # another peer
        # ... served while the attacker still holds its slots (not once the head deadline freed them)
        assert waited is not None and closed_now(attacker).count(False) == PER_PEER_DEFAULT, waited
        time.sleep(HEAD_S + 1)
        assert all(closed_now(attacker))  # the rest at the head deadline
    finally:
        for sock in attacker:
            sock.close()


def test_the_per_peer_limit_counts_websocket_sessions_and_the_operator_sets_it():
    with serving("seeupo/TurnBandit-v0", "--max-connections", "16", "--max-connections-per-peer", "2") as served:
        with connect(ws_url(served.url), open_timeout=30), connect(ws_url(served.url), open_timeout=30):
            with pytest.raises((OSError, WebSocketException)):  # closed at once, before its handshake
                connect(ws_url(served.url), open_timeout=10).close()
            other_peer = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"))
            assert other_peer.get(f"{served.url}/health", timeout=10).status_code == 200
        time.sleep(0.5)
        assert refused_status(ws_url(served.url)) is None  # the peer's slots are free again


# ---------------------------------------------------------------- session_id


def test_a_websocket_naming_session_id_twice_is_refused_with_400_and_attaches_to_neither(open_url):
    url, app = open_url
    first, second = (create_mcp_session(url).json()["result"]["session_id"] for _ in range(2))
    for query in (f"session_id={first}&session_id={second}", f"session_id={first}&session_id={first}",
                  f"session_id={first}&session%5Fid={second}", "session_id=", "session_id"):
        assert refused_status(ws_url(url, f"/ws?{query}")) == 400, query
    assert not app.state.openenv._session_websocket_attachments
    with connect(ws_url(url, f"/ws?session_id={second}"), open_timeout=30) as conn:  # one key: attaches
        conn.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
        assert json.loads(conn.recv(timeout=60))["type"] == "observation"
        assert app.state.openenv.is_attached(second)


def test_an_mcp_request_naming_session_id_twice_is_refused_with_400(open_url):
    url, _ = open_url
    made = create_mcp_session(url).json()["result"]["session_id"]
    body = ('{"jsonrpc": "2.0", "id": 7, "method": "tools/list", '
            f'"params": {{"session_id": "{made}", "session_id": "someone-else"}}}}')
    answer = httpx.post(f"{url}/mcp", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 400 and "session_id" in answer.json()["error"]["message"]
    assert answer.json()["id"] == 7


def test_the_guard_reads_the_session_id_openenv_reads_for_every_query():
    from seeupo_gym.integrations.mcp_sessions import BadSessionId, query_session_id

    queries = [b"session_id=abc", b"session%5Fid=abc", b"session_id=a%20b+c", b"x=1&session_id=abc&y=2",
               b"session_id=abc;session_id=def", b"", b"Session_Id=abc", b"session_id=%ff", b"session_id=%00"]
    for query in queries:
        scope = {"type": "websocket", "query_string": query, "headers": [], "path": "/ws"}
        openenv_reads = WebSocket(scope, receive=None, send=None).query_params.get("session_id")  # as openenv does
        assert query_session_id(scope) == openenv_reads, query
    for query in (b"session_id=a&session_id=b", b"session_id=a&session%5fid=a", b"session_id", b"session_id="):
        with pytest.raises(BadSessionId):
            query_session_id({"type": "websocket", "query_string": query, "headers": []})
