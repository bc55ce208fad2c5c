"""`seeupo-eval --protocol paper` against a chat server: it runs the env's tools format (the way the
server answers), says so in one line, and scores the server's tool calls; in the ReAct format a chat
server's tool calls are counted and warned about, never dropped silently. The installed command
runs in a subprocess against the scripted server of tests/openai_server.py (real HTTP)."""

from __future__ import annotations

import json

from cli_helpers import run
from test_openai_backend import _bfcl_script, _start


def _paper_eval(tmp_path, url, *extra):
    out = tmp_path / "result.json"
    done = run("seeupo-eval", "--base-url", url + "/v1", "--model", "scripted", "--protocol", "paper", "--max-tasks",
               "2", "--concurrency", "2", "--out", str(out), "--no-progress", *extra)
    return done, (json.loads(out.read_text()) if out.is_file() else None)


def test_the_papers_protocol_on_a_chat_server_scores_its_tool_calls_and_says_which_format_it_runs(tmp_path):
    script = dict([_bfcl_script("multi_turn_base_100", True)])  # base_101 gets no calls: fails
    process, url = _start(tmp_path, script)
    try:
        done, result = _paper_eval(tmp_path, url)
        react, react_result = _paper_eval(tmp_path, url, "--env-kwargs", json.dumps({"action_format": "react"}))
    finally:
        process.kill()
        process.wait()
    assert done.returncode == 0, done.stderr
    assert "--protocol paper on a chat server: the env's tools format" in done.stderr
    assert result["env_kwargs"]["action_format"] == "tools" and result["dropped_tool_calls"] == 0
    assert "| scripted | 50.0 | 50.0 |" in done.stdout  # base_100's calls, scored

    # Asked for ReAct: the same replies score 0, and the dropped calls are counted and named.
    assert react.returncode == 0, react.stderr
    assert react_result["dropped_tool_calls"] > 0 and "| scripted | 0.0 | 0.0 |" in react.stdout
    assert f"{react_result['dropped_tool_calls']} tool calls from the model server were dropped" in react.stderr
    assert '"action_format": "tools"' in react.stderr
