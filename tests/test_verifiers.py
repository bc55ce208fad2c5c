"""seeupo-gym's envs as verifiers v1 tasksets, through verifiers' own eval CLI (`vf-eval`, from
`.venv-verifiers`: `make verifiers-venv`) into its `traces.jsonl`. The envs are real `seeupo-serve`
processes; the model is scripted (tests/openai_server.py, streamed as verifiers asks); the agent is
verifiers' null chat program on its subprocess runtime (our `SeeupoHarness` runs it with the venv's
interpreter instead of a uv environment, which would be downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gymnasium as gym
import pytest

from ecosystem_helpers import (GROUND_TRUTH_TASK, HOSTILE_TASK, TOKEN, TURNBANDIT_SEEDS, UNSOLVED_TASK,
                               appworld_ground_truth_script, local_return, script, scripted_openai_server,
                               turnbandit_replies)
from serve_helpers import repo_root, serving

VENV = repo_root() / ".venv-verifiers"

pytestmark = [
    pytest.mark.slow,  # two seeupo-serve processes, a model server and two vf-eval runs: ~40 s on 2 cores
    pytest.mark.skipif(not (VENV / "bin" / "vf-eval").exists(),
                       reason="verifiers' venv is absent: `make verifiers-venv` builds .venv-verifiers"),
]


def vf_eval(taskset: str, model_url: str, out: Path, *args: str, model: str = "scripted") -> list[dict]:
    run = subprocess.run(
        [str(VENV / "bin" / "vf-eval"), taskset, "--model", model, "--client.base-url", model_url,
         "--client.api-key-var", "SCRIPTED_API_KEY", "--no-push", "--no-rich", "-o", str(out), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "SCRIPTED_API_KEY": "unused", **TOKEN})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    (traces,) = out.glob("*/traces.jsonl")
    return [json.loads(line) for line in traces.read_text().splitlines()]


def seat(episode: dict) -> dict:
    (trace,) = episode["traces"]
    return trace


# The BFCL taskset, loaded in verifiers' venv as vf-eval loads it, with a split, categories or a
# server it cannot play.
REFUSALS = """
import sys
from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
bfcl, bandit = sys.argv[1:]
for url, extra in ((bfcl, {"split": "test"}), (bfcl, {"categories": ["long_context"]}), (bandit, {})):
    config = taskset_config_type("seeupo-vf-bfcl")(id="seeupo-vf-bfcl", serve_url=url, **extra)
    try:
        list(load_taskset(config))
    except ValueError as error:
        print("refused:", error)
config = taskset_config_type("seeupo-vf-bfcl")(id="seeupo-vf-bfcl", serve_url=bfcl, categories=["base"])
print("base tasks:", len(list(load_taskset(config))))
"""


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verifiers")
    with serving("seeupo/BFCL-v4-v0", env=TOKEN) as bfcl, serving("seeupo/TurnBandit-v0") as bandit, \
            scripted_openai_server(script(tmp), tmp) as model_url:
        tasks = json.dumps([GROUND_TRUTH_TASK, UNSOLVED_TASK, HOSTILE_TASK])
        bfcl_episodes = vf_eval("seeupo-vf-bfcl", model_url, tmp / "bfcl", "--env.taskset.serve-url", bfcl.url,
                                "--env.taskset.task-ids", tasks, "--env.taskset.categories", '["base"]')
        refusals = subprocess.run([str(VENV / "bin" / "python"), "-c", REFUSALS, bfcl.url, bandit.url],
                                  capture_output=True, text=True, timeout=120, env={**os.environ, **TOKEN})
        bandit_episodes = vf_eval("seeupo-vf-turnbandit", model_url, tmp / "turnbandit", "--env.taskset.serve-url",
                                  bandit.url, "--env.taskset.seeds", json.dumps(list(TURNBANDIT_SEEDS)))
    return {"bfcl": {seat(e)["info"]["seeupo"]["task_id"]: seat(e) for e in bfcl_episodes},
            "turnbandit": {seat(e)["info"]["seeupo"]["task_id"]: seat(e) for e in bandit_episodes}, "tmp": tmp,
            "refusals": refusals}


def test_bfcl_ground_truth_scores_one_and_an_unsolved_episode_zero_through_vf_eval(episodes):
    bfcl = episodes["bfcl"]
    assert bfcl[GROUND_TRUTH_TASK]["rewards"]["env_reward"]["score"] == 1.0
    assert bfcl[GROUND_TRUTH_TASK]["info"]["seeupo"]["success"] is True
    assert bfcl[UNSOLVED_TASK]["rewards"]["env_reward"]["score"] == 0.0
    assert bfcl[UNSOLVED_TASK]["info"]["seeupo"]["done"] is True


def test_turnbandit_episode_equals_the_local_env_reward(episodes):
    for seed in TURNBANDIT_SEEDS:
        env = gym.make("seeupo/TurnBandit-v0")
        _, info = env.reset(seed=seed)
        env.close()
        expected = local_return("seeupo/TurnBandit-v0", turnbandit_replies(seed), seed=seed)
        assert episodes["turnbandit"][info["task_id"]]["rewards"]["env_reward"]["score"] == pytest.approx(expected, abs=1e-12)


def test_hostile_model_text_scores_zero_and_runs_nothing(episodes):
    hostile = episodes["bfcl"][HOSTILE_TASK]
    assert hostile["rewards"]["env_reward"]["score"] == 0.0
    assert not list(episodes["tmp"].glob("pwned-*"))


def test_the_bfcl_taskset_refuses_a_split_categories_or_env_the_server_does_not_serve(episodes):
    out = episodes["refusals"].stdout
    assert episodes["refusals"].returncode == 0, episodes["refusals"].stderr[-3000:]
    assert "serves BFCL split 'train', not 'test': start `seeupo-serve seeupo/BFCL-v4-v0 split=test`" in out
    assert "does not serve the BFCL categories ['long_context']" in out
    assert "serves 'seeupo/TurnBandit-v0', not seeupo/BFCL-v4-v0" in out
    assert int(out.split("base tasks:")[1]) > 0


@pytest.mark.appworld
def test_appworld_ground_truth_scores_one_through_vf_eval(tmp_path):
    task_id = "mininote_1"
    with serving("seeupo/AppWorld-v0", "split=mini") as appworld, \
            scripted_openai_server(appworld_ground_truth_script(task_id), tmp_path) as model_url:
        (episode,) = vf_eval("seeupo-vf-appworld", model_url, tmp_path / "out", "--env.taskset.serve-url", appworld.url,
                             "--env.taskset.task-ids", json.dumps([task_id]), model="appworld-ground-truth")
    trace = seat(episode)
    assert trace["info"]["seeupo"]["success"] is True
    assert trace["rewards"]["env_reward"]["score"] == 1.0
