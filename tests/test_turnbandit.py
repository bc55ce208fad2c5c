"""TurnBandit: tasks, exact optimum, the env contract, invalid actions."""

import itertools

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.templates import ReActTemplate
from seeupo_gym.turnbandit import TurnBanditEnv, make_tasks, parse_choice

ALL_TASKS = (
    make_tasks("climbing", 24, seed=0)
    + make_tasks("random", 24, seed=0)
    + make_tasks("easy", 12, seed=0, turns=(2, 3), options=3)
    + make_tasks("climbing", 12, seed=5, turns=(2, 4), options=4)
    + make_tasks("follow", 12, seed=0, turns=(1, 4), options=4)
)


def act(label: str, thought: str = "pick") -> str:
    return ReActTemplate.render(label, thought)


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.task_id)
def test_backward_induction_optimum_equals_brute_force(task):
    brute = max(task.reward(a) for a in itertools.product(range(task.num_options), repeat=task.num_turns))
    value, actions = task.optimal()
    assert value == brute
    assert task.reward(actions) == value
    assert 0.0 <= min(task.rewards.values()) and max(task.rewards.values()) <= 1.0


def test_climbing_tasks_are_deceptive_and_random_ones_mostly_are_not():
    climbing = make_tasks("climbing", 40, seed=3)
    assert all(t.deceptive for t in climbing)
    for t in climbing:
        uniform = t.first_turn_uniform_values()
        assert max(range(t.num_options), key=uniform.__getitem__) != t.optimal()[1][0]
    assert sum(t.deceptive for t in make_tasks("random", 40, seed=3)) < 40


def test_tasks_depend_only_on_variant_seed_and_index():
    assert make_tasks("mixed", 6, seed=1) == make_tasks("mixed", 6, seed=1)
    assert make_tasks("mixed", 6, seed=1)[:3] == make_tasks("mixed", 3, seed=1)
    assert make_tasks("mixed", 6, seed=1) != make_tasks("mixed", 6, seed=2)
    kinds = [t.kind for t in make_tasks("mixed", 6)]
    assert kinds == ["climbing", "random"] * 3
    assert {t.num_turns for t in make_tasks("mixed", 60)} == {2, 3, 4}


def test_easy_preset_is_two_turns_two_options_with_a_per_turn_reward():
    env = gym.make("seeupo/TurnBandit-v0", variant="easy")
    task = env.unwrapped.tasks[0]
    assert (task.num_turns, task.num_options) == (2, 2)
    assert sorted(set(task.rewards.values())) == [0.0, 0.5, 1.0]
    _, info = env.reset(seed=0)
    assert len(info["messages"][1]["content"]) < 200  # short steps for a small model


def test_follow_steps_name_the_option_that_scores():
    env = TurnBanditEnv(variant="follow", num_tasks=16, brief=True)
    task = env.tasks[0]
    assert (task.num_turns, task.num_options) == (2, 3) and sorted(set(task.rewards.values())) == [0.0, 0.5, 1.0]
    assert len({t.optimal_answers() for t in env.tasks}) > 4  # the named letters vary
    for task in env.tasks[:6]:
        named = task.optimal_answers()
        observation, _ = env.reset(options={"task_id": task.task_id})
        assert f"Step 1 of 2. Pick option {named[0]}. Options:" in observation
        observation, reward, *_ = env.step(named[0])
        assert f"Pick option {named[1]}." in observation and reward == 0.0
        wrong = next(label for label in "ABC" if label != named[1])
        *_, reward, terminated, _, info = env.step(wrong)
        assert terminated and reward == 0.5 and not info["success"]


def test_check_env_passes():
    check_env(gym.make("seeupo/TurnBandit-v0").unwrapped)
    check_env(gym.make("seeupo/TurnBandit-v0", variant="easy").unwrapped)
    check_env(gym.make("seeupo/TurnBandit-v0", variant="follow").unwrapped)


def test_spaces_are_short_unicode_text():
    env = TurnBanditEnv()
    assert isinstance(env.observation_space, UnicodeText) and isinstance(env.action_space, UnicodeText)
    assert len(repr(env.action_space)) < 40


def test_playing_the_optimal_joint_action_earns_j_star_and_success():
    env = TurnBanditEnv(variant="climbing", num_tasks=4)
    task = env.tasks[2]
    obs, info = env.reset(options={"task_id": task.task_id})
    assert info["task_id"] == task.task_id and info["turn"] == 0
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    assert "<think>" in info["messages"][0]["content"] and "A)" in obs
    _, best = task.optimal()
    for t, a in enumerate(best, start=1):
        obs, reward, terminated, truncated, info = env.step(act("ABCD"[a]))
        assert info["turn"] == t and not truncated
    assert terminated and reward == pytest.approx(1.0) and info["success"]
    assert [m["role"] for m in info["messages"]] == ["system"] + ["user", "assistant"] * task.num_turns + ["user"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("A")


def test_rewards_are_zero_until_the_end_and_equal_the_table():
    env = TurnBanditEnv(variant="random", num_tasks=3)
    task = env.tasks[1]
    env.reset(options={"task_id": task.task_id})
    rewards = []
    for _ in range(task.num_turns):
        _, r, terminated, _, info = env.step("B")  # a bare label is accepted
        rewards.append(r)
    assert rewards[:-1] == [0.0] * (task.num_turns - 1)
    assert terminated and rewards[-1] == pytest.approx(task.reward([1] * task.num_turns))
    assert info["success"] == (task.reward([1] * task.num_turns) == task.optimal_value)


@pytest.mark.parametrize(
    "answer,choice",
    [("B", 1), ("b", 1), ("(B)", 1), ("B.", 1), ("Option B", 1), ("B) blue door", 1), ("blue door", 1), ("**A**", 0)],
)
def test_answer_forms_that_name_an_option(answer, choice):
    assert parse_choice(answer, ["red door", "blue door", "green door"]) == choice


@pytest.mark.parametrize("answer", ["", "D", "B or C", "I pick B", "B) green door", "door", "AB"])
def test_answer_forms_that_name_no_option(answer):
    assert parse_choice(answer, ["red door", "blue door", "green door"]) is None


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "Z", "<think>never closed B", "x" * 10_000, "\x00\x01\xff", "<think>ok</think>", "<think>a</think> C or A"],
)
def test_invalid_actions_cost_a_turn_repeat_the_decision_and_are_visible(bad):
    env = TurnBanditEnv(variant="climbing", num_tasks=2, invalid_penalty=0.1)
    task = env.tasks[0]
    env.reset(options={"task_id": task.task_id})
    obs, reward, terminated, truncated, info = env.step(bad)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["invalid_action"] and info["invalid_actions"] == 1 and info["action_error"]
    assert obs.startswith("Invalid action") and f"Step 1 of {task.num_turns}" in obs
    assert info["turn"] == 1 and info["choices"] == ""


def test_invalid_penalty_is_subtracted_from_the_final_reward():
    env = TurnBanditEnv(variant="climbing", num_tasks=2, invalid_penalty=0.25)
    task = env.tasks[0]
    env.reset(options={"task_id": task.task_id})
    env.step("nonsense")
    _, best = task.optimal()
    for a in best:
        _, reward, terminated, _, info = env.step(act("ABC"[a]))
    assert terminated and reward == pytest.approx(0.75)
    assert not info["success"]  # strict: an invalid turn spoils success


def test_running_out_of_turns_truncates_with_zero_reward():
    env = TurnBanditEnv(variant="climbing", num_tasks=2, max_turns=5)
    env.reset(options={"task_id": env.tasks[0].task_id})
    env.step("A")
    for _ in range(4):
        _, reward, terminated, truncated, info = env.step("?")
    assert truncated and not terminated and reward == 0.0 and not info["success"]
    assert "Turn limit" in info["messages"][-1]["content"]


def test_non_string_action_is_an_error_observation_not_a_crash():
    env = TurnBanditEnv(num_tasks=2)
    env.reset(seed=1)
    obs, _, _, _, info = env.step(None)  # type: ignore[arg-type]
    assert info["invalid_action"] and "string" in info["action_error"]


def test_reset_draws_tasks_reproducibly_and_rejects_unknown_ids():
    env = TurnBanditEnv(num_tasks=50)
    draws = [env.reset(seed=s)[1]["task_id"] for s in range(5)]
    assert draws == [env.reset(seed=s)[1]["task_id"] for s in range(5)]
    assert len(set(draws)) > 1
    with pytest.raises(ValueError, match="unknown TurnBandit task_id"):
        env.reset(options={"task_id": "nope"})


@pytest.mark.parametrize(
    "kwargs,match",
    [({"variant": "hard"}, "variant"), ({"options": 1}, "options"), ({"turns": (0, 2)}, "turns"), ({"max_turns": 1}, "max_turns")],
)
def test_bad_kwargs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurnBanditEnv(**kwargs)


def test_keep_think_false_drops_thoughts_from_the_history():
    env = TurnBanditEnv(num_tasks=2, template=ReActTemplate(keep_think=False))
    env.reset(seed=0)
    _, _, _, _, info = env.step(act("A", thought="secret"))
    assert info["messages"][2] == {"role": "assistant", "content": "A"}


def test_env_lists_its_task_ids_and_reports_each_task_kind_as_category():
    import gymnasium as gym

    env = gym.make("seeupo/TurnBandit-v0", variant="mixed", num_tasks=4)
    inner = env.unwrapped
    assert inner.task_ids == tuple(task.task_id for task in inner.tasks)
    kinds = set()
    for task_id in inner.task_ids:
        _, info = env.reset(options={"task_id": task_id})
        kinds.add(info["category"])
    assert kinds == {"climbing", "random"}


def test_reset_returns_the_system_prompt_and_the_first_step_like_the_other_envs():
    env = TurnBanditEnv(num_tasks=2)
    obs, info = env.reset(seed=0)
    system, first = info["messages"][0], info["messages"][1]
    assert system["role"] == "system" and "TurnBandit" in system["content"]
    assert obs == system["content"] + "\n\n" + first["content"]
    assert env.observation_space.contains(obs)


def test_valid_actions_report_an_empty_action_error():
    env = TurnBanditEnv(num_tasks=2)
    _, info = env.reset(seed=0)
    assert (info["action_error"], info["invalid_action"]) == ("", False)
    *_, info = env.step(act("A"))
    assert (info["action_error"], info["invalid_action"]) == ("", False)


@pytest.mark.parametrize("variant", ["climbing", "random", "easy", "follow"])
def test_optimal_answers_are_labels_the_env_accepts_and_earn_j_star(variant):
    env = TurnBanditEnv(variant=variant, num_tasks=6)
    for task in env.tasks:
        env.reset(options={"task_id": task.task_id})
        assert len(task.optimal_answers()) == task.num_turns
        for label in task.optimal_answers():
            _, reward, terminated, _, info = env.step(label)
        assert terminated and info["success"] and reward == pytest.approx(task.optimal_value)


def test_optimum_sets_j_star_below_one():
    tasks = make_tasks("mixed", 8, seed=0, optimum=0.6)
    assert {task.optimal_value for task in tasks} == {0.6}
    assert all(max(task.rewards.values()) == 0.6 for task in tasks)


def test_an_optimum_range_draws_each_tasks_j_star_from_it_and_keeps_climbing_deceptive():
    tasks = make_tasks("climbing", 20, seed=0, optimum=(0.3, 0.9))
    values = [task.optimal_value for task in tasks]
    assert all(0.3 <= value <= 0.9 for value in values) and len(set(values)) > 10
    assert all(task.deceptive for task in tasks)
    assert make_tasks("climbing", 20, seed=0, optimum=(0.3, 0.9)) == tasks


def test_the_default_optimum_leaves_the_tasks_as_they_were():
    assert make_tasks("mixed", 6, seed=1) == make_tasks("mixed", 6, seed=1, optimum=1.0)
    assert {task.optimal_value for task in make_tasks("mixed", 6, seed=1)} == {1.0}


def test_an_env_with_j_star_below_one_counts_reaching_it_as_success():
    env = gym.make("seeupo/TurnBandit-v0", variant="random", num_tasks=3, optimum=(0.4, 0.7))
    task = env.unwrapped.tasks[0]
    env.reset(options={"task_id": task.task_id})
    for label in task.optimal_answers():
        _, reward, terminated, _, info = env.step(act(label))
    assert terminated and info["success"] and 0.4 <= reward <= 0.7


@pytest.mark.parametrize("optimum", [0.0, 1.5, (0.8, 0.2), (-0.1, 0.5)])
def test_an_optimum_outside_zero_one_is_a_clear_error(optimum):
    with pytest.raises(ValueError, match="optimum"):
        make_tasks("mixed", 2, optimum=optimum)


@pytest.mark.parametrize(
    "options,match",
    [("notadict", "must be a dict"), ({"task_id": "../tasks/x"}, "task name"), ({"task_id": 3}, "task name")],
)
def test_reset_options_of_the_wrong_shape_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        TurnBanditEnv(num_tasks=2).reset(options=options)


def test_a_module_prefixed_id_works_in_code_that_never_imports_seeupo_gym():
    import subprocess
    import sys

    code = (
        "import gymnasium as gym; env = gym.make('seeupo_gym:seeupo/TurnBandit-v0'); "
        "obs, info = env.reset(seed=0); print(info['messages'][0]['role'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "system"


def test_no_generated_response_makes_step_raise():
    import random

    pieces = ["A", "b", "(C)", "Option ", "<think>", "</think>", " ", "\n", "\x00", "é中😀", "red door", ".", "**"]
    rng = random.Random(0)
    env = TurnBanditEnv(variant="mixed", num_tasks=8, options=4)
    env.reset(seed=0)
    for _ in range(2_000):
        action = "".join(rng.choice(pieces) for _ in range(rng.randrange(8))) if rng.random() < 0.95 else rng.choice([None, 3, b"A"])
        observation, _, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(observation) and isinstance(info["action_error"], str)
        if terminated or truncated:
            env.reset()


def test_brief_prompt_is_one_sentence_and_the_game_is_unchanged():
    full, brief = TurnBanditEnv(variant="easy", num_tasks=4), TurnBanditEnv(variant="easy", num_tasks=4, brief=True)
    (_, full_info), (obs, info) = full.reset(seed=3), brief.reset(seed=3)
    assert "TurnBandit" in info["messages"][0]["content"] and "<think>" not in obs
    assert len(info["messages"][0]["content"]) < len(full_info["messages"][0]["content"]) / 4
    assert info["messages"][1] == full_info["messages"][1]
    for env in (full, brief):
        env.step("A")
    assert brief.step(act("B"))[1] == full.step("B")[1]


# ------------------------------------------------------------------------------------------
# stopping: the policy chooses the episode's length
# ------------------------------------------------------------------------------------------

STOPPING_ENVS = [
    TurnBanditEnv(variant="stopping", num_tasks=12, seed=0),
    TurnBanditEnv(variant="stopping", num_tasks=6, seed=1, options=4),
    TurnBanditEnv(variant="stopping", num_tasks=6, seed=2, turns=(1, 2)),
    TurnBanditEnv(variant="stopping", num_tasks=6, seed=3, optimum=(0.4, 0.9)),  # J* < 1, rewards rescaled
]


def best_over_deterministic_policies(env: TurnBanditEnv, task_id: str) -> tuple[float, tuple[str, ...]]:
    """The best return of any deterministic policy, played through `env.step`: the env and each
    task are deterministic, so a deterministic policy plays one action sequence, and the best over
    all of them is the best over every action sequence until the env says the episode ended."""
    labels = "ABCDEFGH"[: env.tasks[env.task_index[task_id]].num_options]
    best: tuple[float, tuple[str, ...]] = (-1.0, ())

    def play(prefix: tuple[str, ...]) -> None:
        nonlocal best
        for label in labels:
            env.reset(options={"task_id": task_id})
            for earlier in prefix:
                env.step(act(earlier))
            _, reward, terminated, truncated, _ = env.step(act(label))
            assert not truncated
            if terminated:
                best = max(best, (reward, prefix + (label,)), key=lambda x: x[0])
            else:
                assert reward == 0.0
                play(prefix + (label,))

    play(())
    return best


@pytest.mark.parametrize("env", STOPPING_ENVS, ids=["K3", "K4", "T1-2", "J*<1"])
def test_stopping_backward_induction_equals_the_best_deterministic_policy_through_step(env):
    goes_on = 0
    for task in env.tasks:
        brute, answers = best_over_deterministic_policies(env, task.task_id)
        value, actions = task.optimal()
        assert value == pytest.approx(brute, abs=1e-12), task.task_id
        goes_on += answers[0] != "ABCDEFGH"[task.stops[0]]  # the best play does not stop first
        assert task.ends(actions) and task.reward(actions) == value
        env.reset(options={"task_id": task.task_id})
        for label in task.optimal_answers():  # the optimum is playable and is a success
            _, reward, terminated, _, info = env.step(act(label))
        assert terminated and info["success"] and reward == pytest.approx(value)
    assert 0 < goes_on < len(env.tasks)  # some optima go on, some stop first


def test_stopping_tasks_end_at_a_stop_some_optima_go_on_and_the_first_stop_is_a_decoy():
    tasks = make_tasks("stopping", 30, seed=0)
    assert {t.kind for t in tasks} == {"stopping"} and all(len(t.stops) == t.num_turns for t in tasks)
    for t in tasks:
        for turn, stop in enumerate(t.stops):  # a stop at any turn ends the episode there
            going = tuple(min(set(range(t.num_options)) - {t.stops[u]}) for u in range(turn))
            assert not going or not t.ends(going)
            assert t.ends(going + (stop,)) and (going + (stop,)) in t.rewards
    firsts = [t.optimal()[1] for t in tasks]
    goes_on = [t for t, a in zip(tasks, firsts) if a[0] != t.stops[0]]
    assert goes_on and len(goes_on) < len(tasks)  # some optima do not stop first, some do
    assert any(len(a) < t.num_turns and a[0] != t.stops[0] for t, a in zip(tasks, firsts))  # a later stop
    assert any(len(a) == t.num_turns and a[-1] != t.stops[-1] for t, a in zip(tasks, firsts))  # to the end
    for t in goes_on:  # the first stop is a sure mid-size reward, below J*
        assert 0.5 <= t.reward((t.stops[0],)) < t.optimal_value
    # Under a uniform continuation stopping first looks best on most of the tasks that go on.
    assert sum(t.deceptive for t in goes_on) >= len(goes_on) // 2


def test_stopping_needs_three_options():
    with pytest.raises(ValueError, match="options >= 3"):
        make_tasks("stopping", 2, options=2)


def test_stopping_says_stop_in_the_prompt_and_the_observation():
    env = TurnBanditEnv(variant="stopping", num_tasks=3)
    task = env.tasks[0]
    observation, _ = env.reset(options={"task_id": task.task_id})
    assert "stops the game" in observation and "stop here" in observation
    text, reward, terminated, _, info = env.step(act("ABCDEFGH"[task.stops[0]]))
    assert terminated and "(stop)" in text and reward == task.reward((task.stops[0],))
    assert info["choices"] == "ABCDEFGH"[task.stops[0]] and not info["success"] or reward >= task.optimal_value


@pytest.mark.parametrize("bad", ["", "stop", "Z", "A B", "<think>stop", "\x00C", "C" * 9000, None])
def test_stopping_hostile_answers_are_invalid_turns_never_a_stop_or_a_crash(bad):
    env = TurnBanditEnv(variant="stopping", num_tasks=2, invalid_penalty=0.1)
    task = env.tasks[0]
    env.reset(options={"task_id": task.task_id})
    _, reward, terminated, truncated, info = env.step(bad)
    assert (reward, terminated, truncated) == (0.0, False, False) and info["invalid_action"]
    _, reward, terminated, _, _ = env.step(act("ABCDEFGH"[task.stops[0]]))  # the same decision, asked again
    assert terminated and reward == pytest.approx(max(0.0, task.reward((task.stops[0],)) - 0.1))


def test_the_study_script_runs_the_stopping_variant_grouped_by_where_the_optimum_ends(tmp_path, monkeypatch):
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "turnbandit_study.py"
    monkeypatch.setattr(sys, "argv", [
        str(script), "--variant", "stopping", "--out", str(tmp_path), "--num-tasks", "3", "--seeds", "1",
        "--iterations", "2", "--rollouts", "8", "--batches", "expected",
        "--only", "seeupo reverse/batch", "grpo seq-mean-token-mean"])
    runpy.run_path(str(script), run_name="__main__")
    table = (tmp_path / "results.md").read_text()
    for group in ("stop first: final J/J*", "stop later: final J/J*", "to the end: final J/J*"):
        assert group in table
    assert "| seeupo reverse/batch |" in table and "| grpo seq-mean-token-mean |" in table and "Load average" in table
    curves = json.loads((tmp_path / "results.json").read_text())["curves"]["seeupo reverse/batch"][0]
    assert len(curves) == 3 and all(0 < j <= 1 + 1e-9 for row in curves for j in row)
    assert curves[-1] != curves[0]  # it learned
