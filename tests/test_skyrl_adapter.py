"""Our envs through SkyRL's `skyrl_gym.make` (seeupo_gym.integrations.skyrl), with the real skyrl-gym 0.4."""

from __future__ import annotations

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs `pip install seeupo-gym[skyrl]` (make test installs it)")

from omegaconf import OmegaConf  # noqa: E402

from seeupo_gym.bfcl import get_entry, render_action, render_tool_action, render_turn_end  # noqa: E402
from seeupo_gym.integrations.skyrl import build_dataset, register  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    register()  # idempotent


def play(env, actions):
    outputs = []
    for action in actions:
        outputs.append(env.step(action))
        if outputs[-1]["done"]:
            break
    return outputs


@pytest.mark.parametrize("action_format", ["react", "tools"])
def test_bfcl_ground_truth_through_skyrl_make_scores_one(action_format):
    entry = get_entry("multi_turn_base_0")
    config = OmegaConf.create({"max_turns": 20, "action_format": action_format})
    env = skyrl_gym.make("seeupo/BFCL-v4-v0", env_config=config, extras={"task_id": entry.id})
    assert isinstance(env, BaseTextEnv) and env.max_turns == 20
    prompt, metadata = env.init([{"role": "user", "content": "ignored: the env owns its prompt"}])
    assert [m["role"] for m in prompt] == ["system", "user"] and prompt[1]["content"] == entry.user_messages[0]
    render = render_tool_action if action_format == "tools" else render_action
    assert (metadata["tools"] != []) == (action_format == "tools")
    if action_format == "tools":
        assert '"name": "cd"' in prompt[0]["content"]  # SkyRL renders without tools=: they are in the text
    actions = []
    for calls in entry.ground_truth:
        if calls:
            actions.append(render(list(calls)))
        actions.append(render_turn_end("Done."))
    outputs = play(env, actions)
    assert outputs[-1]["done"] and outputs[-1]["reward"] == 1.0 and outputs[-1]["metadata"]["success"]
    assert all(not output["done"] and output["reward"] == 0.0 for output in outputs[:-1])
    first = outputs[0]["observations"]
    expected_role = "tool" if action_format == "tools" else "user"
    assert first and {m["role"] for m in first} == {expected_role}
    env.close()


def test_turnbandit_through_skyrl_make_scores_the_optimum_from_extra_info():
    env = skyrl_gym.make("seeupo/TurnBandit-v0", env_config={"variant": "follow", "num_tasks": 2},
                         extras={"extra_info": {"task_id": "follow-0-0"}, "reward_spec": {}})
    prompt, _ = env.init([])
    assert "Task follow-0-0" in prompt[-1]["content"]
    task = env.env.unwrapped.tasks[0]
    outputs = play(env, [f"<think>pick</think>\n{label}" for label in task.optimal_answers()])
    assert outputs[-1]["done"] and outputs[-1]["reward"] == pytest.approx(task.optimal_value)
    assert outputs[0]["observations"][0]["role"] == "user"


def test_a_row_without_a_task_id_is_a_clear_error():
    with pytest.raises(ValueError, match="extras must name the task"):
        skyrl_gym.make("seeupo/TurnBandit-v0", env_config=None, extras={"prompt": "x"})


def test_a_bad_action_is_an_observation_not_an_exception():
    env = skyrl_gym.make("seeupo/BFCL-v4-base-v0", env_config={"action_format": "tools"}, extras={"task_id": "multi_turn_base_0"})
    env.init([])
    output = env.step('<tool_call>{"name": "cd", "arguments": {"folder": ' + "[" * 10_000 + "}}</tool_call>")
    assert not output["done"] and "nested too deeply" in output["metadata"]["action_error"]
    assert output["observations"][0]["role"] == "user" and output["observations"][0]["content"].startswith("Error:")


# Slow suite: a fourth AppWorld ground-truth path, ~20 s; the TRL and gym ones stay.
@pytest.mark.slow
@pytest.mark.appworld
def test_appworld_ground_truth_through_skyrl_make_scores_one():
    from conftest import appworld_mini
    from seeupo_gym.appworld.env import render_tool_action as appworld_tool_action

    folder, tasks = appworld_mini()
    env = skyrl_gym.make("seeupo/AppWorld-v0", env_config={"action_format": "tools"}, extras={"task_id": tasks[0]})
    try:
        env.init([])
        solution = (folder / "tasks" / tasks[0] / "ground_truth" / "solution.py").read_text()
        output = env.step(appworld_tool_action(solution))
        assert output["done"] and output["reward"] == 1.0
    finally:
        env.close()


def test_dataset_rows_play_through_skyrl_make_as_skyrl_hands_them_to_the_env(tmp_path):
    import pandas as pd

    rows = build_dataset("seeupo/BFCL-v4-base-v0", ["multi_turn_base_0", "multi_turn_base_1"], action_format="tools")
    assert [row["extra_info"]["task_id"] for row in rows] == ["multi_turn_base_0", "multi_turn_base_1"]
    assert {row["env_class"] for row in rows} == {"seeupo/BFCL-v4-base-v0"}
    assert rows[1]["prompt"][1] == {"role": "user", "content": get_entry("multi_turn_base_1").user_messages[0]}
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    row = pd.read_parquet(tmp_path / "train.parquet").iloc[1].to_dict()
    # SkyRL: every column but prompt and env_class goes to the env as extras.
    extras = {key: value for key, value in row.items() if key not in ("prompt", "env_class")}
    env = skyrl_gym.make(row["env_class"], env_config={"action_format": "tools"}, extras=extras)
    prompt, metadata = env.init(list(row["prompt"]))
    assert metadata["task_id"] == "multi_turn_base_1" and prompt[1]["content"] == rows[1]["prompt"][1]["content"]
    entry = get_entry("multi_turn_base_1")
    actions = [a for calls in entry.ground_truth for a in ([render_tool_action(list(calls))] if calls else []) + ["Done."]]
    assert play(env, actions)[-1]["reward"] == 1.0
    env.close()


def test_dataset_of_turnbandit_defaults_to_the_envs_own_tasks():
    rows = build_dataset("seeupo/TurnBandit-v0", variant="follow", num_tasks=3)
    assert [row["extra_info"]["task_id"] for row in rows] == ["follow-0-0", "follow-0-1", "follow-0-2"]
    assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2]



def test_dataset_of_a_split_is_the_envs_split_and_says_so():
    from seeupo_gym.bfcl.data import task_ids

    rows = build_dataset("seeupo/BFCL-v4-base-v0", split="test", action_format="tools")
    assert [row["extra_info"]["task_id"] for row in rows] == list(task_ids(("base",), "test"))
    assert {row["extra_info"]["split"] for row in rows} == {"test"}


def test_a_dataset_for_an_id_skyrl_does_not_know_is_a_clear_error():
    with pytest.raises(ValueError, match="no SkyRL env for 'seeupo/Remote-v0'"):
        build_dataset("seeupo/Remote-v0", ["x"])
