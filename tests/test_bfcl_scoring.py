"""BFCL scoring without `eval`: our replay of parsed calls with bfcl-eval's own comparisons gives
the official multi_turn_checker's verdicts, never evaluates a string, shares nothing between
episodes (module dicts, argument lists) and leaves process-global state as it found it."""

from __future__ import annotations

import builtins
import copy
import decimal

import gymnasium as gym
import pytest
from bfcl_reference import official_verdicts, reference_process, variants

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import CATEGORIES, get_entry, load_category, render_action, render_turn_end
from seeupo_gym.bfcl.backend import check_episode
from seeupo_gym.bfcl.calls import parse_call_list
from seeupo_gym.bfcl.env import render_tool_action
from seeupo_gym.tools import render_tool_calls

# 90 and 147 post a tweet and then `mention` it, which extends the list the post stored: the
# entries where argument lists shared between a call and the backend change the verdict.
SAMPLE = [f"multi_turn_{category}_{index}" for category in CATEGORIES for index in (0, 90, 147)]


def our_verdict(task_id: str, steps: list[list[list[str]]]) -> tuple[bool, str, int]:
    entry = get_entry(task_id)
    calls = [[parse_call_list("[" + ", ".join(step) + "]") if step else () for step in turn] for turn in steps]
    result = check_episode(entry, calls)
    failed = result.turn_results.index("failed") if "failed" in result.turn_results else -1
    return result.valid, result.error_type or "", failed


def cases_for(task_ids: list[str]) -> list[tuple[str, str, list]]:
    return [(task_id, name, steps) for task_id in task_ids for name, steps in variants(get_entry(task_id).ground_truth).items()]


def assert_same_verdicts_as_the_official_checker(cases) -> None:
    ours = [our_verdict(task_id, steps) for task_id, _, steps in cases]
    with reference_process() as pool:
        official = pool.submit(official_verdicts, [(task_id, steps) for task_id, _, steps in cases]).result()
    differences = [(task_id, name, mine, theirs) for (task_id, name, _), mine, theirs in zip(cases, ours, official) if mine != theirs]
    assert differences == []
    assert all(valid for (_, name, _), (valid, _, _) in zip(cases, ours) if name == "ground truth")
    assert sum(not valid for valid, _, _ in ours) >= len(cases) // 4  # wrong answers are among them


def test_verdicts_equal_the_official_checkers_on_sampled_replays_and_wrong_answers():
    cases = cases_for(SAMPLE)
    assert len(cases) == 84
    assert_same_verdicts_as_the_official_checker(cases)


@pytest.mark.slow
def test_verdicts_equal_the_official_checkers_on_all_800_replays_and_their_wrong_answers():
    cases = cases_for([entry.id for category in CATEGORIES for entry in load_category(category)])
    assert len(cases) == 5588  # 800 ground-truth replays, 4788 rearranged or wrong answers
    assert_same_verdicts_as_the_official_checker(cases)


class EvalSpy:
    """Records every call of builtins.eval and builtins.exec (then runs it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __enter__(self) -> EvalSpy:
        self.eval, self.exec = builtins.eval, builtins.exec
        builtins.eval = lambda *args, **kwargs: self._record("eval", self.eval, args, kwargs)
        builtins.exec = lambda *args, **kwargs: self._record("exec", self.exec, args, kwargs)
        return self

    def _record(self, name, real, args, kwargs):
        self.calls.append((name, args[0] if args else None))
        return real(*args, **kwargs)

    def __exit__(self, *exc) -> None:
        builtins.eval, builtins.exec = self.eval, self.exec


HOSTILE_TOOL_CALLS = [
    ("pwd", {"x=(open('EVAL_CANARY','w').close()),y": 1}),
    ("cd", {"folder": "__import__('os').system('touch EVAL_CANARY')"}),
    ("cd", {"folder') or open('EVAL_CANARY','w') or ('": "x"}),
    ("mkdir", {"dir_name": ["EVAL_CANARY", {"k": "(lambda: 1)()"}]}),
    ("echo", {"content": "ls()", "file_name": "ls()"}),
]


def replay_with_hostile_calls(task_ids: list[str], tmp_path, monkeypatch) -> list[float]:
    monkeypatch.chdir(tmp_path)
    rewards = []
    for action_format in ("react", "tools"):
        env = gym.make("seeupo/BFCL-v4-v0", categories=list(CATEGORIES), split="all", max_turns=1_000,
                       action_format=action_format)
        render = render_tool_action if action_format == "tools" else render_action
        for task_id in task_ids:
            env.reset(options={"task_id": task_id})
            for turn, calls in enumerate(get_entry(task_id).ground_truth):
                if turn == 0 and action_format == "tools":
                    for name, arguments in HOSTILE_TOOL_CALLS:
                        env.step(render_tool_calls([(name, arguments)]))
                if calls:
                    env.step(render(list(calls)))
                _, reward, *_ = env.step(render_turn_end("Done."))
            rewards.append(reward)
    return rewards


def test_no_eval_or_exec_runs_while_ground_truth_and_hostile_calls_are_stepped_and_scored(tmp_path, monkeypatch):
    with EvalSpy() as spy:
        rewards = replay_with_hostile_calls(SAMPLE, tmp_path, monkeypatch)
    assert spy.calls == []
    assert not (tmp_path / "EVAL_CANARY").exists()
    # React replays score 1.0; the tools replays' hostile calls that ran (an echo) changed the state.
    assert len(rewards) == 2 * len(SAMPLE) and rewards[: len(SAMPLE)] == [1.0] * len(SAMPLE)


@pytest.mark.slow
def test_no_eval_or_exec_runs_during_all_800_ground_truth_replays(tmp_path, monkeypatch):
    task_ids = [entry.id for category in CATEGORIES for entry in load_category(category)]
    with EvalSpy() as spy:
        rewards = replay_with_hostile_calls(task_ids, tmp_path, monkeypatch)
    assert spy.calls == []
    assert rewards[: len(task_ids)] == [1.0] * len(task_ids)


def test_the_spy_sees_the_official_executors_eval():
    """The instrument works: bfcl-eval's own executor is caught evaluating a call string."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    entry = get_entry("multi_turn_base_0")
    with EvalSpy() as spy:
        multi_turn_utils.execute_multi_turn_func_call(["pwd()"], dict(entry.initial_config), list(entry.involved_classes),
                                                      "spy_check", entry.id)
    for key in [key for key in vars(multi_turn_utils) if key.startswith("spy_check")]:
        del vars(multi_turn_utils)[key]
    assert [name for name, _ in spy.calls] == ["eval"] and "pwd()" in str(spy.calls[0][1])


def test_a_list_argument_the_backend_keeps_is_not_shared_with_the_replayed_call():
    """`post_tweet(mentions=[...])` stores the list and `mention` extends it: each run gets fresh
    values, so the one-call-per-step replay (the calls scored again) still passes, every time."""
    for _ in range(2):  # the parsed ground truth is cached: a second scoring must see it unchanged
        steps = variants(get_entry("multi_turn_base_90").ground_truth)["one call per step"]
        assert our_verdict("multi_turn_base_90", steps) == (True, "", -1)


def long_context_task(class_name: str) -> str:
    return next(entry.id for entry in load_category("long_context") if class_name in entry.involved_classes)


def test_long_context_episodes_leave_bfcl_eval_module_dicts_unchanged():
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context, vehicle_control

    cards_before = copy.deepcopy(long_context.CREDIT_CARD_EXTENSION)
    weather_before = copy.deepcopy(vehicle_control.LONG_WEATHER_EXTENSION)
    card_id = next(iter(long_context.CREDIT_CARD_EXTENSION))
    env = gym.make("seeupo/BFCL-v4-v0", categories=["long_context"], split="all", max_turns=100)
    env.reset(options={"task_id": long_context_task("TravelAPI")})
    # A booking takes its cost from the card's balance: here a long-context card, a dict of bfcl-eval's module.
    observation, *_ = env.step(render_action([
        "set_budget_limit(access_token='abc123token', budget_limit=1.0)",
        f"book_flight(access_token='abc123token', card_id='{card_id}', travel_date='2026-10-06', travel_from='RMS', "
        "travel_to='SBK', travel_class='economy')"]))
    assert "'booking_status': True" in observation or '"booking_status": true' in observation, observation
    env.reset(options={"task_id": long_context_task("VehicleControlAPI")})
    observation, *_ = env.step(render_action(["get_outside_temperature_from_google()"]))
    assert "outsideTemperature" in observation
    assert long_context.CREDIT_CARD_EXTENSION == cards_before
    assert vehicle_control.LONG_WEATHER_EXTENSION == weather_before


def test_long_context_travel_instances_hold_no_bfcl_eval_module_objects():
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

    from seeupo_gym.bfcl.backend import EpisodeBackend

    backend = EpisodeBackend(get_entry(long_context_task("TravelAPI")))
    travel = backend.instances["TravelAPI"]
    shared = {id(card) for card in long_context.CREDIT_CARD_EXTENSION.values()}
    shared |= {id(booking) for booking in long_context.BOOKING_RECORD_EXTENSION.values()}
    held = {id(value) for value in list(travel.credit_card_list.values()) + list(travel.booking_record.values())}
    assert len(travel.credit_card_list) > 10 and not shared & held


def math_task() -> str:
    return next(t for t in (f"multi_turn_base_{i}" for i in range(200)) if "MathAPI" in get_entry(t).involved_classes)


@pytest.mark.parametrize("action_format", ["react", "tools"])
def test_an_episode_asking_for_100000_digits_leaves_mpmath_and_decimal_precision_as_they_were(action_format):
    import mpmath

    before = (mpmath.mp.dps, decimal.getcontext().prec)
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=100, action_format=action_format)
    render = render_tool_action if action_format == "tools" else render_action
    env.reset(options={"task_id": math_task()})
    refused = []
    for call in ["logarithm(value=7, base=10, precision=100000)", "logarithm(value=7, base=10, precision='100000')",
                 "square_root(number=2, precision=' 200_000 ')", "logarithm(value=7, base=10, precision='nan')",
                 "round_number(number=2.5, decimal_places='1e9')", "power(base=3, exponent='100000')"]:
        *_, info = env.step(render([call]))
        refused.append(info["action_kind"] == "error" and "at most" in info["action_error"])
    observation, *_, info = env.step(render(["logarithm(value=7, base=10, precision=500)", "square_root(number=2, precision=900)"]))
    assert refused == [True] * 6
    assert info["action_kind"] == "calls" and "0.845098040014256830712216258592636193483572396323965406503" in observation
    while not env.step(render_turn_end("Done."))[2]:
        pass
    assert (mpmath.mp.dps, decimal.getcontext().prec) == before
