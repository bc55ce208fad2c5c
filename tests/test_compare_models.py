"""seeupo-compare --model: several models (here, a served one and one loaded here) in one report,
each scored exactly as seeupo-eval scores it alone; bad specs end in one clear line.

The served model is tests/openai_server.py (real HTTP on 127.0.0.1, the tiny model behind its chat
route); the env is TurnBandit's `capital` variant, on which the random tiny model scores now and then.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_openai_backend import _start

from seeupo_gym.training.cli import eval_main
from seeupo_gym.training.compare.cli import main

ENV = ["--env", "seeupo/TurnBandit-v0"]
ENV_KWARGS = {"variant": "capital", "num_tasks": 3, "turns": [1, 1]}
SECRET = "sk-test-never-written-4f1c"


def _eval_alone(tmp_path, name, *model_args):
    out = tmp_path / f"{name}.json"
    code = eval_main([*model_args, *ENV, "--env-kwargs", json.dumps(ENV_KWARGS), "--max-tasks", "3", "-k", "2",
                      "-n", "3", "--max-new-tokens", "4", "--temperature", "1.0", "--seed", "3", "--out", str(out),
                      "--no-progress"])
    assert code == 0
    return json.loads(out.read_text())


def test_two_models_sit_in_one_report_each_scored_as_seeupo_eval_scores_it_alone(
    tmp_path, capsys, caplog, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SEEUPO_TEST_KEY", SECRET)
    process, url = _start(tmp_path)
    out = tmp_path / "models"
    try:
        code = main([
            "--model", "here=tiny", "--model", f"served=tiny@{url}/v1", "--set", "served.api_key_env=SEEUPO_TEST_KEY",
            "--set", "served.concurrency=2",
            *ENV, "--eval-env-kwargs", json.dumps(ENV_KWARGS), "--eval-tasks", "3", "-k", "2", "-n", "3",
            "--max-new-tokens", "4", "--eval-temperature", "1.0", "--seeds", "3", "--out", str(out), "--no-progress",
        ])
        assert code == 0
        here = _eval_alone(tmp_path, "here", "--model", "tiny")
        served = _eval_alone(tmp_path, "served", "--base-url", f"{url}/v1", "--model", "tiny",
                             "--api-key-env", "SEEUPO_TEST_KEY", "--concurrency", "2")
        log = httpx.get(url + "/log").json()
    finally:
        process.kill()
        process.wait()

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["here", "served"] and summary["failures"] == {}
    report = (out / "report.md").read_text()
    for label, alone in (("here", here), ("served", served)):
        row = summary["models"][label]
        # The same numbers as seeupo-eval alone: overall and task by task.
        assert (row["avg"], row["passed"]) == (alone["summary"]["overall"]["avg@2"], alone["summary"]["overall"]["pass@2"])
        mine = json.loads((out / label / "seed-3" / "result.json").read_text())
        assert [(t["task_id"], t["successes"], t["mean_score"]) for t in mine["tasks"]] == \
               [(t["task_id"], t["successes"], t["mean_score"]) for t in alone["tasks"]]
        assert f"| {label} | " in report and f"{row['avg']:.3f}" in report and f"{row['passed']:.3f}" in report
    # Two models that score differently, and at all: the test can tell them apart.
    assert summary["models"]["here"]["avg"] != summary["models"]["served"]["avg"]
    assert max(summary["models"]["here"]["passed"], summary["models"]["served"]["passed"]) > 0
    assert "| served | " in report and "| n/a |" in report  # a chat API's tokens are not counted
    assert (out / "scores.png").stat().st_size > 10_000
    assert "served**: tiny at " + url + "/v1 (chat mode)" in report

    # The key went to the server on every request, and nowhere else.
    chats = [entry for entry in log if entry["route"] == "chat"]
    assert len(chats) >= 2 * 3 * 3 and all(entry["authorized"] for entry in chats)  # 2 runs x 3 tasks x 3 rollouts
    written = "".join(path.read_text(errors="replace") for path in out.rglob("*") if path.is_file()
                      and path.suffix != ".png")
    printed = capsys.readouterr()
    assert SECRET not in written + printed.out + printed.err + caplog.text
    assert "SEEUPO_TEST_KEY" in json.loads((out / "run.json").read_text())["models"]["served"]["api_key_env"]

    # The report rebuilds from the folder alone.
    (out / "report.md").unlink()
    assert main(["--report-only", str(out)]) == 0
    assert (out / "report.md").read_text() == report


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny"], "is not of the form LABEL=SPEC"),
    (["--model", "a=tiny", "--model", "a=embedded"], "lists the label 'a' twice"),
    (["--model", "../up=tiny"], "label '../up' must be letters"),
    (["--model", "a=m@ftp://host/v1"], "NAME@URL with an http:// or https:// URL"),
    (["--model", "a=m@http://127.0.0.1:9/v1", "--set", "a.mode=tokens"], "tokens mode needs the served model's tokenizer"),
    (["--model", "a=m@http://127.0.0.1:9/v1", "--set", "a.mode=bytes"], "server mode must be one of"),
    (["--model", "a=m@http://127.0.0.1:9/v1", "--set", "a.colour=red"], "--set a.colour: a served model takes"),
    (["--model", "a=m@http://127.0.0.1:9/v1", "--set", "a.concurrency=many"], "a.concurrency must be an integer"),
    (["--model", "a=m@http://127.0.0.1:9/v1", "--set", "a.concurrency=0"], "concurrency must be >= 1"),
    (["--model", "a=tiny", "--set", "a.mode=chat"], "a is not a served model"),
    (["--model", "a=tiny", "--set", "b.mode=chat"], "not among the --model labels ['a']"),
    (["--model", "a=tiny", "--algorithms", "seeupo"], "--model evaluates models and --algorithms trains"),
    (["--model", "a=tiny", "--eval-every", "3"], "are for training comparisons"),
    (["--model", "a=./no-such-folder"], "--model a: model './no-such-folder' is not a local folder"),
    (["--model", "a=tiny", "-k", "3", "-n", "2"], "need 1 <= eval k <= n"),
    (["--algorithms", "seeupo", "--max-new-tokens", "8"], "sampling.max_new_tokens=N"),
])
def test_a_bad_model_spec_is_one_clear_line_before_anything_loads(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([*argv, *ENV]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seeupo-compare: ") and message in err, err


def test_a_run_folder_is_not_taken_for_a_checkpoint(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "step-2").mkdir(parents=True)
    assert main(["--model", f"a={tmp_path / 'run'}", *ENV]) == 2
    assert f"that is a run folder; give one of its checkpoints, e.g. {tmp_path / 'run' / 'checkpoints'}" in \
        capsys.readouterr().err


def test_a_servers_url_is_shown_without_its_credentials():
    from seeupo_gym.training.model_source import ModelSource, public_url

    assert public_url("https://user:pw@api.example.com:8443/v1?api-key=k#x") == "https://api.example.com:8443/v1"
    source = ModelSource("gpt", base_url="https://user:pw@api.example.com/v1")
    assert source.describe() == "gpt at https://api.example.com/v1 (chat mode)"
