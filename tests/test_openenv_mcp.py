"""`seeupo-serve` as an MCP tool environment, driven by openenv's own `MCPToolClient`, its typed
client (`openenv_client.SeeupoEnv`), openenv's harness API (`MCPHarnessAdapter` over our
`SeeupoToolSessionFactory`) and TRL's AsyncGRPO OpenEnv harness; the life of HTTP-made sessions;
AutoEnv discovery and `openenv validate` of the env packages under envs/ (AppWorld's tool is in
test_openenv_mcp_appworld.py). Servers run in this process (`serving_in_process`)."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("openenv.core.mcp_client")
from openenv.core.mcp_client import MCPToolClient  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.bfcl import get_entry  # noqa: E402
from seeupo_gym.bfcl.calls import parse_call_list  # noqa: E402
from seeupo_gym.bfcl.data import function_docs  # noqa: E402
from seeupo_gym.integrations.openenv_server import create_app  # noqa: E402
from serve_helpers import repo_root, serving, serving_in_process  # noqa: E402

TASK = "multi_turn_base_0"
BFCL_KWARGS = {"action_format": "tools", "max_turns": 30, "split": "all"}
FAMILIES = ("seeupo_bfcl", "seeupo_appworld", "seeupo_turnbandit")


def ground_truth_calls(task_id: str) -> list[list[tuple[str, dict]]]:
    """Per user turn, the ground truth's calls as (tool name, named arguments)."""
    docs = {doc.name: doc for class_docs in function_docs().values() for doc in class_docs}
    turns = []
    for calls in get_entry(task_id).ground_truth:
        named = []
        for call in parse_call_list("[" + ", ".join(calls) + "]") if calls else ():
            arguments = dict(zip(docs[call.name].parameters.get("properties", {}), call.args))
            named.append((call.name, {**arguments, **dict(call.kwargs)}))
        turns.append(named)
    return turns


def play_tools(env, task_id: str, turns=None) -> list[dict]:
    """Each call of each user turn, then `end_turn`; the tool results in order."""
    results = []
    for calls in ground_truth_calls(task_id) if turns is None else turns:
        for name, arguments in calls:
            results.append(env.call_tool(name, **arguments))
        results.append(env.call_tool("end_turn", reply="Done."))
    return results


@pytest.fixture(scope="module")
def bfcl_url():
    with serving_in_process(create_app("seeupo/BFCL-v4-v0", BFCL_KWARGS, max_sessions=4, attach_timeout_s=2.0)) as url:
        yield url


def test_mcp_tool_client_lists_bfcl_tools_and_a_ground_truth_episode_of_tool_calls_scores_one(bfcl_url):
    entry = get_entry(TASK)
    with MCPToolClient(base_url=bfcl_url).sync() as env:
        env.reset(task_id=TASK)
        tools = {tool.name: tool for tool in env.list_tools()}
        functions = {doc.name for class_name in entry.involved_classes for doc in function_docs()[class_name]}
        assert set(tools) == functions | {"end_turn"}
        assert tools["cd"].input_schema["properties"]["folder"]["type"] == "string"
        assert tools["end_turn"].input_schema["required"] == ["reply"]
        results = play_tools(env, TASK)
        state = env.state()
    calls = sum(len(turn) for turn in ground_truth_calls(TASK))
    assert len(results) == calls + entry.num_user_turns
    assert [r["reward"] for r in results] == [0.0] * (len(results) - 1) + [1.0]
    assert [r["done"] for r in results].index(True) == len(results) - 1
    assert results[0]["observation"] == '{"current_working_directory": "document"}'  # cd's own result
    assert results[-1]["observation"] == "The conversation is over." and state.step_count == len(results)


def test_an_unsolved_episode_of_tool_calls_scores_zero_and_later_calls_are_refused(bfcl_url):
    with MCPToolClient(base_url=bfcl_url).sync() as env:
        env.reset(task_id=TASK)
        results = play_tools(env, TASK, turns=[[]] * get_entry(TASK).num_user_turns)
        assert results[-1]["done"] and results[-1]["reward"] == 0.0
        with pytest.raises(RuntimeError, match="no episode is running"):
            env.call_tool("ls")


def test_the_typed_client_plays_the_websocket_session_and_a_wrong_action_shape_names_response(bfcl_url):
    from seeupo_gym.integrations.openenv_client import ResponseAction, SeeupoEnv, TextObservation

    with SeeupoEnv(base_url=bfcl_url).sync() as env:
        first = env.reset(seed=0, task_id=TASK)
        assert isinstance(first.observation, TextObservation) and first.observation.info["task_id"] == TASK
        step = env.step(ResponseAction(response="<tool_call>\n{\"name\": \"pwd\", \"arguments\": {}}\n</tool_call>"))
        assert step.observation.info["calls"] == ["pwd()"] and step.reward == 0.0 and not step.done
        state = env.state()
        assert state.turn == 1 and state.task_id == TASK and state.done is False and len(state.episode_id) == 32
    with connect(bfcl_url.replace("http", "ws") + "/ws") as ws:
        ws.send('{"type": "reset", "data": {"task_id": "%s"}}' % TASK)
        ws.recv()
        ws.send('{"type": "step", "data": {"action": "ls()"}}')
        error = ws.recv()
    assert "the field `response` is missing" in error and "Invalid message" not in error
    answer = httpx.post(f"{bfcl_url}/step", json={"action": {"text": "hi"}}, timeout=30)
    assert answer.status_code == 422 and "`response` is missing" in answer.text


def test_an_http_made_session_lives_only_as_long_as_its_websocket(bfcl_url):
    def mcp(method: str, **params) -> dict:
        return httpx.post(f"{bfcl_url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                          timeout=30).json()

    def live_envs() -> int:
        return httpx.get(f"{bfcl_url}/seeupo/env", timeout=30).json()["live_envs"]

    orphan = mcp("openenv/session/create")["result"]["session_id"]
    assert "no WebSocket attached" in mcp("tools/list", session_id=orphan)["error"]["message"]
    time.sleep(3.0)  # past attach_timeout_s=2 (and a watch): closed
    with pytest.raises(InvalidStatus, match="403"):  # too late to attach: refused at the handshake
        connect(bfcl_url.replace("http", "ws") + f"/ws?session_id={orphan}")

    client = MCPToolClient(base_url=bfcl_url).sync()
    client.reset(task_id=TASK)
    session_id = client._async._production_session_id
    assert client.list_tools() and live_envs() == 1
    client.disconnect()  # the WebSocket leaves; the client never sends openenv/session/close
    deadline = time.monotonic() + 5
    while live_envs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_envs() == 0 and "error" in mcp("tools/list", session_id=session_id)
    with pytest.raises(InvalidStatus, match="403"):  # a WebSocket attaches only to HTTP-made sessions
        connect(bfcl_url.replace("http", "ws") + "/ws?session_id=not-an-http-session")


def test_mcp_tool_client_against_a_react_format_seeupo_serve_is_told_to_serve_with_action_format_tools():
    """The seeupo-serve CLI with BFCL in its default (ReAct) format: openenv's MCPToolClient gets an
    error naming the fix at reset and at every tool call, not openenv's "Environment does not
    support MCP"; a WebSocket client still plays the format the server serves."""
    from openenv.core import GenericEnvClient

    fix = "serve it with action_format=tools (seeupo-serve seeupo/BFCL-v4-v0 action_format=tools)"
    with serving("seeupo/BFCL-v4-v0", "max_turns=30", "split=all") as served:
        with MCPToolClient(base_url=served.url).sync() as env:
            with pytest.raises(RuntimeError, match=r"served in the 'react' action format, which has no MCP tools") as reset:
                env.reset(task_id=TASK)
            assert fix in str(reset.value)
            assert env.list_tools() == []  # openenv's client turns any tools/list error into []
            with pytest.raises(RuntimeError, match=r"^Tool 'cd' failed: seeupo/BFCL-v4-v0 is served in the 'react'") as call:
                env.call_tool("cd", folder="document")
            assert fix in str(call.value) and "does not support MCP" not in str(call.value)
        for method in ("tools/list", "tools/call"):  # raw JSON-RPC, no session
            answer = httpx.post(f"{served.url}/mcp", json={"jsonrpc": "2.0", "id": 3, "method": method,
                                                           "params": {"name": "cd", "arguments": {}}}, timeout=30).json()
            assert answer["id"] == 3 and fix in answer["error"]["message"], answer
        with pytest.raises(InvalidStatus) as refused:  # openenv's MCP WebSocket: refused before a session is made
            connect(served.url.replace("http", "ws") + "/mcp", open_timeout=30)
        assert refused.value.response.status_code == 409 and fix in refused.value.response.body.decode()
        with GenericEnvClient(base_url=served.url).sync() as plain:  # the control: the ReAct format plays
            assert plain.reset(task_id=TASK).observation["info"]["task_id"] == TASK
            step = plain.step({"response": "<think>go</think>\n[cd(folder='document')]"})
            assert "current_working_directory" in step.observation["text"] and not step.done


def test_openenv_harness_adapter_drives_a_served_bfcl_episode_to_the_envs_reward(bfcl_url):
    from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter, ModelStepResult
    from openenv.core.llm_client import LLMResponse, ToolCall

    from seeupo_gym.integrations.openenv_client import SeeupoToolSessionFactory

    script = [[ToolCall(id=f"c{i}", name=name, args=args) for i, (name, args) in enumerate(calls)]
              + [ToolCall(id="end", name="end_turn", args={"reply": "Done."})] for calls in ground_truth_calls(TASK)]

    def model_step(messages, tools, sampling):  # a scripted model instead of a sampled one
        return ModelStepResult(response=LLMResponse(content="", tool_calls=script.pop(0)))

    session = SeeupoToolSessionFactory(bfcl_url).create({"task_id": TASK}, seed=0, episode_id="rollout-1")
    try:
        assert session.initial_messages()[0]["role"] == "system"
        assert "end_turn" in {tool.name for tool in session.list_tools()}
        rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits(max_turns=10))
        verify = session.verify(rollout.messages)
    finally:
        session.close()
    assert rollout.done and script == [] and verify.env_reward == 1.0
    assert rollout.tool_trace[-1].result.metadata["reward"] == 1.0


def test_trl_async_grpo_openenv_harness_runs_one_served_bfcl_episode_to_the_envs_reward(bfcl_url):
    """TRL's harness rollout loop (`_HarnessRolloutLoop._run_session`) with our session factory; the
    model's turns come from a script (a stand-in for its vLLM sampling), the reward from the env."""
    pytest.importorskip("trl.experimental.async_grpo.openenv_harness")
    from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter, ModelStepResult
    from openenv.core.llm_client import LLMResponse, ToolCall
    from trl.experimental.async_grpo.openenv_harness import _HarnessRolloutLoop

    from seeupo_gym.integrations.openenv_client import SeeupoToolSessionFactory

    script = [[ToolCall(id=f"c{i}", name=name, args=args) for i, (name, args) in enumerate(calls)]
              + [ToolCall(id="end", name="end_turn", args={"reply": "Done."})] for calls in ground_truth_calls(TASK)]
    loop = _HarnessRolloutLoop.__new__(_HarnessRolloutLoop)  # no vLLM server: the parts _run_session uses
    loop._factory = SeeupoToolSessionFactory(bfcl_url)
    loop._adapter = MCPHarnessAdapter()
    loop._limits = HarnessRunLimits(max_turns=10)
    loop._rollout_reward_fn = None
    loop._live_sessions = set()
    loop._fork_threshold_tokens = 0
    import threading

    loop._stop_event = threading.Event()

    def sample_turn(turns, turn_times, messages, tools, sampling):
        from trl.experimental.async_grpo.async_rollout_worker import TurnRecord

        turns.append(TurnRecord([1, 2], [3], [-0.5]))
        turn_times.append((time.monotonic(), time.monotonic(), []))
        return ModelStepResult(response=LLMResponse(content="", tool_calls=script.pop(0)), prompt_ids=[1, 2],
                               completion_ids=[3], logprobs=[-0.5])

    loop._sample_turn = sample_turn
    (completion, completion_ids, sequences, calls, failures, reward), metrics = loop._run_session({"task_id": TASK})
    assert reward == 1.0 and failures == 0 and script == []
    assert calls == sum(len(turn) for turn in ground_truth_calls(TASK)) + get_entry(TASK).num_user_turns
    assert metrics["tool_calls_by_name"]["end_turn"] == get_entry(TASK).num_user_turns


# ------------------------------------------------------------------------------ packages under envs/

def openenv_cli(*args: str):
    """openenv's own command line (`openenv ...`), run in this process (its imports are slow)."""
    from openenv.cli.__main__ import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_env_package_passes_openenv_validate(family):
    done = openenv_cli("validate", str(repo_root() / "envs" / family), "--level", "static", "--skip-build")
    assert done.exit_code == 0 and "PASS  static.manifest" in done.output and "Verdict: PASS" in done.output, done.output


def test_a_running_seeupo_serve_passes_openenv_validate_url(bfcl_url):
    import json

    done = openenv_cli("validate", "--url", bfcl_url, "--json")
    report = json.loads(done.output)
    assert done.exit_code == 0 and report["passed"] and report["summary"]["failed_criteria"] == [], done.output


def test_autoenv_resolves_the_served_env_by_name(bfcl_url, tmp_path, monkeypatch):
    from importlib.metadata import PackageNotFoundError, version

    from openenv import AutoEnv
    from openenv.auto._discovery import reset_discovery

    try:
        version("openenv-seeupo_bfcl")
    except PackageNotFoundError:
        pytest.fail("the env packages are not installed: `make venv` (pip install --no-deps -e envs/seeupo_bfcl ...)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no discovery cache from elsewhere
    reset_discovery()
    from openenv.auto._discovery import get_discovery

    from seeupo_gym.integrations.openenv_client import SeeupoEnv

    assert set(FAMILIES) <= {f"{key}" for key in get_discovery().discover(use_cache=False)}
    env = AutoEnv.from_env("seeupo-bfcl", base_url=bfcl_url)
    assert isinstance(env, SeeupoEnv)
    with env.sync() as client:
        assert client.reset(task_id=TASK).observation.info["task_id"] == TASK
