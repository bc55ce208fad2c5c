"""Red team: model-written argument names, tool names and values in BFCL's tools format (and the
react format's equivalents), through every door a tool call enters by: the env (hermes and json
parsers, react), a held-back miss_func function, VectorAgent, the TRL and SkyRL adapters and
seeupo-serve with two sessions.

Before scores were computed by our own replay, an argument name such as `x=(<code>),y` was
written into the call strings bfcl-eval's checker `eval`s: the code ran in the scoring process
and could patch the checker (1.0 for every later episode). Each test asserts: the unsolved task
scores 0.0, no code ran (a sentinel file, bfcl-eval's checker functions), and later clean episodes
in the same process score 1.0 (ground truth) and 0.0 (unsolved)."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import pytest
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end
from seeupo_gym.bfcl.env import render_tool_action
from seeupo_gym.tools import render_tool_calls

TASK = "multi_turn_base_0"
CHECKERS = (multi_turn_checker.state_checker, multi_turn_checker.response_checker)
SURROGATE = "\ud800"


def attack_names(sentinel: Path) -> dict[str, str]:
    """Argument names that are code, or that no Python identifier of a schema could be."""
    write = f"open({str(sentinel)!r}, 'w').close()"
    accept = "lambda *a: {'valid': True}"
    patch = (f"[setattr(__import__('bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker', fromlist=['_']), n, {accept}) "
             "for n in ('state_checker', 'response_checker')]")
    return {
        "code": f"x=({write}),y",
        "checker patch": f"x=({patch}),y",
        "closing parenthesis": f"folder='a') or ({write}",
        "keyword smuggling": f"folder='a', **{{'x': {write}}}, y",
        "dotted": "os.path",
        "call": "folder()",
        "single quote": "fol'der",
        "double quote": 'fol"der',
        "accented": "fólder",
        "fullwidth, NFKC folder": "ｆｏｌｄｅｒ",
        "dunder": "__class__",
        "double star": "**kwargs",
        "empty": "",
        "newline": "folder\n",
        "space": "fol der",
        "lone surrogate": f"fol{SURROGATE}der",
        "python keyword": "lambda",
        "long": "a" * 5_000,
    }


def attack_calls(sentinel: Path) -> dict[str, tuple[str, dict]]:
    """Whole tool calls: hostile names in the argument names, the tool name and nested values."""
    calls = {f"argument name: {kind}": ("cd", {name: "document"}) for kind, name in attack_names(sentinel).items()}
    write = f"open({str(sentinel)!r}, 'w').close()"
    calls.update({
        "tool name with code": (f"pwd(); {write}", {}),
        "tool name through an instance": ("GorillaFileSystem_instance.pwd", {}),
        "tool name builtin": ("open", {"file": str(sentinel), "mode": "w"}),
        "value with code": ("cd", {"folder": f"x') or {write} or ('"}),
        "nested value with code": ("mkdir", {"dir_name": [{f"k') or {write} or ('": [write]}]}),
        "kwargs smuggled in a value": ("cd", {"folder": {"**": {"x": write}}}),
    })
    return calls


def assert_nothing_ran(sentinel: Path) -> None:
    assert not sentinel.exists()
    assert (multi_turn_checker.state_checker, multi_turn_checker.response_checker) == CHECKERS


def end_every_turn(env) -> float:
    while True:
        _, reward, terminated, truncated, _ = env.step(render_turn_end("Done."))
        if terminated or truncated:
            return reward


def ground_truth_actions(task_id: str, render) -> list[str]:
    actions = []
    for calls in get_entry(task_id).ground_truth:
        if calls:
            actions.append(render(list(calls)))
        actions.append(render_turn_end("Done."))
    return actions


def assert_clean_episodes_score_right(env, render) -> None:
    """After the attacks, in the same process: the ground truth scores 1.0 and doing nothing 0.0."""
    env.reset(options={"task_id": TASK})
    for action in ground_truth_actions(TASK, render):
        _, reward, *_ = env.step(action)
    assert reward == 1.0
    env.reset(options={"task_id": TASK})
    assert end_every_turn(env) == 0.0


# ------------------------------------------------------------------------------------------ env

@pytest.mark.parametrize("parser", ["hermes", "json"])
def test_hostile_tool_calls_through_the_env_run_no_code_and_score_zero(parser, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentinel = tmp_path / "SENTINEL"
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000, action_format="tools",
                   tool_parser=parser)
    refused = {}
    for kind, (name, arguments) in attack_calls(sentinel).items():
        env.reset(options={"task_id": TASK})
        observation, _, _, _, info = env.step(render_tool_calls([(name, arguments)]))
        refused[kind] = info["action_kind"] == "error"
        observation.encode("utf-8")
        json.dumps(info, ensure_ascii=False).encode("utf-8")  # no lone surrogate left the env
        assert end_every_turn(env) == 0.0, kind
        assert_nothing_ran(sentinel)
    # Every hostile argument or tool name is refused before anything runs; values are only values.
    assert [kind for kind, was in refused.items() if not was] == [
        "value with code", "nested value with code", "kwargs smuggled in a value"]
    assert_clean_episodes_score_right(env, render_tool_action)


def test_a_bare_json_call_object_with_a_hostile_name_is_refused_by_the_json_parser(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", action_format="tools", tool_parser="json")
    env.reset(options={"task_id": TASK})
    payload = json.dumps({"name": "cd", "arguments": {attack_names(sentinel)["code"]: "document"}})
    *_, info = env.step(payload)
    assert info["action_kind"] == "error" and "unknown argument" in info["action_error"]
    assert end_every_turn(env) == 0.0
    assert_nothing_ran(sentinel)


REACT_ATTACKS = {
    "keyword smuggling": "[cd(**{{'x=({write}),y': 'document'}})]",
    "name not a parameter": "[cd(x='document')]",
    "fullwidth name": "[cd(ｆｏｌｄｅｒ='nowhere')]",  # NFKC makes it `folder`: a real parameter
    "code as a value": "[cd(folder=\"x') or {write} or ('\")]",
    "code in a nested value": "[mkdir(dir_name=[{{'k': \"{write}\"}}])]",
}


@pytest.mark.parametrize("kind", list(REACT_ATTACKS))
def test_the_react_formats_equivalents_run_no_code_and_score_zero(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentinel = tmp_path / "SENTINEL"
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000)
    env.reset(options={"task_id": TASK})
    env.step("<think>x</think>\n" + REACT_ATTACKS[kind].format(write=f"open({str(sentinel)!r}, 'w').close()"))
    assert end_every_turn(env) == 0.0
    assert_nothing_ran(sentinel)
    assert_clean_episodes_score_right(env, render_action)


@pytest.mark.parametrize("action_format", ["react", "tools"])
def test_a_held_back_miss_func_function_called_early_with_a_hostile_name_runs_nothing(action_format, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    entry = next(get_entry(f"multi_turn_miss_func_{i}") for i in range(200)
                 if "GorillaFileSystem" in get_entry(f"multi_turn_miss_func_{i}").involved_classes)
    (held_back,) = [name for names in entry.revealed_functions.values() for name in names][:1]
    env = gym.make("seeupo/BFCL-v4-v0", categories=["miss_func"], split="all", max_turns=1_000, action_format=action_format)
    env.reset(options={"task_id": entry.id})
    name = attack_names(sentinel)["code"]
    action = (render_tool_calls([(held_back, {name: 1})]) if action_format == "tools"
              else f"[{held_back}(**{{{name!r}: 1}})]")
    *_, info = env.step(action)
    assert info["action_kind"] == "error"
    assert end_every_turn(env) == 0.0
    assert_nothing_ran(sentinel)
    render = render_tool_action if action_format == "tools" else render_action
    env.reset(options={"task_id": entry.id})
    for action in ground_truth_actions(entry.id, render):
        _, reward, *_ = env.step(action)
    assert reward == 1.0


def test_lone_surrogates_in_tool_calls_never_leave_the_env():
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=100, action_format="tools")
    env.reset(options={"task_id": TASK})
    escaped = '"a\\ud800"'  # a JSON escape: json.loads makes it a lone surrogate
    for action in [f'<tool_call>{{"name": "mkdir", "arguments": {{"dir_name": {escaped}}}}}</tool_call>',
                   f'<tool_call>{{"name": {escaped}, "arguments": {{}}}}</tool_call>',
                   f'<tool_call>{{"name": "mkdir", "arguments": {{{escaped}: 1}}}}</tool_call>',
                   f"text {SURROGATE} " + render_tool_calls([("ls", {})]), f"plain {SURROGATE} reply"]:
        observation, *_, info = env.step(action)
        observation.encode("utf-8")
        json.dumps(info, ensure_ascii=False).encode("utf-8")
    assert info["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"dir_name": "a\\ud800"}  # escaped


# --------------------------------------------------------------------------------- VectorAgent

class ScriptedBackend:
    """Replaces the model: the k-th generate call answers script[k] (canonical tokens + <|im_end|>)."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        from seeupo_gym.agents.vector import encode

        self.encode, self.tokenizer, self.script, self.calls = encode, tokenizer, script, 0
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.default_stop_token_ids = (self.im_end,)

    def generate(self, prompts, sampling):
        from seeupo_gym.agents.backends import Completion

        ids = self.encode(self.tokenizer, self.script[min(self.calls, len(self.script) - 1)]) + [self.im_end]
        self.calls += 1
        return [Completion(list(ids), [0.0] * len(ids), "stop") for _ in prompts]

    def update_weights(self, state_dict_or_model) -> None:
        pass


def test_hostile_tool_calls_through_vector_agent_with_a_scripted_backend_instead_of_a_model(tiny, one_torch_thread, tmp_path):
    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.vector import VectorAgent

    _, tokenizer = tiny
    sentinel = tmp_path / "SENTINEL"
    names = attack_names(sentinel)
    attack = render_tool_calls([("cd", {names["code"]: "document"}), ("ls", {names["checker patch"]: 1})])
    turns = get_entry(TASK).num_user_turns
    scripts = {
        "attack": [attack] + ["Done."] * turns,
        "ground truth": ground_truth_actions(TASK, render_tool_action),
        "nothing": ["Done."] * turns,
    }
    rewards = {}
    for name, script in scripts.items():
        with VectorAgent("seeupo/BFCL-v4-base-v0", ScriptedBackend(tokenizer, script), tokenizer, num_envs=1,
                         sampling=SamplingParams(max_new_tokens=4_096), max_context_tokens=65_536,
                         env_kwargs={"max_turns": 20, "action_format": "tools"}) as agent:
            (trajectory,) = agent.collect([TASK], group_size=1, seed=0)
        rewards[name] = trajectory.reward
    assert rewards == {"attack": 0.0, "ground truth": 1.0, "nothing": 0.0}
    assert_nothing_ran(sentinel)


# ------------------------------------------------------------------------------------ adapters

def test_hostile_argument_names_through_the_trl_adapter_run_nothing(tmp_path):
    pytest.importorskip("datasets")
    from seeupo_gym.bfcl.calls import parse_call_list
    from seeupo_gym.bfcl.data import function_docs
    from seeupo_gym.integrations.trl import make

    sentinel = tmp_path / "SENTINEL"
    made = make("seeupo/BFCL-v4-v0", task_ids=[TASK])
    factories, dataset = made["environment_factory"], made["train_dataset"]
    row = {key: value for key, value in dataset[0].items() if key != "environment"}
    instance = factories[dataset[0]["environment"]]()
    instance.reset(**row)
    results = [instance.cd(**{name: "document"}) for name in attack_names(sentinel).values()]
    assert all(result.startswith("Error:") and "unknown argument" in result for result in results)
    assert instance._final_reward() == 0.0
    assert_nothing_ran(sentinel)
    docs = {doc.name: doc for class_docs in function_docs().values() for doc in class_docs}
    instance.reset(**row)
    for calls in get_entry(TASK).ground_truth:
        for call in parse_call_list("[" + ", ".join(calls) + "]") if calls else ():
            arguments = dict(zip(docs[call.name].parameters.get("properties", {}), call.args))
            getattr(instance, call.name)(**{**arguments, **dict(call.kwargs)})
        instance.end_turn("Done.")
    assert instance._final_reward() == 1.0


def test_trl_end_turn_only_ends_the_turn_and_runs_no_tool_call_in_its_reply():
    pytest.importorskip("datasets")
    from seeupo_gym.integrations.trl import make

    made = make("seeupo/BFCL-v4-v0", task_ids=[TASK])
    factories, dataset = made["environment_factory"], made["train_dataset"]
    row = {key: value for key, value in dataset[0].items() if key != "environment"}
    instance = factories[dataset[0]["environment"]]()
    instance.reset(**row)
    entry = get_entry(TASK)
    # The first turn's ground truth, smuggled into end_turn's reply: it must not run.
    reply = render_tool_action(list(entry.ground_truth[0]))
    second_message = instance.end_turn(reply)
    assert second_message.startswith(entry.user_messages[1][:40])
    info = instance._env.unwrapped._info()
    assert info["user_turn"] == 1 and instance._env.unwrapped._calls_per_turn[0] == []
    assert instance.steps[-1] == "Done."  # what the env was sent instead
    instance.reset(**row)
    assert instance.end_turn("All done, thanks.") and instance.steps == ["All done, thanks."]


def test_hostile_argument_names_through_the_skyrl_adapter_run_nothing(tmp_path):
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from seeupo_gym.integrations.skyrl import register

    register()
    sentinel = tmp_path / "SENTINEL"
    names = attack_names(sentinel)

    def play(actions: list[str]) -> float:
        env = skyrl_gym.make("seeupo/BFCL-v4-v0", env_config={"max_turns": 50, "action_format": "tools", "split": "all"},
                             extras={"task_id": TASK})
        env.init([])
        for action in actions:
            output = env.step(action)
            if output["done"]:
                return output["reward"]
        raise AssertionError("the episode did not end")

    turns = get_entry(TASK).num_user_turns
    attack = render_tool_calls([("cd", {names["code"]: "document"}), ("ls", {names["checker patch"]: 1})])
    assert play([attack] + ["Done."] * turns) == 0.0
    assert_nothing_ran(sentinel)
    assert play(ground_truth_actions(TASK, render_tool_action)) == 1.0
    assert play(["Done."] * turns) == 0.0


# --------------------------------------------------------------------------------- seeupo-serve

def test_hostile_argument_names_sent_to_seeupo_serve_run_nothing_there_and_a_second_session_scores_right(tmp_path):
    pytest.importorskip("openenv.core")
    from serve_helpers import serving

    sentinel = tmp_path / "SENTINEL"
    names = attack_names(sentinel)
    kwargs = {"max_turns": 50, "action_format": "tools"}
    with serving("seeupo/BFCL-v4-v0", "max_turns=50", "action_format=tools") as served:
        attacker = gym.make("seeupo/Remote-v0", url=served.url, env_id="seeupo/BFCL-v4-v0", env_kwargs=kwargs)
        bystander = gym.make("seeupo/Remote-v0", url=served.url, env_id="seeupo/BFCL-v4-v0", env_kwargs=kwargs)
        try:
            bystander.reset(options={"task_id": TASK})
            truth = ground_truth_actions(TASK, render_tool_action)
            bystander.step(truth[0])  # mid-episode while the attacks arrive
            attacker.reset(options={"task_id": TASK})
            for name in names.values():
                *_, info = attacker.step(render_tool_calls([("cd", {name: "document"})]))
                assert info["action_kind"] == "error"
            assert end_every_turn(attacker) == 0.0
            for action in truth[1:]:
                _, bystander_reward, *_ = bystander.step(action)
            assert bystander_reward == 1.0
            attacker.reset(options={"task_id": TASK})  # later episodes on the server
            assert end_every_turn(attacker) == 0.0
            attacker.reset(options={"task_id": TASK})
            for action in truth:
                _, reward, *_ = attacker.step(action)
            assert reward == 1.0
        finally:
            attacker.close()
            bystander.close()
        assert served.process.poll() is None
    assert not sentinel.exists()


def test_exported_calls_with_hostile_positional_values_are_literal_keyword_calls(tmp_path):
    # The export names positional arguments (`EpisodeBackend.named`) in strings bfcl-eval's checker
    # `eval`s: whatever a value holds, each exported call must be name(param=literal, ...).
    import ast

    from seeupo_gym.bfcl.data import function_docs

    write = f"open({str(tmp_path / 'SENTINEL')!r}, 'w').close()"
    hostile = [f"') or {write} or ('", f'") or {write} or ("', "\\')\n" + write, "a" * 2_000]
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000)
    env.reset(options={"task_id": TASK})
    env.step(render_action([f"mkdir({value!r})" for value in hostile] + [f"cd({hostile[0]!r})"]))
    env.step(render_turn_end())
    exported = env.unwrapped.calls_per_turn[0]
    params = {doc.name: set(doc.parameters["properties"]) for name in get_entry(TASK).involved_classes
              for doc in function_docs()[name]}
    assert [call for step in exported for call in step][:1] == [f"mkdir(dir_name={hostile[0]!r})"]
    for call in (call for step in exported for call in step):
        node = ast.parse(call, mode="eval").body
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args, call
        assert {k.arg for k in node.keywords} <= params[node.func.id], call
        for keyword in node.keywords:
            ast.literal_eval(keyword.value)
    assert not (tmp_path / "SENTINEL").exists()
