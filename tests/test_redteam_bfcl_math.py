"""Red team: BFCL's MathAPI (the only bfcl-eval backend that uses mpmath or decimal) with
model-chosen arguments, beyond the bounds already there (`power`'s exponent, the precisions,
`round_number`'s places).

What won: mpmath reads a string as a number, and builds a string's 10**exponent by repeated
squaring, so `logarithm(value='1e<4,250 nines>', ...)` held one step for 32 s (deadline 5 s) at
any precision, and the checker replayed it. Now a string mpmath reads for `logarithm` may have
exponents of at most MAX_INT_DIGITS digits, as integers may: a longer one is an error observation
before anything runs, in every spelling mpmath accepts. What held (each call a result or an
error text in well under a second): every other MathAPI function at its extremes, listed below.
Also here: MessageAPI's `send_message`, which never returns once every message id is given.
"""

from __future__ import annotations

import contextlib
import decimal
import signal
import time

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end
from seeupo_gym.bfcl.backend import MESSAGE_IDS_GIVEN_LIMIT, EpisodeBackend
from seeupo_gym.bfcl.calls import MAX_INT_DIGITS, parse_call_list
from seeupo_gym.bfcl.env import render_tool_action

TASK = "multi_turn_base_15"  # GorillaFileSystem + MathAPI; its ground truth calls logarithm
STEP_DEADLINE_S = 5.0  # the env's call_seconds_per_step default
LONG = "9" * 4_250  # 32 s in mpmath before the bound (under int()'s 4,300-digit limit)

EXPONENT_BOMBS = {
    "value": f"logarithm(value='1e{LONG}', base=10, precision=2)",
    "negative exponent in base": f"logarithm(value=20, base='1e-{LONG}', precision=2)",
    "complex string": f"logarithm(value='1+1e{LONG}j', base=10, precision=2)",
    "spaces and underscores": f"logarithm(value=' 1 e 9_{LONG} ', base=10, precision=2)",
    "fullwidth digits": f"logarithm(value='1e{chr(0xFF19) * 1_200}', base=10, precision=2)",
    "capital E": f"logarithm(value='1E{LONG}', base=10, precision=2)",
    "one digit over": f"logarithm(value='1e{'9' * (MAX_INT_DIGITS + 1)}', base=10, precision=2)",
}

# The other MathAPI functions at their extremes: each ends as a result or BFCL's error text.
HELD = [
    f"logarithm(value='1e-{'9' * MAX_INT_DIGITS}', base='2', precision=1000)",  # at the bound: runs
    f"logarithm(value='1e{'0' * 4_000}9', base=10, precision=1000)",  # leading zeros: a small exponent
    f"logarithm(value='{'9' * 4_000}/7', base='7/{'9' * 4_000}', precision=1000)",
    f"logarithm(value='0.{'0' * 4_000}1', base=10, precision=1000)",
    "logarithm(value=2, base=10, precision=-5)",
    "square_root(number=5e-324, precision=1000)",
    f"square_root(number={'9' * MAX_INT_DIGITS}, precision=1000)",
    f"square_root(number='1e{LONG}', precision=1000)",  # a string never reaches Decimal
    f"power(base={'9' * MAX_INT_DIGITS}, exponent=1000)",
    "power(base=-1.5, exponent=0.5)",
    "power(base=0, exponent=-1)",
    f"round_number(number={'9' * MAX_INT_DIGITS}, decimal_places=-1000)",
    "round_number(number=1e308, decimal_places=1000)",
    "standard_deviation(numbers=[1e308, -1e308])",
    f"mean(numbers=[{', '.join(['9' * MAX_INT_DIGITS] * 300)}])",
    "sum_values(numbers=[[1], [2]])",
    f"multiply(a={'9' * MAX_INT_DIGITS}, b=-{'9' * MAX_INT_DIGITS})",
    "si_unit_conversion(value=1e308, unit_in='km', unit_out='nm')",
]


def make(action_format: str = "react"):
    return gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=100, action_format=action_format)


def ground_truth_to_the_end(env, render) -> tuple[float, dict]:
    reward, info = 0.0, {}
    for calls in get_entry(TASK).ground_truth:
        if calls:
            env.step(render(list(calls)))
        _, reward, terminated, _, info = env.step(render_turn_end("Done."))
    assert terminated
    return reward, info


@pytest.mark.parametrize("action_format", ["react", "tools"])
def test_mpmath_exponent_bombs_are_error_observations_within_the_step_deadline_and_the_episode_still_scores_one(
        action_format):
    import mpmath

    render = render_tool_action if action_format == "tools" else render_action
    env = make(action_format)
    env.reset(options={"task_id": TASK})
    before = (mpmath.mp.dps, decimal.getcontext().prec)
    for name, call in EXPONENT_BOMBS.items():
        start = time.monotonic()
        observation, reward, terminated, truncated, info = env.step(render([call]))
        seconds = time.monotonic() - start
        assert info["action_kind"] == "error" and "exponent of more than 20 digits" in info["action_error"], name
        assert observation.startswith("Error:") and info["calls"] == [] and not (terminated or truncated), name
        assert seconds < 1.0, (name, seconds)  # 32 s before the bound
    assert (mpmath.mp.dps, decimal.getcontext().prec) == before
    reward, info = ground_truth_to_the_end(env, render)  # the refused calls never ran, nor are replayed
    assert reward == 1.0 and info["success"]


def test_the_same_exponent_without_the_bound_takes_seconds_in_bfcls_logarithm_control():
    """Control, replacing the env's check with a direct backend call: what the bound keeps out.
    1,500 digits (not the 4,250 above) to keep this quick."""
    backend = EpisodeBackend(get_entry(TASK))
    (bomb,) = parse_call_list(f"[logarithm(value='1e{'9' * 1_500}', base=10, precision=2)]")
    (small,) = parse_call_list(f"[logarithm(value='1e{'9' * MAX_INT_DIGITS}', base=10, precision=2)]")
    start = time.monotonic()
    assert "result" in backend.run(small)
    small_s = time.monotonic() - start
    start = time.monotonic()
    assert "result" in backend.run(bomb)
    bomb_s = time.monotonic() - start
    assert bomb_s > 0.3 and bomb_s > 50 * small_s, (bomb_s, small_s)


def test_every_other_math_function_at_its_extremes_returns_within_the_deadline_and_keeps_the_precision():
    import mpmath

    env = make()
    env.reset(options={"task_id": TASK})
    before = (mpmath.mp.dps, decimal.getcontext().prec)
    start = time.monotonic()
    observation, *_, info = env.step("<think>x</think>\n[" + ", ".join(HELD) + "]")
    seconds = time.monotonic() - start
    assert info["action_kind"] == "calls" and len(info["calls"]) == len(HELD), info["action_error"]
    assert info["action_error"] == "" and seconds < STEP_DEADLINE_S, seconds
    results = observation.split("\n[")[1:]
    assert len(results) == len(HELD)
    assert "'result': mpf(" in results[0]  # at the bound, it runs
    outcomes = [r.split(" -> ", 1)[1] for r in results]
    assert all(o.startswith(("{'result'", '{"result"', '{"error"', "Error during execution")) for o in outcomes), outcomes
    assert (mpmath.mp.dps, decimal.getcontext().prec) == before


def test_an_exponent_bomb_sent_as_an_mcp_tool_call_to_seeupo_serve_is_refused_and_the_session_goes_on():
    pytest.importorskip("openenv.core.mcp_client")
    from openenv.core.mcp_client import MCPToolClient

    from seeupo_gym.integrations.openenv_server import create_app
    from serve_helpers import serving_in_process

    app = create_app("seeupo/BFCL-v4-v0", {"action_format": "tools", "max_turns": 30, "split": "all"}, max_sessions=2)
    with serving_in_process(app) as url, MCPToolClient(base_url=url).sync() as env:
        env.reset(task_id=TASK)
        start = time.monotonic()
        refused = env.call_tool("logarithm", value=f"1e{LONG}", base=10, precision=2)
        assert time.monotonic() - start < 2.0
        assert refused["observation"].startswith("Error: logarithm: value has an exponent of more than 20 digits")
        assert refused["action_error"] and (refused["done"], refused["turn"]) == (False, 1)
        ran = env.call_tool("logarithm", value=20, base=10, precision=2)
        assert not ran["action_error"] and "{'result': mpf('1.3" in ran["observation"]


@contextlib.contextmanager
def alarm_after(seconds: int):
    """A TimeoutError in this (the main) thread after `seconds`: a hang fails the test instead."""
    def ring(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("given", [MESSAGE_IDS_GIVEN_LIMIT, 90_000])
def test_send_message_with_the_message_ids_given_planted_instead_of_89000_calls_is_an_error_not_a_hang(given):
    """MessageAPI draws ids from 10000..99999 until one is free: at 90,000 given, bfcl-eval's
    `send_message` never returns. The ids are planted in the episode's backend (89,000 calls would
    take minutes); one below the limit, the message is sent (the control)."""
    env = make()
    env.reset(options={"task_id": "multi_turn_base_14"})  # GorillaFileSystem + MessageAPI
    env.step(render_action(["message_login(user_id='USR001')"]))
    messages = env.unwrapped._backend.instances["MessageAPI"]
    messages.generated_ids = set(range(10_000, 10_000 + MESSAGE_IDS_GIVEN_LIMIT - 1))
    observation, *_, info = env.step(render_action(["send_message(receiver_id='USR002', message='hi')"]))
    assert "'sent_status': True" in observation or '"sent_status": true' in observation, observation
    messages.generated_ids = set(range(10_000, 10_000 + given))
    start = time.monotonic()
    with alarm_after(20):
        observation, *_, info = env.step(render_action(["send_message(receiver_id='USR002', message='hi')"]))
    assert time.monotonic() - start < 1.0
    assert f"Error during execution: {MESSAGE_IDS_GIVEN_LIMIT} message ids are given" in observation
    assert info["action_kind"] == "calls" and len(messages.generated_ids) == given
