"""No response makes seeupo/BFCL-v4-v0's `step` raise, and `info` keeps one type per key.

Responses come from a seeded generator: well-typed calls to the entry's real functions with
arguments at and beyond the bounds (huge and hex integers, long strings, deep lists), mixed
with token soup (brackets, think tags, fences, control characters, non-ASCII).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401
from seeupo_gym.bfcl import get_entry, render_action
from seeupo_gym.bfcl.calls import MAX_INT_DIGITS
from seeupo_gym.bfcl.data import function_docs

# One entry per backend class (base_0: GorillaFileSystem + TwitterAPI, base_15: + MathAPI, ...).
TASKS = ["multi_turn_base_0", "multi_turn_base_2", "multi_turn_base_14", "multi_turn_base_15",
         "multi_turn_base_50", "multi_turn_base_100", "multi_turn_base_150"]
SOUP = ["[", "]", "(", ")", ",", "=", "'", '"', "<think>", "</think>", "```", "\n", " ", "\x00", "\ufffd",
        "é", "中", "😀", "\\", "**", "lambda", "__import__", "os.system", "0x", "9" * 50, "1e999", "..."]


def integer(rng: random.Random) -> str:
    digits = rng.choice([1, 6, MAX_INT_DIGITS, MAX_INT_DIGITS + 1, 400, 4299, 4301])
    if rng.random() < 0.3:
        return "0x" + "".join(rng.choice("0123456789abcdef") for _ in range(digits))
    return rng.choice(["", "-"]) + "9" * digits


def literal(rng: random.Random, kind: str, depth: int = 0) -> str:
    if kind in ("integer", "int"):
        return integer(rng)
    if kind in ("float", "number"):
        return rng.choice(["0.5", "-1e308", "1e308", "5e-324", "3.0", integer(rng)])
    if kind == "boolean":
        return rng.choice(["True", "False", "None"])
    if kind == "array" and depth < 3:
        return "[" + ", ".join(literal(rng, rng.choice(["integer", "float", "string"]), depth + 1) for _ in range(rng.randrange(50))) + "]"
    if kind == "dict" and depth < 3:
        return "{" + ", ".join(f"'k{i}': {literal(rng, 'string', depth + 1)}" for i in range(rng.randrange(5))) + "}"
    return repr(rng.choice(["", "x", "a/b", "../..", "é中😀", "\\n", "x" * rng.choice([10, 2_000, 9_000])]))


def well_typed_call(rng: random.Random, docs: list) -> str:
    doc = rng.choice(docs)
    args = [
        f"{name}={literal(rng, schema.get('type', 'string'))}"
        for name, schema in doc.parameters.get("properties", {}).items()
        if rng.random() < 0.9
    ]
    return f"{doc.name}({', '.join(args)})"


def response(rng: random.Random, docs: list) -> object:
    roll = rng.random()
    if roll < 0.55:
        calls = ", ".join(well_typed_call(rng, docs) for _ in range(rng.randrange(1, 8)))
        return f"<think>try</think>\n[{calls}]"
    if roll < 0.85:
        return "".join(rng.choice(SOUP) for _ in range(rng.randrange(60)))
    if roll < 0.95:
        return rng.choice(["Done.", "<think>ok</think> All finished.", "[]"])
    return rng.choice([None, 42, b"[ls()]", ["ls()"]])


def test_no_generated_response_makes_step_raise_and_info_types_never_change():
    rng = random.Random(0)
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=12)
    types: dict[str, set[type]] = defaultdict(set)
    kinds: set[str] = set()
    episodes = steps = 0
    for task_id in TASKS * 8:
        entry = get_entry(task_id)
        docs = [doc for class_name in entry.involved_classes for doc in function_docs()[class_name]]
        _, info = env.reset(options={"task_id": task_id})
        infos = [info]
        done = False
        while not done:
            observation, reward, terminated, truncated, info = env.step(response(rng, docs))
            assert env.observation_space.contains(observation)
            assert reward in (0.0, 1.0)
            infos.append(info)
            kinds.add(info["action_kind"])
            done = terminated or truncated
            steps += 1
        episodes += 1
        for info in infos:
            for key, value in info.items():
                types[key].add(type(value))
    assert {key: kinds_of for key, kinds_of in types.items() if len(kinds_of) > 1} == {}
    assert kinds == {"calls", "turn_end", "error"} and episodes == 56


def test_the_adversarial_math_responses_end_within_the_deadline():
    """Seven `power` calls at the bounds (20-digit base, exponent 1000) in one response: 12 s per
    step and 24 s in the checker before the bounds; now they run, and well within the deadline."""
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=20, call_seconds_per_step=2.0)
    entry = get_entry("multi_turn_base_15")
    env.reset(options={"task_id": entry.id})
    action = render_action([f"power(base={'9' * MAX_INT_DIGITS}, exponent=1000)"] * 7)
    start = time.monotonic()
    *_, info = env.step(action)
    assert info["action_kind"] == "calls" and len(info["calls"]) == 7
    for _ in range(entry.num_user_turns):
        *_, terminated, _, info = env.step("<think>x</think> Done.")
    assert terminated
    assert time.monotonic() - start < 2.0 + 10.0  # the deadline, with a generous margin for slow CI


def test_calls_that_would_start_after_the_deadline_do_not_run_and_the_model_is_told():
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", call_seconds_per_step=0.0)
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, *_, info = env.step(render_action(["pwd()", "ls()"]))
    assert info["calls"] == [] and observation.count("not run") == 2
    assert info["action_kind"] == "calls" and "2 of 2 calls did not run" in info["action_error"]


@pytest.mark.parametrize("literal_text", ["0x" + "f" * 4000, "9" * (MAX_INT_DIGITS + 1), "-" + "9" * 4299])
def test_integers_over_the_digit_bound_are_an_error_observation(literal_text):
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all")
    env.reset(options={"task_id": "multi_turn_base_15"})
    observation, reward, terminated, truncated, info = env.step(f"<think>x</think>\n[add(a={literal_text}, b=1)]")
    assert info["action_kind"] == "error" and observation.startswith("Error:")
    assert (reward, terminated, truncated, info["calls"]) == (0.0, False, False, [])
