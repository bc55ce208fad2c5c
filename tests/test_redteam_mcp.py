"""Red team: seeupo-serve's MCP door (`tools/call` over HTTP with an attached WebSocket, as
openenv's `MCPToolClient` sends it), attacked as the envs are: code in argument names, values and
tool names, bombs (huge and deeply nested arguments), unknown tools, calls with no episode or after
it ended, a hostile session beside a clean one. Each asserts that nothing ran (a sentinel file,
bfcl-eval's checker functions unpatched), that the attacked episode scores 0.0, and that a clean
session on the same server still scores 1.0."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("openenv.core.mcp_client")
from openenv.core.mcp_client import MCPToolClient  # noqa: E402

from seeupo_gym.bfcl import get_entry  # noqa: E402
from seeupo_gym.integrations.openenv_server import create_app  # noqa: E402
from serve_helpers import serving_in_process  # noqa: E402
from test_openenv_mcp import ground_truth_calls, play_tools  # noqa: E402
from test_redteam_bfcl_tools import TASK, assert_nothing_ran, attack_calls  # noqa: E402

KWARGS = {"action_format": "tools", "max_turns": 200, "split": "all"}


@pytest.fixture(scope="module")
def url():
    with serving_in_process(create_app("seeupo/BFCL-v4-v0", KWARGS, max_sessions=4, max_request_bytes=1 << 20)) as url:
        yield url


def call(env, name: str, arguments: dict):
    """A tool call's result, or the server's refusal as the string "refused: ..."."""
    try:
        return env.call_tool(name, **arguments)
    except RuntimeError as error:
        return f"refused: {error}"
    except UnicodeEncodeError:  # httpx will not send a lone surrogate; its JSON escape, as another client would
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": name, "arguments": arguments, "session_id": env._async._production_session_id}}
        answer = httpx.post(env._async._production_mcp_url(), content=json.dumps(request).encode(),
                            headers={"content-type": "application/json"}, timeout=60).json()
        return answer["result"]["data"] if "result" in answer else f"refused: {answer['error']['message']}"


def test_hostile_tool_calls_over_mcp_run_no_code_and_a_clean_session_beside_them_scores_one(url, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    truth = ground_truth_calls(TASK)
    with MCPToolClient(base_url=url).sync() as attacker, MCPToolClient(base_url=url).sync() as bystander:
        bystander.reset(task_id=TASK)
        for name, arguments in truth[0]:  # mid-episode while the attacks arrive
            bystander.call_tool(name, **arguments)
        attacker.reset(task_id=TASK)
        outcomes = {kind: call(attacker, name, arguments) for kind, (name, arguments) in attack_calls(sentinel).items()}
        for kind, outcome in outcomes.items():
            ran = isinstance(outcome, dict) and not outcome["action_error"]
            # a hostile value of a known argument runs as data (cd to a folder that does not exist)
            assert not ran or kind.startswith(("value with code", "nested value", "kwargs smuggled")), (kind, outcome)
        assert_nothing_ran(sentinel)
        ended = [attacker.call_tool("end_turn", reply="Done.") for _ in range(get_entry(TASK).num_user_turns)]
        assert ended[-1]["done"] and ended[-1]["reward"] == 0.0
        rest = play_tools(bystander, TASK, turns=[[]] + truth[1:])  # first turn's calls already made
        assert rest[-1]["reward"] == 1.0
        attacker.reset(task_id=TASK)  # a later episode in the hostile session
        assert play_tools(attacker, TASK)[-1]["reward"] == 1.0
    assert_nothing_ran(sentinel)


def test_end_turn_with_tool_call_markup_in_its_reply_only_ends_the_turn(url):
    entry = get_entry(TASK)
    smuggled = json.dumps({"name": "cd", "arguments": {"folder": "document"}})
    with MCPToolClient(base_url=url).sync() as env:
        env.reset(task_id=TASK)
        result = env.call_tool("end_turn", reply=f"<tool_call>\n{smuggled}\n</tool_call>")
        assert result["observation"].startswith(entry.user_messages[1][:40]) and result["action_error"] == ""
        assert env.state().step_count == 1


def test_bombs_unknown_tools_and_calls_outside_an_episode_are_refused_and_the_server_goes_on(url):
    with MCPToolClient(base_url=url, message_timeout_s=60).sync() as env:
        assert call(env, "ls", {}) == "refused: Tool 'ls' failed: Unknown tool: 'ls'"  # no reset yet: no tools
        env.reset(task_id=TASK)
        deep: object = "x"
        for _ in range(5_000):
            deep = [deep]
        start = time.monotonic()
        outcomes = {
            "deep nesting": call(env, "cd", {"folder": deep}),
            "huge string": call(env, "cd", {"folder": "a" * 200_000}),
            "huge integer": call(env, "cd", {"folder": 10 ** 4000}),
            "many arguments": call(env, "cd", {f"a{i}": i for i in range(20_000)}),
            "unknown tool": call(env, "open", {"file": "/etc/passwd"}),
            "reserved name": call(env, "reset", {}),
        }
        assert time.monotonic() - start < 60
        for kind, outcome in outcomes.items():  # refused by a bound, or an error observation: nothing ran
            assert isinstance(outcome, str) or outcome["action_error"], (kind, outcome)
        assert "Unknown tool" in outcomes["unknown tool"] and "Unknown tool" in outcomes["reserved name"]
        # The env's own bounds spoke for those that reached it; the episode goes on.
        assert play_tools(env, TASK)[-1]["reward"] == 1.0
        assert "no episode is running" in call(env, "ls", {})  # after done
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_session_id_from_another_client_cannot_be_addressed_once_its_websocket_left(url):
    victim = MCPToolClient(base_url=url).sync()
    victim.reset(task_id=TASK)
    stolen = victim._async._production_session_id
    victim.disconnect()
    time.sleep(1.2)
    request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "ls", "arguments": {}, "session_id": stolen}}
    answer = httpx.post(f"{url}/mcp", json=request, timeout=30).json()
    assert "error" in answer and "result" not in answer
