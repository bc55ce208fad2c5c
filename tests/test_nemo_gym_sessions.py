"""Our NeMo Gym resource server (ecosystems/nemo_gym/resources_servers/seeupo) reaps its sessions and
keeps seeupo-serve's credential on its front. Red team: resets without a session cookie (each a new
NeMo Gym session) used to hold one seeupo-serve session each until seeupo-serve's idle timeout, so a
handful locked every other rollout out; later they evicted a working runner's live episode; the
front's cap (64) above seeupo-serve's (32) still let seeupo-serve refuse new runners; and the front
let any loopback peer play a served env whose server asks for a token. The rules
(`seeupo_sessions.py`) are tested here directly; the server's class runs in NeMo Gym's venv (`make
nemo-gym-venv`) against a real `seeupo-serve` with room for two sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ecosystem_helpers import TOKEN
from serve_helpers import repo_root, serving

ROOT = repo_root()
VENV = ROOT / ".venv-nemo-gym"
SERVER_DIR = ROOT / "ecosystems" / "nemo_gym" / "resources_servers" / "seeupo"

in_nemo_gym = pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                 reason="NeMo Gym's venv is absent: `make nemo-gym-venv` builds .venv-nemo-gym (Python 3.13)")

sys.path.insert(0, str(SERVER_DIR))
from seeupo_sessions import Session, SessionsFull, credential_refusal, effective_cap, to_close  # noqa: E402


def table(**entries):
    """sessions by id: (seconds since last use, done, busy)."""
    sessions = {}
    for sid, (age, done, busy) in entries.items():
        sessions[sid] = Session(serve=None)
        sessions[sid].last_used, sessions[sid].done, sessions[sid].busy = 1000.0 - age, done, busy
    return sessions


def test_a_live_episode_is_never_closed_for_another_reset():
    live = table(runner=(5.0, False, 0), flood=(1.0, False, 0))  # a runner between steps, a cookie-less reset
    with pytest.raises(SessionsFull, match="all 2 sessions hold live episodes"):
        to_close(live, cap=2, idle_s=60.0, now=1000.0)
    assert to_close(live, cap=3, idle_s=60.0, now=1000.0) == []  # room left: nothing closes


def test_stale_and_finished_sessions_make_room_least_recently_used_first():
    sessions = table(runner=(5.0, False, 0), old_done=(30.0, True, 0), new_done=(2.0, True, 0),
                     stale=(120.0, False, 0), busy_stale=(500.0, False, 1))
    assert to_close(sessions, cap=5, idle_s=60.0, now=1000.0) == ["stale"]  # stale ones close anyway
    assert to_close(sessions, cap=4, idle_s=60.0, now=1000.0) == ["stale", "old_done"]
    assert to_close(sessions, cap=3, idle_s=60.0, now=1000.0) == ["stale", "old_done", "new_done"]
    with pytest.raises(SessionsFull):  # the runner's live episode and a request in flight stay
        to_close(sessions, cap=2, idle_s=60.0, now=1000.0)


def test_the_fronts_cap_is_never_above_seeupo_serves():
    assert effective_cap(64, 32) == 32 and effective_cap(None, 32) == 32 and effective_cap(8, 32) == 8
    assert effective_cap(8, "lots") == 8
    with pytest.raises(ValueError):
        effective_cap(None, None)


def test_a_configured_token_is_asked_of_every_peer_loopback_included():
    assert credential_refusal("s3cret", None) is not None and credential_refusal("s3cret", "Bearer wrong") is not None
    assert credential_refusal("s3cret", "Bearer s3cret") is None
    assert credential_refusal(None, None) is None  # a seeupo-serve without a token: nothing to ask for

SESSIONS = """
import asyncio, json, sys
from unittest.mock import MagicMock
from nemo_gym.server_utils import ServerClient
from app import SeeupoResourcesServerConfig, SeeupoServer
server = SeeupoServer(config=SeeupoResourcesServerConfig(host="", port=0, entrypoint="", name="", serve_url=sys.argv[1],
                                                         max_sessions=64, session_idle_s=2.0),
                      server_client=MagicMock(spec=ServerClient))
out = {}
async def main():
    for name in ("a", "b"):  # a runner's episode (a) and a cookie-less reset (b): room for two on the server
        await server.reset({"seed": 0}, name)
    out["cap"] = server.session_cap
    try:
        await server.reset({"seed": 0}, "c")
    except Exception as error:
        out["all live"] = str(error)
    out["after refusal"] = sorted(server.sessions)
    server.sessions["b"].done = True  # b's episode ended: its slot may be taken
    await server.reset({"seed": 0}, "c")
    out["after three"] = sorted(server.sessions)
    await asyncio.sleep(2.5)
    await server.reset({"seed": 1}, "e")
    out["after idle"] = sorted(server.sessions)
    for name in list(server.sessions):
        await server.close_session(name)
asyncio.run(main())
print(json.dumps(out))
"""

FRONT = """
import json, os
from unittest.mock import MagicMock
from fastapi.testclient import TestClient
from nemo_gym.server_utils import ServerClient
from app import SeeupoResourcesServerConfig, SeeupoServer, checked_reward, credential_refusal
server = SeeupoServer(config=SeeupoResourcesServerConfig(host="", port=0, entrypoint="", name="", serve_url="http://127.0.0.1:1"),
                      server_client=MagicMock(spec=ServerClient))
app = server.setup_webserver()
token = os.environ.get("SEEUPO_SERVE_TOKEN")
out = {}
for peer in ("10.1.2.3", "127.0.0.1"):  # loopback is asked for the token too
    client = TestClient(app, client=(peer, 50000))
    out[peer] = [client.post("/close").status_code,
                 client.post("/close", headers={"Authorization": f"Bearer {token}"}).status_code,
                 client.post("/close", headers={"Authorization": "Bearer wrong"}).status_code]
out["no token"] = credential_refusal(None, None)
out["rewards"] = []
for reward in (1e300, -2e6, float("nan"), 1.0, -1e6):
    try:
        out["rewards"].append(checked_reward(reward))
    except Exception as error:
        out["rewards"].append(type(error).__name__)
print(json.dumps(out))
"""


def run_in_nemo_gym(script: str, *args: str, env: dict | None = None) -> dict:
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", script, *args], cwd=SERVER_DIR, capture_output=True,
                            text=True, timeout=180, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # NeMo Gym imports take ~40 s on 2 loaded cores
@in_nemo_gym
def test_sessions_are_reaped_but_a_live_episode_is_never_taken_by_a_cookie_less_reset():
    with serving("seeupo/TurnBandit-v0", "--max-sessions", "2", env=TOKEN) as served:
        out = run_in_nemo_gym(SESSIONS, served.url, env=TOKEN)
    assert out["cap"] == 2  # its own 64, at most seeupo-serve's 2
    assert "all 2 sessions hold live episodes" in out["all live"] and out["after refusal"] == ["a", "b"]
    assert out["after three"] == ["a", "c"]  # b's finished episode made room; a's live one stayed
    assert out["after idle"] == ["e"]  # a and c, idle past session_idle_s, were closed at e's reset


@pytest.mark.slow
@in_nemo_gym
def test_the_front_asks_every_peer_for_the_token_seeupo_serve_asks_for_and_refuses_huge_rewards():
    out = run_in_nemo_gym(FRONT, env=TOKEN)
    assert out["10.1.2.3"] == [401, 200, 401]  # only with the token
    assert out["127.0.0.1"] == [401, 200, 401]  # loopback too
    assert out["no token"] is None  # a seeupo-serve without a token: nothing to ask for
    # a served 1e300 is refused before NeMo Gym's tables (seeupo_serve_client refuses NaN and inf itself)
    assert out["rewards"] == ["ServeError", "ServeError", "ServeError", 1.0, -1e6]
