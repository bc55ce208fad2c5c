"""Our NeMo Gym resource server (ecosystems/nemo_gym/resources_servers/seeupo) reaps its sessions and
keeps seeupo-serve's credential on its front. Red team: resets without a session cookie (each a new
NeMo Gym session) used to hold one seeupo-serve session each until seeupo-serve's idle timeout, so a
handful locked every other rollout out; and the front let anyone off loopback play a served env
whose server asks for a token. Runs our server's class in NeMo Gym's venv (`make nemo-gym-venv`)
against a real `seeupo-serve` with room for two sessions."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ecosystem_helpers import TOKEN
from serve_helpers import repo_root, serving

ROOT = repo_root()
VENV = ROOT / ".venv-nemo-gym"
SERVER_DIR = ROOT / "ecosystems" / "nemo_gym" / "resources_servers" / "seeupo"

pytestmark = [pytest.mark.slow,  # NeMo Gym imports take ~40 s on 2 loaded cores
              pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                 reason="NeMo Gym's venv is absent: `make nemo-gym-venv` builds .venv-nemo-gym (Python 3.13)")]

SESSIONS = """
import asyncio, json, sys
from unittest.mock import MagicMock
from nemo_gym.server_utils import ServerClient
from app import SeeupoResourcesServerConfig, SeeupoServer
server = SeeupoServer(config=SeeupoResourcesServerConfig(host="", port=0, entrypoint="", name="", serve_url=sys.argv[1],
                                                         max_sessions=2, session_idle_s=2.0),
                      server_client=MagicMock(spec=ServerClient))
out = {}
async def main():
    for name in ("a", "b", "c"):  # three cookie-less resets: three sessions, room for two on the server
        await server.reset({"seed": 0}, name)
    out["after three"] = sorted(server.sessions)
    server.sessions["c"].busy = 1  # as if c's step were in flight
    server.sessions["b"].busy = 1
    try:
        await server.reset({"seed": 0}, "d")
    except Exception as error:
        out["all busy"] = str(error)
    server.sessions["c"].busy = server.sessions["b"].busy = 0
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
for peer in ("10.1.2.3", "127.0.0.1"):
    client = TestClient(app, client=(peer, 50000))
    out[peer] = [client.post("/close").status_code,
                 client.post("/close", headers={"Authorization": f"Bearer {token}"}).status_code,
                 client.post("/close", headers={"Authorization": "Bearer wrong"}).status_code]
out["no token"] = credential_refusal(None, "10.1.2.3", None)
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


def test_sessions_are_reaped_so_cookie_less_resets_cannot_hold_the_served_env():
    with serving("seeupo/TurnBandit-v0", "--max-sessions", "2", env=TOKEN) as served:
        out = run_in_nemo_gym(SESSIONS, served.url, env=TOKEN)
    # The third reset fits because the least recently used session was closed (on seeupo-serve too:
    # it has room for two, so before this a third reset was refused there).
    assert out["after three"] == ["b", "c"]
    assert "sessions have a request in flight" in out["all busy"]  # busy sessions are never reaped
    assert out["after idle"] == ["e"]  # b and c, idle past session_idle_s, were closed at e's reset


def test_the_front_asks_off_loopback_for_the_token_seeupo_serve_asks_for_and_refuses_huge_rewards():
    out = run_in_nemo_gym(FRONT, env=TOKEN)
    assert out["10.1.2.3"] == [401, 200, 401]  # off loopback: only with the token
    assert out["127.0.0.1"] == [200, 200, 200]  # NeMo Gym's own servers on this machine, as before
    assert out["no token"] is None  # a seeupo-serve without a token: nothing to ask for
    # a served 1e300 is refused before NeMo Gym's tables (seeupo_serve_client refuses NaN and inf itself)
    assert out["rewards"] == ["ServeError", "ServeError", "ServeError", 1.0, -1e6]
