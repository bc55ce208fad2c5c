"""seeupo/BFCL-v4-v0 on bfcl-eval's real data, backends and official multi_turn_checker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import CATEGORIES, get_entry, load_category, render_action, render_turn_end, task_ids
from seeupo_gym.bfcl.data import derive_test_ids, _split_file
from seeupo_gym.bfcl.env import FINAL_OBSERVATION


def make(**kwargs):
    kwargs.setdefault("categories", list(CATEGORIES))
    kwargs.setdefault("split", "all")
    return gym.make("seeupo/BFCL-v4-v0", **kwargs)


def script_for(ground_truth) -> list[str]:
    """The ground-truth replay: each turn's calls in one response, then a turn-ending answer."""
    actions = []
    for calls in ground_truth:
        if calls:
            actions.append(render_action(list(calls), thought="these calls do what the user asked"))
        actions.append(render_turn_end("Done.", thought="nothing left to call"))
    return actions


def play(env, task_id: str, actions: list[str]):
    observation, info = env.reset(options={"task_id": task_id})
    steps = []
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        steps.append((observation, reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return steps


def replay(env, task_id: str, ground_truth=None):
    entry = get_entry(task_id)
    return play(env, task_id, script_for(entry.ground_truth if ground_truth is None else ground_truth))


def sample_ids(per_category: int) -> list[str]:
    ids = []
    for category in CATEGORIES:
        entries = load_category(category)
        step = len(entries) // per_category
        ids += [entries[index * step].id for index in range(per_category)]
    return ids


# ---------------------------------------------------------------- ground truth and checker


@pytest.mark.parametrize("task_id", sample_ids(10))
def test_ground_truth_replay_scores_one(task_id):
    env = make(max_turns=100)
    steps = replay(env, task_id)
    observation, reward, terminated, truncated, info = steps[-1]
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert info["turn_results"] == ["passed"] * get_entry(task_id).num_user_turns
    assert info["error_type"] == ""
    assert observation == FINAL_OBSERVATION
    assert all(step[1] == 0.0 for step in steps[:-1])  # reward only at the end
    assert info["turn"] == len(steps) == get_entry(task_id).min_responses


@pytest.mark.slow
def test_ground_truth_replay_scores_one_on_all_800_entries():
    env = make(max_turns=100)
    failed = []
    for category in CATEGORIES:
        for entry in load_category(category):
            *_, (_, reward, terminated, _, info) = replay(env, entry.id)
            if not (terminated and reward == 1.0):
                failed.append((entry.id, info.get("error_type")))
    assert failed == []


def test_missing_state_changing_call_scores_zero_with_state_mismatch():
    entry = get_entry("multi_turn_base_0")
    wrong = [list(calls) for calls in entry.ground_truth]
    wrong[0].remove("mkdir(dir_name='temp')")
    *_, (_, reward, terminated, _, info) = replay(make(max_turns=100), entry.id, wrong)
    assert terminated and reward == 0.0 and not info["success"]
    assert info["error_type"] == "multi_turn:instance_state_mismatch"
    assert info["turn_results"] == ["failed", "not_checked", "not_checked", "not_checked"]
    assert "root" in info["check_details"]["differences"]


def test_extra_state_changing_call_scores_zero():
    entry = get_entry("multi_turn_base_0")
    wrong = [list(calls) for calls in entry.ground_truth]
    wrong[1].append("touch(file_name='extra.txt')")
    *_, (_, reward, _, _, info) = replay(make(max_turns=100), entry.id, wrong)
    assert reward == 0.0
    assert info["error_type"] == "multi_turn:instance_state_mismatch"
    assert info["turn_results"] == ["passed", "failed", "not_checked", "not_checked"]


def test_missing_read_only_call_fails_the_response_check():
    entry = get_entry("multi_turn_base_0")
    wrong = [list(calls) for calls in entry.ground_truth]
    wrong[1] = ["cd(folder='temp')"]  # no grep: the state matches, the grep output is missing
    *_, (_, reward, _, _, info) = replay(make(max_turns=100), entry.id, wrong)
    assert reward == 0.0
    assert info["error_type"] == "multi_turn:execution_response_mismatch"
    assert info["turn_results"] == ["passed", "failed", "not_checked", "not_checked"]
    assert "budget analysis" in info["check_details"]["missing_items"]


def test_a_wrong_episode_does_not_leak_into_a_later_right_one():
    # BFCL's executor caches instances per model name: a wrong then a right
    # answer would both fail there. Here each episode and each check has its own state.
    env = make(max_turns=100)
    entry = get_entry("multi_turn_base_1")
    wrong = [list(calls) for calls in entry.ground_truth]
    wrong[1] = ["cd(folder='workspace')", "mv(source='log.txt', destination='elsewhere')"]
    assert replay(env, entry.id, wrong)[-1][1] == 0.0
    assert replay(env, entry.id)[-1][1] == 1.0
    assert replay(make(max_turns=100), entry.id)[-1][1] == 1.0


def test_checker_leaves_no_cached_instances_in_bfcl_globals():
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    before = set(vars(multi_turn_utils))
    env = make(max_turns=100)
    for task_id in sample_ids(2):
        replay(env, task_id)
    assert set(vars(multi_turn_utils)) == before


def test_importing_the_env_creates_no_bfcl_result_folders():
    root = Path(importlib.util.find_spec("bfcl_eval").origin).parents[1]
    make().reset(seed=0)
    for name in ("result", "score", ".file_locks"):
        assert not (root / name).exists()
    assert "bfcl_eval.constants.eval_config" not in sys.modules
    assert "bfcl_eval.utils" not in sys.modules


# ---------------------------------------------------------------- turns and truncation


def test_truncation_at_max_turns_scores_zero():
    entry = next(e for e in load_category("base") if e.min_responses > 10)
    steps = replay(make(), entry.id)  # default max_turns=10
    observation, reward, terminated, truncated, info = steps[-1]
    assert len(steps) == 10
    assert (reward, terminated, truncated, info["success"]) == (0.0, False, True, False)
    assert info["error_type"] == "multi_turn:force_terminated"


def test_an_entry_needing_exactly_ten_responses_completes_under_the_default():
    entry = next(e for e in load_category("base") if e.min_responses == 10)
    *_, (_, reward, terminated, truncated, _) = replay(make(), entry.id)
    assert (reward, terminated, truncated) == (1.0, True, False)


def test_plain_text_ends_the_turn_and_the_next_user_message_follows():
    entry = get_entry("multi_turn_base_0")
    env = make()
    env.reset(options={"task_id": entry.id})
    observation, _, terminated, _, info = env.step("<think>I cannot do this.</think>\nSorry, I cannot do that.")
    assert observation == entry.user_messages[1]
    assert (info["action_kind"], info["user_turn"], info["turn"], terminated) == ("turn_end", 1, 1, False)


@pytest.mark.parametrize(
    "action",
    ["<think>done</think>\n[]", "<think>x</think>\n[Note] nothing to do", "All done (nothing else to do).", "Done."],
)
def test_empty_call_list_and_text_that_is_not_a_call_list_end_the_turn(action):
    env = make()
    env.reset(options={"task_id": "multi_turn_base_0"})
    *_, info = env.step(action)
    assert (info["action_kind"], info["user_turn"], info["action_error"]) == ("turn_end", 1, "")


def test_a_malformed_call_list_is_an_error_that_does_not_end_the_turn():
    env = make()
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, _, terminated, truncated, info = env.step("<think>x</think>\n[cd(folder='document'), mkdir(")
    assert info["action_kind"] == "error" and "syntax" in info["action_error"]
    assert observation.startswith("Error:")
    assert (info["user_turn"], info["turn"], terminated, truncated) == (0, 1, False, False)


def test_calls_without_brackets_or_in_a_code_fence_are_run():
    env = make()
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, *_, info = env.step("<think>go</think>\ncd(folder='document')")
    assert info["calls"] == ["cd(folder='document')"] and "document" in observation
    observation, *_, info = env.step("<think>look</think>\n```python\n[ls(a=True)]\n```")
    assert info["calls"] == ["ls(a=True)"] and "final_report.pdf" in observation


def test_backend_errors_come_back_as_results():
    env = make()
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, *_, info = env.step(render_action(["cd(folder='nowhere')", "cd('a', 'b')"]))
    assert info["action_kind"] == "calls"
    first, second = observation.splitlines()[1:]
    # The tool's own error result, and the executor's error for a call the tool cannot take.
    assert first.startswith("[1] cd(folder='nowhere') -> ") and "No such file or directory" in first
    assert second.startswith("[2] cd('a', 'b') -> Error during execution") and "positional argument" in second


def test_an_argument_name_the_function_does_not_take_refuses_the_response_and_names_its_parameters():
    env = make()
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, *_, info = env.step(render_action(["pwd()", "cd(wrong_param=1)"]))
    assert info["action_kind"] == "error" and info["calls"] == []
    assert info["action_error"] == "cd: unknown argument(s) 'wrong_param'; it takes folder"


def test_miss_func_reveals_held_back_functions_in_the_user_message():
    entry = get_entry("multi_turn_miss_func_0")
    (reveal_turn, names), = entry.revealed_functions.items()
    env = make()
    observation, _ = env.reset(options={"task_id": entry.id})
    assert all(f"\n{name}(" not in observation for name in names)
    for turn in range(reveal_turn):
        observation, *_ = env.step(render_turn_end("Next."))
    assert observation.startswith("I have added more functions")
    assert all(f"\n{name}(" in observation for name in names)


# ---------------------------------------------------------------- env contract


def test_reset_observation_is_system_prompt_then_first_user_message():
    env = make()
    observation, info = env.reset(options={"task_id": "multi_turn_long_context_3"})
    system, first = info["messages"][0], info["messages"][1]
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    assert observation == system["content"] + "\n\n" + first["content"]
    assert first["content"] == get_entry("multi_turn_long_context_3").user_messages[0]
    assert (info["task_id"], info["turn"], info["success"]) == ("multi_turn_long_context_3", 0, False)
    assert "# Tools" in system["content"] and "<think>" in system["content"]
    assert '"dict"' not in system["content"]


def test_messages_follow_the_episode_and_drop_old_thoughts_when_asked():
    for keep_think in (True, False):
        env = make(keep_think=keep_think)
        env.reset(options={"task_id": "multi_turn_base_0"})
        action = render_action(["cd(folder='document')"], thought="secret plan")
        observation, *_, info = env.step(action)
        roles = [m["role"] for m in info["messages"]]
        assert roles == ["system", "user", "assistant", "user"]
        assert info["messages"][-1]["content"] == observation
        assert ("secret plan" in info["messages"][2]["content"]) is keep_think
        assert "[cd(folder='document')]" in info["messages"][2]["content"]


def test_check_env_passes():
    env = make(categories=["base"], split="train")
    check_env(env.unwrapped, skip_render_check=True)


def test_observations_and_rendered_actions_are_in_the_spaces():
    env = make(max_turns=100)
    task_id = "multi_turn_long_context_0"
    observation, _ = env.reset(options={"task_id": task_id})
    assert env.observation_space.contains(observation)
    for action in script_for(get_entry(task_id).ground_truth):
        assert env.action_space.contains(action)
        observation, *_ = env.step(action)
        assert env.observation_space.contains(observation)


def test_same_seed_same_task_order_and_split_respected():
    def order(seed):
        env = make(categories=["base", "miss_param"], split="test")
        first = env.reset(seed=seed)[1]["task_id"]
        return [first] + [env.reset()[1]["task_id"] for _ in range(9)]

    assert order(7) == order(7)
    assert order(7) != order(8)
    allowed = set(task_ids(["base", "miss_param"], "test"))
    assert set(order(3)) <= allowed


def test_without_task_id_every_task_of_the_split_comes_once_per_pass():
    env = make(categories=["miss_func"], split="train")
    seen = [env.reset(seed=0)[1]["task_id"]] + [env.reset()[1]["task_id"] for _ in range(99)]
    assert sorted(seen) == sorted(task_ids(["miss_func"], "train"))


def test_split_file_matches_its_seeded_derivation_and_partitions_each_category():
    for category in CATEGORIES:
        test = task_ids([category], "test")
        train = task_ids([category], "train")
        assert list(_split_file()[category]) == derive_test_ids(category) == test
        assert len(test) == len(train) == 100 and not set(test) & set(train)
        assert sorted(test + train) == sorted(task_ids([category], "all"))


def test_category_variant_ids_draw_from_their_category():
    env = gym.make("seeupo/BFCL-v4-long-context-v0", split="test")
    assert env.reset(seed=0)[1]["task_id"].startswith("multi_turn_long_context_")
    with pytest.raises(TypeError):
        gym.make("seeupo/BFCL-v4-base-v0", categories=["miss_func"])


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="categories"):
        make(categories=["multiple"])
    with pytest.raises(ValueError, match="split"):
        make(split="validation")
    with pytest.raises(ValueError, match="multi_turn_base_0"):
        make().reset(options={"task_id": "simple_0"})


def test_step_after_the_end_or_before_reset_raises():
    env = make(max_turns=100)
    replay(env, "multi_turn_base_3")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Done.")


def test_async_vector_env_runs_episodes_to_the_end():
    num_envs = 8
    envs = gym.make_vec(  # gymnasium's defaults: observations travel through shared memory
        "seeupo/BFCL-v4-v0",
        num_envs=num_envs,
        vectorization_mode="async",
        categories=["base", "miss_func"],
        split="train",
        max_turns=100,
    )
    _, infos = envs.reset(seed=11)
    scripts = [script_for(get_entry(task_id).ground_truth) for task_id in infos["task_id"]]
    rewards: list[float] = []
    episodes = [0] * num_envs
    needs_reset = [False] * num_envs
    for _ in range(200):
        actions = tuple("Done." if needs_reset[i] else scripts[i].pop(0) for i in range(num_envs))
        _, reward, terminated, truncated, infos = envs.step(actions)
        for i in range(num_envs):
            if needs_reset[i]:  # this step was the autoreset: a new episode began
                scripts[i] = script_for(get_entry(infos["task_id"][i]).ground_truth)
                needs_reset[i] = False
            elif terminated[i] or truncated[i]:
                rewards.append(float(reward[i]))
                episodes[i] += 1
                needs_reset[i] = True
        if min(episodes) >= 2:
            break
    envs.close()
    assert min(episodes) >= 2
    assert rewards == [1.0] * len(rewards)


@pytest.mark.parametrize(
    "options,match",
    [("notadict", "must be a dict"), ({"task_id": "../tasks/x"}, "task name"), ({"task_id": "a/b"}, "task name"),
     ({"task_id": "multi_turn_base_99999"}, "no BFCL entry")],
)
def test_reset_options_of_the_wrong_shape_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        make().reset(options=options)


def test_info_has_the_same_keys_and_types_at_reset_and_at_the_end():
    env = make(max_turns=100)
    _, first = env.reset(options={"task_id": "multi_turn_base_0"})
    last = replay(env, "multi_turn_base_0")[-1][-1]
    assert first.keys() == last.keys()
    assert {key: type(value) for key, value in first.items()} == {key: type(value) for key, value in last.items()}
