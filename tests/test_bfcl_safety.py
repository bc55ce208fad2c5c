"""Bad and hostile responses to seeupo/BFCL-v4-v0: never a crash, never executed."""

from __future__ import annotations

import gymnasium as gym
import pytest

import seeupo_gym  # noqa: F401
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end
from seeupo_gym.bfcl.calls import ActionError, Call, decode_response, looks_like_calls, parse_call_list

CANARY = "CANARY"


def hostile_actions(canary: str) -> dict[str, object]:
    touch = f"__import__('os').system('touch {canary}')"
    return {
        "empty": "",
        "whitespace": "  \n\t ",
        "think only": "<think>nothing to do</think>",
        "unclosed think": "<think>I will call [ls()] now",
        "one megabyte": "[ls(a=True)]" + "x" * 1_000_000,
        "invalid utf-8 replaced": b"\xff\xfe[ls(a=True)]\x80\x81".decode("utf-8", errors="replace"),
        "nul bytes": "[ls(a=True)]\x00\x01",
        "unbalanced": "<think>x</think>\n[cd(folder='document')",
        "unbalanced quotes": "[cd(folder='document)]",
        "unknown function": "[rm_everything(path='/')]",
        "builtin function": "[open('/etc/passwd')]",
        "eval": f"[eval(\"{touch}\")]",
        "exec": f"[exec(\"{touch}\")]",
        "import bare": touch,
        "import in list": f"[{touch}]",
        "import as argument": f"[cd(folder={touch})]",
        "import in nested literal": f"[cd(folder=[1, {{'k': {touch}}}])]",
        "dunder call": "[__import__('os')]",
        "private method": "[_load_scenario({}, False)]",
        "dunder attribute": "[cd.__globals__()]",
        "attribute call": "[os.system('touch CANARY')]",
        "class method path": "[GorillaFileSystem.ls(a=True)]",
        "getattr": "[getattr(cd, '__globals__')]",
        "lambda argument": "[cd(folder=(lambda: 'x')())]",
        "method on literal": "[cd(folder=''.join(['a']))]",
        "subscript": "[cd(folder={'a': 'b'}['a'])]",
        "arithmetic": "[cd(folder=2**100)]",
        "name argument": "[cd(folder=document)]",
        "starred": "[cd(*['document'])]",
        "double starred": "[cd(**{'folder': 'document'})]",
        "dunder keyword": "[cd(__class__='x')]",
        "comprehension": "[cd(folder=x) for x in ['a']]",
        "walrus": "[cd(folder=(x := 'a'))]",
        "deep nesting": "[cd(folder=" + "[" * 5000 + "]" * 5000 + ")]",
        "huge int": "[cd(folder=" + "9" * 5000 + ")]",
        "huge hex int": "[cd(folder=0x" + "f" * 4000 + ")]",
        "21-digit int": "[cd(folder=" + "9" * 21 + ")]",
        "infinite float": "[cd(folder=1e999)]",
        "bytes literal": "[cd(folder=b'x')]",
        "too many calls": "[" + ", ".join(["pwd()"] * 100) + "]",
        "repeated keyword": "[cd(folder='a', folder='b')]",
        "not a string": None,
    }


@pytest.fixture
def env():
    return gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000)


@pytest.mark.parametrize("name", list(hostile_actions(CANARY)))
def test_bad_action_is_an_error_observation_that_runs_nothing(env, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    canary = tmp_path / CANARY
    action = hostile_actions(str(canary))[name]
    env.reset(options={"task_id": "multi_turn_base_0"})
    observation, reward, terminated, truncated, info = env.step(action)
    assert info["action_kind"] == "error", info
    assert observation.startswith("Error:") and info["action_error"]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert (info["turn"], info["user_turn"], info["calls"]) == (1, 0, [])
    assert env.observation_space.contains(observation)
    assert info["messages"][-2]["role"] == "assistant" and len(info["messages"][-2]["content"]) < 40_000
    assert not canary.exists() and not (tmp_path / CANARY).exists()


def test_resource_bounds_refuse_runaway_math_before_it_runs():
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all")
    task_id = next(t for t in (f"multi_turn_base_{i}" for i in range(200)) if "MathAPI" in get_entry(t).involved_classes)
    env.reset(options={"task_id": task_id})
    for call in ["power(base=9, exponent=1000000000)", "square_root(number=2, precision=10000000)",
                 "logarithm(value=2, base=10, precision=10000000)"]:
        *_, info = env.step(render_action([call]))
        assert info["action_kind"] == "error" and "at most" in info["action_error"]
    *_, info = env.step(render_action(["power(base=2, exponent=10)"]))
    assert info["action_kind"] == "calls"


def test_hostile_responses_between_ground_truth_calls_change_nothing(tmp_path, monkeypatch):
    """Every hostile response in the middle of a ground-truth replay: still scores 1.0."""
    monkeypatch.chdir(tmp_path)
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000)
    entry = get_entry("multi_turn_base_0")
    env.reset(options={"task_id": entry.id})
    hostile = list(hostile_actions(str(tmp_path / CANARY)).values())
    errors = 0
    for calls in entry.ground_truth:
        for action in hostile:
            *_, info = env.step(action)
            errors += info["action_kind"] == "error"
        env.step(render_action(list(calls)))
        _, reward, terminated, _, info = env.step(render_turn_end("Done."))
    assert errors == len(hostile) * len(entry.ground_truth)
    assert terminated and reward == 1.0
    assert not (tmp_path / CANARY).exists()


def test_call_lists_that_look_like_calls_but_are_text_end_nothing():
    assert looks_like_calls("[ls(a=True)]") and looks_like_calls("ls()") and looks_like_calls("[ ]")
    assert looks_like_calls("```python\n[ls()]\n```") and looks_like_calls("os.system('x')")
    assert not looks_like_calls("Done (nothing to do).")
    assert not looks_like_calls("[Note] the file is gone")
    assert not looks_like_calls("The answer is 42.")


def test_parse_keeps_literal_values_and_rebuilds_the_same_call():
    (call,) = parse_call_list("[edit_ticket(7, updates={'priority': -3, 'tags': ['a', (1, 2.5)], 'x': None})]")
    assert call == Call("edit_ticket", (7,), (("updates", {"priority": -3, "tags": ["a", (1, 2.5)], "x": None}),))
    assert parse_call_list(f"[{call.source}]") == (call,)
    assert Call("echo", (), (("content", "it's \"quoted\"\n"),)).source == "echo(content='it\\'s \"quoted\"\\n')"


def test_parse_errors_say_what_was_wrong():
    with pytest.raises(ActionError, match="bare name"):
        parse_call_list("[cd(folder=document)]")
    with pytest.raises(ActionError, match="literal"):
        parse_call_list("[cd(folder=len('x'))]")
    with pytest.raises(ActionError, match="syntax"):
        parse_call_list("[cd(folder='x'")


def test_render_action_and_render_turn_end_round_trip_through_decode():
    response = render_action(["cd(folder='document')", "mv(source='a', destination='b')"], thought="move it")
    decoded = decode_response(response)
    assert decoded.kind == "calls" and decoded.thought == "move it"
    assert [call.source for call in decoded.calls] == ["cd(folder='document')", "mv(source='a', destination='b')"]
    assert decode_response(render_turn_end("All done.")).kind == "turn_end"
    with pytest.raises(ValueError):
        render_turn_end("[ls()]")
    with pytest.raises(ValueError):
        render_action([])
    with pytest.raises(ActionError):
        render_action(["ls(a=__import__('os'))"])


def test_math_calls_leave_the_process_precision_alone():
    import decimal

    import mpmath

    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all")
    task_id = next(t for t in (f"multi_turn_base_{i}" for i in range(200)) if "MathAPI" in get_entry(t).involved_classes)
    env.reset(options={"task_id": task_id})
    before = (decimal.getcontext().prec, mpmath.mp.dps)
    observation, *_ = env.step(render_action(["square_root(number=2, precision=50)", "logarithm(value=8, base=2, precision=40)"]))
    assert "1.4142135623730950488016887242096980785696718753769" in observation
    assert (decimal.getcontext().prec, mpmath.mp.dps) == before


# One level of the doubling attack: `cp` shares the copied folder's entries, so `a` ends up
# holding two references to the previous level's tree (6 calls; 2^30 entries at 30 levels).
DOUBLING_LEVEL = ["mkdir(dir_name='t')", "cp(source='a', destination='t')", "mv(source='a', destination='b')",
                  "cp(source='b', destination='t')", "mv(source='t', destination='a')", "rm(file_name='b')"]
TRAINER_GROWTH_BOUND = 256 * 2**20  # what the attack may add to this (the trainer's) process
FILE_SYSTEM_ENTRIES = 20_000  # entries a file system may gain (seeupo_gym.bfcl.backend.FILE_SYSTEM_BOUNDS)


def entries_seen_by_a_walk(root) -> int:
    """Files and folders a walk of the tree visits (a shared folder once per place), counted
    without walking: each distinct folder is summed once."""
    counted: dict[int, int] = {}

    def count(node) -> int:
        if id(node) not in counted:
            contents = getattr(node, "contents", None)
            counted[id(node)] = 1 + (sum(count(child) for child in contents.values()) if isinstance(contents, dict) else 0)
        return counted[id(node)]

    return count(root)


def test_the_doubling_cp_attack_at_30_levels_stays_within_the_step_checker_and_memory_bounds():
    import resource
    import time

    seconds = 2.0
    env = gym.make("seeupo/BFCL-v4-base-v0", max_turns=40, call_seconds_per_step=seconds)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        env.reset(options={"task_id": "multi_turn_base_0"})
        file_system = env.unwrapped._backend.instances["GorillaFileSystem"]
        start_entries = entries_seen_by_a_walk(file_system.root)
        steps, refused = [], 0
        setup = ["mkdir(dir_name='w')", "cd(folder='w')", "mkdir(dir_name='a')", "cd(folder='a')",
                 "echo(content='x', file_name='f')", "cd(folder='..')"]
        for calls in (setup, *[DOUBLING_LEVEL] * 30, ["du(human_readable=False)", "find(path='.')"]):
            start = time.monotonic()
            observation, reward, terminated, truncated, info = env.step(render_action(calls))
            steps.append(time.monotonic() - start)
            refused += "it was undone" in info["action_error"]
            assert entries_seen_by_a_walk(file_system.root) <= start_entries + FILE_SYSTEM_ENTRIES
        assert refused > 0  # the bound did stop the doubling
        assert max(steps) < seconds + 1.0, steps
        # The checker replays only the calls that ran: within its budget too.
        start = time.monotonic()
        while not (terminated or truncated):
            observation, reward, terminated, truncated, info = env.step(render_turn_end())
        assert time.monotonic() - start < 30.0
    finally:
        env.close()
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert growth < TRAINER_GROWTH_BOUND, f"the trainer's process grew by {growth / 2**20:.0f} MiB"


def test_a_folder_copied_into_itself_is_undone_not_a_cycle():
    env = gym.make("seeupo/BFCL-v4-base-v0", max_turns=5)
    try:
        env.reset(options={"task_id": "multi_turn_base_0"})
        _, _, _, _, info = env.step(render_action(["mkdir(dir_name='loop')", "cp(source='loop', destination='loop')",
                                                   "du(human_readable=False)"]))
        assert "contain itself" in info["action_error"] and info["calls"] == ["mkdir(dir_name='loop')"]
    finally:
        env.close()
