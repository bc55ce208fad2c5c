"""Rows are data, not configuration (seeupo_gym.integrations.row_kwargs), and a served env cannot
stop verl's agent loop.

A verl parquet row that sets `sandbox`, `python`, `data_dir`, `url`, a token or any key outside its
env's episode options, or names `seeupo/Remote-v0` / `seeupo/Ray-v0`, ends its own sample as
`bad_row` with one line naming the key; the trainer's `$SEEUPO_SERVE_TOKEN` reaches only the url of
the loop's config. Against tests/hostile_env_server.py, a refused reset, a never-ending episode, a
dripped description and a reward of 1e300 end their own sample as `env_error` within the loop's
deadlines while the batch's other sample scores. verl's real `AgentLoopWorker`; only the LLM server
is a stand-in (test_verl_agent_loop.py)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from seeupo_gym.integrations.row_kwargs import ROW_KWARGS, RowError, row_env_kwargs

BANDIT = "seeupo/TurnBandit-v0"
APPWORLD = "seeupo/AppWorld-v0"


# ------------------------------------------------------------------------------ the allowlist, quick


@pytest.mark.parametrize("env_id, kwargs, key", [
    (APPWORLD, {"sandbox": "none"}, "sandbox"),
    (APPWORLD, {"split": "mini", "python": "/bin/sh"}, "python"),
    (APPWORLD, {"data_dir": "/tmp/elsewhere"}, "data_dir"),
    (APPWORLD, {"limits": {"memory_mb": 1 << 20}}, "limits"),
    ("seeupo/BFCL-v4-v0", {"call_seconds_per_step": 1e9}, "call_seconds_per_step"),
    (BANDIT, {"url": "http://attacker.example"}, "url"),
    (BANDIT, {"token": "x"}, "token"),
])
def test_a_row_that_sets_a_config_only_key_is_refused_in_one_line_naming_it(env_id, kwargs, key):
    with pytest.raises(RowError) as refused:
        row_env_kwargs(env_id, json.dumps(kwargs))
    message = str(refused.value)
    assert f"may not set {key!r} for {env_id}" in message and "\n" not in message


@pytest.mark.parametrize("env_id", ["seeupo/Remote-v0", "seeupo/Ray-v0", "os.system"])
def test_a_row_may_not_name_an_env_that_chooses_where_code_runs(env_id):
    with pytest.raises(RowError, match=re.escape(f"as its env, not {env_id!r}")):
        row_env_kwargs(env_id, json.dumps({"url": "http://attacker.example", "env_id": BANDIT}))


def test_a_rows_episode_options_pass_and_the_list_is_short():
    assert row_env_kwargs(APPWORLD, '{"split": "mini", "max_turns": 5}') == {"split": "mini", "max_turns": 5}
    assert row_env_kwargs(BANDIT, {"variant": "follow"}) == {"variant": "follow"} and row_env_kwargs(BANDIT, "") == {}
    for allowed in ROW_KWARGS.values():  # nothing that decides isolation, executables, paths, addresses or secrets
        assert not allowed & {"sandbox", "python", "data_dir", "limits", "server_pool", "url", "token", "template",
                              "tool_parser", "env_kwargs", "actor_options"}


# ------------------------------------------------------------------------------ through verl's worker

pytest.importorskip("verl", reason="needs verl 0.9.1 (make venv installs it with --no-deps)")

from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from seeupo_gym.agents.vector import encode  # noqa: E402
from seeupo_gym.integrations.verl import SeeupoAgentLoop, _EnvError, build_dataset, write_parquet  # noqa: E402
from test_verl_agent_loop import (BFCL, TASKS, TOOLS, DishonestServer, ScriptedServer,  # noqa: E402,F401
                                  ground_truth_script, loop_config, run_rows, worker)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Listener:
    """A loopback HTTP listener that records every request head it receives (and answers 404)."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.heads.append(conn.recv(65536).decode("latin-1"))
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def parquet_rows(rows, tmp_path: Path):
    """`rows` written with write_parquet and read back as verl reads them (a folder that did not exist)."""
    import pandas as pd

    path = tmp_path / "not" / "yet" / "train.parquet"
    write_parquet(rows, str(path))
    return pd.read_parquet(path).to_dict("records")


def with_env_kwargs(row, env_id, kwargs):
    return {**row, "extra_info": {**row["extra_info"], "env_id": env_id, "env_kwargs": json.dumps(kwargs)}}


def test_write_parquet_makes_a_missing_folder(tmp_path):
    rows = build_dataset(BANDIT, ["mixed-0-1"])
    assert [row["extra_info"]["task_id"] for row in parquet_rows(rows, tmp_path)] == ["mixed-0-1"]


def test_parquet_rows_that_choose_sandbox_python_data_dir_url_or_token_end_their_own_sample(worker, tiny, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("SEEUPO_SERVE_TOKEN", "trainer-secret")
    _, tokenizer = tiny
    attacker = Listener()
    good = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    hostile = [
        with_env_kwargs(good, APPWORLD, {"split": "mini", "sandbox": "none"}),
        with_env_kwargs(good, APPWORLD, {"python": "/usr/bin/python3"}),
        with_env_kwargs(good, APPWORLD, {"data_dir": str(tmp_path)}),
        with_env_kwargs(good, BFCL, {**TOOLS, "url": attacker.url}),
        with_env_kwargs(good, BFCL, {**TOOLS, "token": "row-token"}),
        with_env_kwargs(good, "seeupo/Remote-v0", {"url": attacker.url, "env_id": BFCL}),
    ]
    rows = parquet_rows([good, *hostile], tmp_path)
    try:
        output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), rows)
    finally:
        attacker.close()
    ends, errors = list(output.non_tensor_batch["env_end"]), list(output.non_tensor_batch["env_error"])
    assert ends == ["terminated"] + ["bad_row"] * len(hostile)
    for key, error in zip(["sandbox", "python", "data_dir", "url", "token"], errors[1:]):
        assert f"may not set {key!r}" in error and "\n" not in error
    assert "not 'seeupo/Remote-v0'" in errors[-1]
    assert output.batch["rm_scores"].sum(dim=1).tolist() == [1.0] + [0.0] * len(hostile)
    assert attacker.heads == []  # the row's url got nothing, the token least of all


def test_the_token_goes_to_the_url_the_config_names(worker, tmp_path, monkeypatch):
    """Control for the test above: the same listener, named by the loop's config, gets the token."""
    monkeypatch.setenv("SEEUPO_SERVE_TOKEN", "trainer-secret")
    server = Listener()
    try:
        with loop_config(url=server.url) as configured:
            row = {**build_dataset(BFCL, TASKS[:1], **TOOLS)[0], "agent_name": configured}
            output = run_rows(worker, DishonestServer(lambda p: pytest.fail("no env, no request")), [row])
    finally:
        server.close()
    assert output.non_tensor_batch["env_end"][0] == "env_error"  # a 404 is no env server
    assert len(server.heads) == 1 and "authorization: bearer trainer-secret" in server.heads[0].lower()


def test_a_rows_episode_options_go_over_the_configs_kwargs(worker, tiny):
    """The config's kwargs (action_format, max_turns=20) stay; the row's own option (max_turns) wins."""
    _, tokenizer = tiny
    with loop_config(env_kwargs=TOOLS) as configured:
        row = build_dataset(BFCL, TASKS[:1])[0]
        row = {**with_env_kwargs(row, BFCL, {"max_turns": 1}), "agent_name": configured}
        output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), [row])
    assert output.non_tensor_batch["env_end"][0] == "truncated"  # one turn, in the tools format the script speaks
    assert output.batch["response_mask"].sum().item() == len(encode(tokenizer, ground_truth_script(TASKS[0])[0])) + 1


class BadLogprobsForOneSample(ScriptedServer):
    """The ground truth for every sample, but the first sample's answers carry a `bad` logprob."""

    def __init__(self, tokenizer, bad) -> None:
        super().__init__(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])})
        self.bad, self.spoiled = bad, None

    def answer(self, request_id, prompt_ids, sampling_params):
        output = super().answer(request_id, prompt_ids, sampling_params)
        self.spoiled = self.spoiled or request_id
        if request_id == self.spoiled:
            return TokenOutput(token_ids=output.token_ids, log_probs=[self.bad] * len(output.token_ids))
        return output


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_logprobs_end_their_own_sample_as_a_server_error_not_the_batch(worker, tiny, bad):
    _, tokenizer = tiny
    output = run_rows(worker, BadLogprobsForOneSample(tokenizer, bad), build_dataset(BFCL, TASKS[:1], **TOOLS) * 2)
    ends, errors = list(output.non_tensor_batch["env_end"]), list(output.non_tensor_batch["env_error"])
    assert sorted(ends) == ["server_error", "terminated"]
    spoiled = ends.index("server_error")
    assert "logprobs that are not" in errors[spoiled]
    assert output.batch["rm_scores"].sum(dim=1).tolist()[spoiled] == 0.0
    assert output.batch["rm_scores"].sum().item() == 1.0  # the other sample played on and scored
    assert torch.isfinite(output.batch["rollout_log_probs"]).all()


def test_a_row_naming_another_env_than_the_configs_ends_its_own_sample(worker, tiny):
    _, tokenizer = tiny
    good = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    with loop_config(env_id=BFCL, env_kwargs=TOOLS) as configured:
        rows = [{**good, "agent_name": configured},
                {**with_env_kwargs(good, APPWORLD, {"split": "mini"}), "agent_name": configured},
                {**with_env_kwargs(good, BANDIT, {}), "agent_name": configured}]
        output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), rows)
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "bad_row", "bad_row"]
    assert all(f"this loop runs {BFCL!r}" in error for error in output.non_tensor_batch["env_error"][1:])


@pytest.mark.parametrize("turns", [float("nan"), float("inf"), 10**9, 0, -1, True, "5", 2.0])
def test_a_rows_max_turns_must_be_an_int_within_the_turn_cap(turns):
    with pytest.raises(RowError, match="max_turns must be an int from 1 to 20"):
        row_env_kwargs(BANDIT, json.dumps({"max_turns": turns}), max_turns=20)
    assert row_env_kwargs(BANDIT, {"max_turns": 20}, max_turns=20) == {"max_turns": 20}


def test_a_row_with_a_nan_max_turns_ends_its_own_sample_and_the_batch_goes_on(worker, tiny):
    _, tokenizer = tiny
    good = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    bad = with_env_kwargs(good, BFCL, {**TOOLS, "max_turns": float("nan")})
    output = run_rows(worker, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), [good, bad])
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "bad_row"]
    assert "max_turns must be an int from 1 to 256" in output.non_tensor_batch["env_error"][1]


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), 1e300, -2e6])
def test_an_env_reward_that_float32_scores_cannot_hold_is_the_samples_env_error(reward):
    with pytest.raises(_EnvError, match="a reward is a finite number of at most 1e\\+06"):
        SeeupoAgentLoop._checked_reward(reward)
    assert SeeupoAgentLoop._checked_reward(-1.0) == -1.0 and SeeupoAgentLoop._checked_reward(1e6) == 1e6


@pytest.fixture(scope="module")
def hostile():
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("hostile_env_server.py"))],
                               stdout=subprocess.PIPE, text=True)
    try:
        match = re.search(r"at (http://\S+)", process.stdout.readline())
        assert match, "the hostile server did not start"
        yield lambda mode: f"{match.group(1)}/{mode}"
    finally:
        process.kill()
        process.wait(timeout=30)


class AnswerA(DishonestServer):
    """The model says "A" and stops, every turn."""

    def __init__(self, tokenizer) -> None:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = encode(tokenizer, "A") + [im_end]
        super().__init__(lambda p: TokenOutput(token_ids=ids, log_probs=[-0.1] * len(ids)))


@pytest.mark.parametrize("mode, message", [
    ("refuse_reset", r"refused reset: reset failed"),
    ("never_done", r"did not end the episode at its turn limit \(max_turns=10\)"),
    ("huge_reward", r"sent reward 1e\+300"),
    # answers the agent cannot read: each one's own sample, never the batch
    ("reset_no_messages", r"reset answered what the agent cannot read: .*info\['messages'\] is a NoneType"),
    ("reset_int_content", r"reset answered what the agent cannot read: .*has int content, not text"),
    ("reset_str_tools", r"reset answered what the agent cannot read: .*info\['tools'\] is not a list of dicts"),
    ("step_no_messages", r"new messages are not user or tool messages"),
    ("str_messages", r"step answered what the agent cannot read: .*is a str, not a dict"),
    ("huge_messages", r"step answered \d+ characters of messages and tools, over max_observation_chars=1048576"),
    # the client's connect_timeout_s is the loop's env_timeout_s: whichever clock says it first
    ("drip_description", r"did not describe its env within connect_timeout_s=5 s|took longer than 5.0 s"),
])
def test_a_hostile_served_env_ends_its_own_sample_within_the_loops_deadline(worker, tiny, hostile, mode, message):
    _, tokenizer = tiny
    rows = build_dataset(BANDIT, ["mixed-0-1"]) * 2
    start = time.monotonic()
    with loop_config(url=hostile(mode), env_timeout_s=5.0) as served, loop_config(url=hostile("honest")) as honest:
        output = run_rows(worker, AnswerA(tokenizer), [{**rows[0], "agent_name": served}, {**rows[1], "agent_name": honest}])
    assert time.monotonic() - start < 60
    ends = list(output.non_tensor_batch["env_end"])
    assert ends[0] == "env_error" and re.search(message, output.non_tensor_batch["env_error"][0])
    assert ends[1] in ("terminated", "truncated")  # the honest control in the same batch plays on
    assert output.batch["rm_scores"][0].sum().item() == 0.0


def test_a_row_asking_for_a_billion_tasks_is_refused_before_any_env_is_made():
    with pytest.raises(RowError, match="may not set 'num_tasks'"):
        row_env_kwargs(BANDIT, '{"num_tasks": 1000000000}')


def test_build_dataset_writes_only_row_settable_kwargs_into_rows(caplog):
    rows = build_dataset(BFCL, TASKS[:1], **TOOLS, max_observation_chars=5000)
    assert json.loads(rows[0]["extra_info"]["env_kwargs"]) == TOOLS  # the bound stays in the loop's config
    assert "['max_observation_chars'] not written into the rows" in caplog.text


def test_a_row_naming_an_unregistered_agent_loop_ends_its_own_sample_not_the_batch(worker, tiny):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from seeupo_gym.integrations.verl import SeeupoAgentLoopManager, SeeupoAgentLoopWorker

    _, tokenizer = tiny
    good = build_dataset(BFCL, TASKS[:1], **TOOLS)[0]
    rows = [good, {**good, "agent_name": "no_such_loop"}]
    server = ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])})
    with pytest.raises(AssertionError, match="Agent loop no_such_loop not registered"):
        run_rows(worker, server, rows)  # control: verl's own worker ends the batch
    ours = SeeupoAgentLoopWorker.__new__(SeeupoAgentLoopWorker)
    ours.__dict__.update(worker.__dict__)  # the same worker's state, our class's `_run_agent_loop`
    output = run_rows(ours, ScriptedServer(tokenizer, {TASKS[0]: ground_truth_script(TASKS[0])}), rows)
    assert list(output.non_tensor_batch["env_end"]) == ["terminated", "bad_row"]
    assert "agent loop 'no_such_loop', which is not registered" in output.non_tensor_batch["env_error"][1]
    assert output.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 0.0]
    assert issubclass(SeeupoAgentLoopWorker, AgentLoopWorker) and SeeupoAgentLoopManager.__module__ == "seeupo_gym.integrations.verl"
