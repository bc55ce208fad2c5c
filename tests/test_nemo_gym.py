"""seeupo-gym's envs through NeMo Gym's own runner: `gym env start` (Ray, the head server, our
resource server `ecosystems/nemo_gym/resources_servers/seeupo`, NeMo Gym's gymnasium_agent and its
vllm_model server in front of the scripted OpenAI-compatible server), then `gym eval run
--no-serve`, all from `.venv-nemo-gym` (`make nemo-gym-venv`). The envs are real `seeupo-serve`
processes; the model is scripted (tests/openai_server.py), everything else is NeMo Gym's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ecosystem_helpers import (GROUND_TRUTH_TASK, HOSTILE_TASK, TOKEN, TURNBANDIT_SEEDS, UNSOLVED_TASK,
                               appworld_ground_truth_script, local_return, script, scripted_openai_server,
                               turnbandit_replies)
from serve_helpers import repo_root, serving

ROOT = repo_root()
VENV = ROOT / ".venv-nemo-gym"
GYM_DIR = ROOT / "ecosystems" / "nemo_gym"
SERVER_DIR = GYM_DIR / "resources_servers" / "seeupo"

pytestmark = [
    pytest.mark.slow,  # Ray, five server processes and two CLI runs: ~1-2 minutes on 2 cores
    pytest.mark.skipif(not (VENV / "bin" / "gym").exists(),
                       reason="NeMo Gym's venv is absent: `make nemo-gym-venv` builds .venv-nemo-gym (Python 3.13)"),
]

SERVERS = ("resources_servers/seeupo", "responses_api_agents/gymnasium_agent", "responses_api_models/vllm_model",
           "environment_servers/legacy_agent")


def gym_venvs(tmp: Path) -> Path:
    """NeMo Gym runs every server from `<uv_venv_dir>/<type>/<name>/.venv`: all of them are ours."""
    for server in SERVERS:
        (tmp / "venvs" / server).mkdir(parents=True)
        (tmp / "venvs" / server / ".venv").symlink_to(VENV)
    return tmp / "venvs"


def prepare(url: str, agent: str, out: Path, *args: str) -> list[dict]:
    subprocess.run([str(VENV / "bin" / "python"), str(SERVER_DIR / "prepare_data.py"), "--url", url, "--agent", agent,
                    "--out", str(out), *args], check=True, timeout=120, env={**os.environ, **TOKEN})
    return [json.loads(line) for line in out.read_text().splitlines()]


def gym_eval(tmp: Path, model_url: str, serve_urls: dict[str, str], model: str = "scripted") -> list[dict]:
    """`gym env start` with our configs for `serve_urls`' envs, then `gym eval run --no-serve` on
    tmp/input.jsonl; NeMo Gym's servers and Ray are stopped after. Returns the rollouts."""
    site = next((VENV / "lib").glob("python3.*/site-packages"))
    configs = [*(SERVER_DIR / "configs" / f"seeupo_{env}.yaml" for env in serve_urls),
               site / "responses_api_models" / "vllm_model" / "configs" / "vllm_model.yaml"]
    overrides = [f"+config_paths=[{','.join(map(str, configs))}]", f"+uv_venv_dir={gym_venvs(tmp)}",
                 "+skip_venv_if_present=true", f"+policy_base_url={model_url}", "+policy_api_key=unused",
                 f"+policy_model_name={model}",
                 *(f"++seeupo_{env}.resources_servers.seeupo.serve_url={url}" for env, url in serve_urls.items()),
                 # NeMo Gym's agent sends no Authorization header: this run says so (the port stays on loopback)
                 *(f"++seeupo_{env}.resources_servers.seeupo.front_requires_token=false" for env in serve_urls)]
    log = open(tmp / "gym_env_start.log", "w+")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **TOKEN}  # NeMo Gym hands its environment to the servers
    start = subprocess.Popen([str(VENV / "bin" / "gym"), "env", "start", *overrides], cwd=GYM_DIR, stdout=log,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "servers ready!" not in (tmp / "gym_env_start.log").read_text():
            assert start.poll() is None and time.monotonic() < deadline, (tmp / "gym_env_start.log").read_text()[-4000:]
            time.sleep(1)
        run = subprocess.run([str(VENV / "bin" / "gym"), "eval", "run", "--no-serve", "--input",
                              str(tmp / "input.jsonl"), "--output", str(tmp / "rollouts.jsonl")],
                             cwd=GYM_DIR, capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    finally:
        os.killpg(start.pid, signal.SIGINT)  # NeMo Gym stops its servers and its Ray cluster
        try:
            start.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(start.pid, signal.SIGKILL)
            start.wait(timeout=30)
        log.close()
    return [json.loads(line) for line in (tmp / "rollouts.jsonl").read_text().splitlines()]


# Our resource server's reset, in NeMo Gym's venv, given a row whose prompt hash is not the served env's.
REFUSAL = """
import asyncio, json, sys
from unittest.mock import MagicMock
from nemo_gym.server_utils import ServerClient
from app import SeeupoResourcesServerConfig, SeeupoServer
server = SeeupoServer(config=SeeupoResourcesServerConfig(host="", port=0, entrypoint="", name="", serve_url=sys.argv[1]),
                      server_client=MagicMock(spec=ServerClient))
row = json.loads(sys.argv[2])
print("good row:", asyncio.run(server.reset(row, "a"))[1]["task_id"])
try:
    asyncio.run(server.reset(dict(row, prompt_sha256="0" * 64), "b"))
except Exception as error:
    print("refused:", error)
print("sessions left:", sorted(server.sessions))
"""


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nemo_gym")
    with serving("seeupo/BFCL-v4-v0", env=TOKEN) as bfcl, serving("seeupo/TurnBandit-v0") as bandit, \
            scripted_openai_server(script(tmp), tmp) as model_url:
        rows = prepare(bfcl.url, "seeupo_bfcl_agent", tmp / "bfcl.jsonl",
                       "--tasks", f"{GROUND_TRUTH_TASK},{UNSOLVED_TASK},{HOSTILE_TASK}")
        rows += prepare(bandit.url, "seeupo_turnbandit_agent", tmp / "turnbandit.jsonl",
                        "--seeds", ",".join(map(str, TURNBANDIT_SEEDS)))
        (tmp / "input.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        refusal = subprocess.run([str(VENV / "bin" / "python"), "-c", REFUSAL, bfcl.url, json.dumps(rows[0])],
                                 cwd=SERVER_DIR, capture_output=True, text=True, timeout=120, env={**os.environ, **TOKEN})
        out = gym_eval(tmp, model_url, {"bfcl": bfcl.url, "turnbandit": bandit.url})
    return {"rows": rows, "rollouts": out, "tmp": tmp, "refusal": refusal}


def by_task(rollouts) -> dict[str, dict]:
    return {rollout["info"]["task_id"]: rollout for rollout in rollouts["rollouts"]}


def test_bfcl_ground_truth_scores_one_and_an_unsolved_episode_zero_through_gym_eval_run(rollouts):
    done = by_task(rollouts)
    assert done[GROUND_TRUTH_TASK]["reward"] == 1.0 and done[GROUND_TRUTH_TASK]["terminated"] is True
    assert done[GROUND_TRUTH_TASK]["info"]["success"] is True
    assert done[UNSOLVED_TASK]["reward"] == 0.0 and done[UNSOLVED_TASK]["info"]["success"] is False


def test_turnbandit_episode_equals_the_local_env_reward(rollouts):
    import gymnasium as gym

    done = by_task(rollouts)
    for seed in TURNBANDIT_SEEDS:
        env = gym.make("seeupo/TurnBandit-v0")
        _, info = env.reset(seed=seed)
        env.close()
        expected = local_return("seeupo/TurnBandit-v0", turnbandit_replies(seed), seed=seed)
        assert done[info["task_id"]]["reward"] == pytest.approx(expected, abs=1e-12)


def test_hostile_model_text_scores_zero_and_runs_nothing(rollouts):
    done = by_task(rollouts)
    assert done[HOSTILE_TASK]["reward"] == 0.0
    assert not list(rollouts["tmp"].glob("pwned-*"))


def test_a_row_written_for_other_env_kwargs_is_refused_at_reset(rollouts):
    out = rollouts["refusal"].stdout
    assert rollouts["refusal"].returncode == 0, rollouts["refusal"].stderr[-3000:]
    assert f"good row: {GROUND_TRUTH_TASK}" in out
    assert "refused: this row's system prompt is not the served env's" in out
    assert "sessions left: ['a']" in out  # the refused reset kept no session


@pytest.mark.appworld
def test_appworld_ground_truth_scores_one_through_gym_eval_run(tmp_path):
    task_id = "mininote_1"
    with serving("seeupo/AppWorld-v0", "split=mini") as appworld, \
            scripted_openai_server(appworld_ground_truth_script(task_id), tmp_path) as model_url:
        rows = prepare(appworld.url, "seeupo_appworld_agent", tmp_path / "input.jsonl", "--tasks", task_id)
        assert [row["task_id"] for row in rows] == [task_id]
        (rollout,) = gym_eval(tmp_path, model_url, {"appworld": appworld.url}, model="appworld-ground-truth")
    assert rollout["info"]["task_id"] == task_id and rollout["info"]["success"] is True
    assert rollout["reward"] == 1.0 and rollout["terminated"] is True
