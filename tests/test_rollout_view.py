"""Rollouts you can look at: the run's episode log (training/rollouts.py), `seeupo-view` (training/view.py)
and `seeupo-export --format jsonl|hf`.

The page tests run in Debian's headless Chromium (`make test` installs it; skipped without it).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from seeupo_gym.algorithms.base import UpdatePhase
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.training.rollouts import (
    ROLLOUTS_FILE, RolloutLog, batch_records, dataset_features, episode_record, export_rollouts, read_rollouts,
)
from seeupo_gym.training.view import main as view_main
from seeupo_gym.training.view import parse_steps, render_page, serve, write_page

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it)")

HOSTILE = ("<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
           "</pre></details><b>bold</b> \x00\x1b[31m \ud800 end")


@pytest.fixture(scope="module")
def tokenizer():
    from seeupo_gym.agents import load_model

    return load_model("tiny")[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, one_torch_thread):
    """A real run: the smoke preset (TurnBandit capital, tiny model, SeeUPO), 2 steps of 2 tasks x 2 rollouts."""
    from seeupo_gym.training.config import load_config
    from seeupo_gym.training.trainer import Trainer

    run = tmp_path_factory.mktemp("run") / "smoke"
    config = load_config("smoke", [f"log.output_dir={run}", "train.steps=2", "train.tasks_per_step=2",
                                   "train.group_size=2", "log.progress_bars=false"])
    with Trainer(config) as trainer:
        trainer.train(save_at_end=False)
    return run


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def two_turn_episode(tokenizer, rollout_id="0:t:0", reward=0.5, response=" B", rebuilt=False):
    """Turn 2's context is turn 1's context + response + an observation (or, rebuilt, a new text)."""
    first = encode(tokenizer, "<|im_start|>user\nPick one.<|im_end|>\n<|im_start|>assistant\n")
    answer = encode(tokenizer, " B")  # the text the env got is `response` (actions); ids need not match it
    observation = encode(tokenizer, "<|im_end|>\n<|im_start|>user\nNext step.<|im_end|>\n<|im_start|>assistant\n")
    second = (first[:3] + encode(tokenizer, " rebuilt")) if rebuilt else first + answer + observation
    turns = [Turn(first, answer, [0.0] * len(answer)), Turn(second, answer, [0.0] * len(answer))]
    messages = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Pick one."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "answer", "arguments": {"label": "B"}}}]},
        {"role": "tool", "name": "answer", "content": "You chose B.\nNext step."},
        {"role": "assistant", "content": response},
        {"role": "user", "content": "Over."},
    ]
    info = {"end": "terminated", "messages": messages, "actions": [response, response]}
    return Trajectory("t", "0:t", rollout_id, turns, reward, success=False, info=info)


# --------------------------------------------------------------------------------- the record


def test_record_stores_each_context_as_the_delta_after_the_previous_turn(tokenizer):
    trajectory = two_turn_episode(tokenizer)
    record = episode_record(trajectory, tokenizer, step=3, advantage=0.25)
    first, second = record["turns"]
    assert first["context_kept_tokens"] == 0 and first["context_delta"].startswith("<|im_start|>user\nPick one.")
    assert second["context_kept_tokens"] == len(trajectory.turns[0].context_ids) + len(trajectory.turns[0].response_ids)
    assert second["context_delta"] == "<|im_end|>\n<|im_start|>user\nNext step.<|im_end|>\n<|im_start|>assistant\n"
    assert second["context_tokens"] == len(trajectory.turns[1].context_ids)
    # Tool calls the env accepted, with their arguments as a JSON string; the env's answer per turn.
    assert first["tool_calls"] == [{"name": "answer", "arguments": '{"label": "B"}'}]
    assert first["observation"] == [{"role": "tool", "name": "answer", "content": "You chose B.\nNext step."}]
    assert second["observation"] == [{"role": "user", "name": "", "content": "Over."}]
    assert (record["step"], record["reward"], record["advantage"], first["advantage"]) == (3, 0.5, 0.25, 0.25)


def test_record_of_a_rebuilt_context_keeps_only_the_common_prefix(tokenizer):
    record = episode_record(two_turn_episode(tokenizer, rebuilt=True), tokenizer, step=1)
    assert record["turns"][1]["context_kept_tokens"] == 3
    assert record["turns"][1]["context_delta"] == " rebuilt"


def test_records_carry_seeupos_m_and_ratio_per_turn_and_grpos_advantage(tokenizer):
    batch = RolloutBatch([two_turn_episode(tokenizer, "a"), two_turn_episode(tokenizer, "b", reward=0.0)])
    # SeeUPO, reverse order: pool 2 with M = A, then pool 1 with M = A * s(y_2).
    seeupo = [UpdatePhase(2, ("a", "b"), {"a": 1.0, "b": -1.0}, 1, ratios_after={"a": 1.1, "b": 0.9}),
              UpdatePhase(1, ("a", "b"), {"a": 1.1, "b": -0.9}, 1)]
    a, b = batch_records(batch, tokenizer, step=1, schedule=seeupo)
    assert a["advantage"] == 1.0 and b["advantage"] == -1.0
    assert [(t["m"], t["ratio"], t["update_order"]) for t in a["turns"]] == [(1.1, None, 2), (1.0, 1.1, 1)]
    assert [(t["m"], t["ratio"], t["update_order"]) for t in b["turns"]] == [(-0.9, None, 2), (-1.0, 0.9, 1)]
    grpo = [UpdatePhase(None, ("a", "b"), {"a": 0.7, "b": -0.7}, 1)]
    a, b = batch_records(batch, tokenizer, step=1, schedule=grpo)
    assert [t["advantage"] for t in a["turns"]] == [0.7, 0.7] and all(t["m"] is None for t in a["turns"])
    # Left out of the update (no phase holds it): null, not 0.
    (left_out,) = batch_records(RolloutBatch([two_turn_episode(tokenizer, "c")]), tokenizer, step=1, schedule=grpo)
    assert left_out["advantage"] is None and left_out["turns"][0]["advantage"] is None


def test_log_appends_a_gzip_member_per_step_truncates_on_resume_and_survives_a_damaged_tail(tmp_path, tokenizer):
    log = RolloutLog(tmp_path, tokenizer)
    for step in (1, 2, 3):
        log.write(RolloutBatch([two_turn_episode(tokenizer, f"s{step}", response=HOSTILE)]), step=step)
    assert [r["step"] for r in read_rollouts(tmp_path)] == [1, 2, 3]
    assert read_rollouts(tmp_path).__next__()["turns"][0]["response"].endswith("\\ud800 end")  # the lone surrogate, escaped
    log.truncate(2)
    assert [r["rollout_id"] for r in read_rollouts(tmp_path)] == ["s1", "s2"]
    with open(tmp_path / ROLLOUTS_FILE, "ab") as f:  # a run killed mid-write
        f.write(gzip.compress(b'{"step": 3, "rollout_id": "s3"}\n{"step": 3, "roll')[:-12])
    assert [r["rollout_id"] for r in read_rollouts(tmp_path)][:2] == ["s1", "s2"]


def test_a_real_run_records_every_episode_with_seeupos_values(tiny_run, tokenizer):
    records = list(read_rollouts(tiny_run))
    assert [r["step"] for r in records] == [1] * 4 + [2] * 4  # 2 steps x 2 tasks x 2 rollouts
    assert len({(r["step"], r["rollout_id"]) for r in records}) == 8
    for record in records:
        assert record["schema"] == "seeupo-rollout/1" and record["num_turns"] == len(record["turns"]) >= 1
        turns = record["turns"]
        assert turns[0]["context_kept_tokens"] == 0 and "TurnBandit" in turns[0]["context_delta"]
        for before, turn in zip(turns, turns[1:]):  # the agent appends tokens: every context extends the last
            assert turn["context_kept_tokens"] == before["context_tokens"] + before["response_tokens"]
        # smoke trains SeeUPO: every turn was updated in a pool, reverse order, with its M.
        assert [t["update_order"] for t in turns] == list(range(len(turns), 0, -1))
        assert all(t["m"] is not None for t in turns)


def test_log_rollouts_false_records_nothing(tmp_path, one_torch_thread):
    from seeupo_gym.training.config import load_config
    from seeupo_gym.training.trainer import Trainer

    config = load_config("tiny-turnbandit", [f"log.output_dir={tmp_path}", "train.steps=1", "train.tasks_per_step=1",
                                             "log.rollouts=false", "log.progress_bars=false"])
    with Trainer(config) as trainer:
        trainer.train(save_at_end=False)
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / ROLLOUTS_FILE).exists()


# --------------------------------------------------------------------------------- the page


def test_page_holds_every_episode_of_a_real_run(tiny_run, tmp_path):
    assert view_main([str(tiny_run), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    records = list(read_rollouts(tiny_run))
    assert page.count('<details class="episode"') == len(records) == 8
    for record in records:
        assert f'step {record["step"]} · rollout <code>{record["rollout_id"]}</code>' in page
    assert len(re.findall(r'<section class="task"', page)) == len({r["task_id"] for r in records})
    # Self-contained: nothing is fetched.
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    # The default page lands in the run folder.
    assert write_page(tiny_run) == tiny_run / "rollouts.html"


def test_page_escapes_hostile_text_everywhere(tokenizer):
    trajectory = two_turn_episode(tokenizer, rollout_id='"><script>alert(1)</script>', response=HOSTILE)
    record = episode_record(trajectory, tokenizer, step=1)
    record["task_id"] = "<img src=x onerror=alert(1)>"
    page = render_page([record])
    assert "<script>document.title" not in page and "<img src=x" not in page and "<b>bold" not in page
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert "\x00" not in page and "\\x00\\x1b[31m" in page  # control characters shown, not sent
    assert page.count("<script") == 1  # the page's own
    page.encode("utf-8")  # valid Unicode: the lone surrogate is shown escaped


def test_steps_option_keeps_only_those_steps(tiny_run, tmp_path):
    assert parse_steps("2:") == (2, 2**62) and parse_steps("7") == (7, 7) and parse_steps(":3") == (0, 3)
    page = write_page(tiny_run, tmp_path / "p.html", steps=(2, 2)).read_text()
    assert page.count('<details class="episode"') == 4 and "step 1 ·" not in page
    with pytest.raises(ValueError, match="--steps"):
        parse_steps("a:b")


def test_view_of_a_folder_without_rollouts_is_a_clear_error(tmp_path, capsys):
    assert view_main([str(tmp_path)]) == 2
    assert "no recorded rollouts" in capsys.readouterr().err


def test_serve_binds_loopback_and_answers_only_the_page(tmp_path):
    page = tmp_path / "p.html"
    page.write_text("<!DOCTYPE html><p>hi</p>")
    server = serve(page, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as reply:
            assert reply.read() == page.read_bytes() and reply.headers["Content-Type"].startswith("text/html")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/../../etc/passwd", timeout=10)
        assert error.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def chromium(profile: Path, *args: str, timeout: float = 120) -> str:
    """Headless Chromium with its own profile folder; returns what it printed (--dump-dom: the DOM)."""
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@needs_chromium
def test_chromium_shows_every_episode_of_a_real_run_and_its_screenshot_is_not_blank(tiny_run, tmp_path):
    from PIL import Image

    page = write_page(tiny_run, tmp_path / "page.html")
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri())
    assert dom.count('<details class="episode"') == 8
    assert '<span id="shown">8</span>' in dom  # the page's script ran and counted them
    shot = tmp_path / "page.png"
    chromium(tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    image = Image.open(shot).convert("L")
    assert image.size == (1200, 900)
    histogram = image.histogram()
    assert sum(1 for count in histogram if count) > 20  # text, not one flat colour
    assert max(histogram) < 0.97 * 1200 * 900


@needs_chromium
def test_chromium_filters_from_the_address_hide_other_tasks(tiny_run, tmp_path):
    page = write_page(tiny_run, tmp_path / "page.html")
    task = next(read_rollouts(tiny_run))["task_id"]
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri() + f"#task={task}")
    assert '<span id="shown">2</span>' in dom  # its two rollouts
    assert len(re.findall(r'<details class="episode"[^>]*hidden', dom)) == 6


@needs_chromium
def test_chromium_shows_a_hostile_response_as_text_and_runs_none_of_it(tokenizer, tmp_path):
    record = episode_record(two_turn_episode(tokenizer, response=HOSTILE), tokenizer, step=1)
    page = tmp_path / "hostile.html"
    page.write_text(render_page([record], title="viewer test"))
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri())
    assert "<title>viewer test</title>" in dom and "pwned</title>" not in dom
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom  # shown as text
    assert "<b>bold</b>" not in dom and "<img" not in dom


# --------------------------------------------------------------------------------- export


def test_export_jsonl_and_hf_hold_every_episode_with_the_documented_schema(tiny_run, tmp_path):
    from seeupo_gym.training.cli import export_main

    records = list(read_rollouts(tiny_run))
    assert export_main([str(tiny_run), "--format", "jsonl", str(tmp_path / "r.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rows == records
    datasets = pytest.importorskip("datasets")
    assert export_main([str(tiny_run), "--format", "hf", str(tmp_path / "hf")]) == 0
    dataset = datasets.load_from_disk(str(tmp_path / "hf"))
    assert len(dataset) == 8 and dataset.features == dataset_features()
    assert [r["rollout_id"] for r in dataset] == [r["rollout_id"] for r in records]
    assert dataset[3]["turns"][0]["response"] == records[3]["turns"][0]["response"]
    # Every field is documented.
    doc = (ROOT / "docs" / "rollouts.md").read_text()
    for name in list(dataset_features()) + list(dataset_features()["turns"].feature):
        assert f"`{name}`" in doc, name


def test_export_of_an_unknown_format_or_a_missing_run_is_refused(tmp_path, capsys):
    from seeupo_gym.training.cli import export_main

    with pytest.raises(ValueError, match="--format"):
        export_rollouts(tmp_path, tmp_path / "x", "parquet")
    assert export_main([str(tmp_path), "--format", "jsonl"]) == 2
    assert "no recorded rollouts" in capsys.readouterr().err


# --------------------------------------------------------------------------------- red team: the page's numbers


def test_odd_numbers_in_records_render_as_text_and_never_break_the_page():
    odd = {
        "task_id": 10**400, "rollout_id": {"nested": [float("nan"), {"deep": 10**5000}]}, "step": 10**400,
        "reward": 10**400, "advantage": float("nan"), "num_turns": 10**5000, "end": float("inf"), "error": [1e308],
        "turns": [{"t": [1, [2, {"a": 10**5000}]], "advantage": float("-inf"), "m": 10**400, "ratio": "x",
                   "update_order": 10**5000, "context_tokens": 10**400, "context_kept_tokens": float("nan"),
                   "response_tokens": -(10**400), "finish_reason": None, "response": 7, "context_delta": [],
                   "tool_calls": 5, "observation": {"role": 1}},
                  "not a turn", {"tool_calls": [{"name": 10**5000, "arguments": {"x": float("nan")}}, 3],
                                 "observation": [{"role": [], "name": 10**5000, "content": float("inf")}, None]}],
    }
    others = [
        {"task_id": "t", "step": 1, "reward": float("nan"), "turns": 5},
        {"task_id": "t", "step": 2, "reward": float("inf"), "turns": "abc", "advantage": 1e308},
        {"task_id": "t", "step": 3, "reward": 1e308, "turns": {"a": 1}},
        {"task_id": "t", "step": 4, "reward": 1e308},  # their sum overflows a float; their mean does not
        {"task_id": "t", "step": True, "reward": 0.5},
        ["not", "a", "record"],
    ]
    page = render_page([odd, *others])
    assert page.count('<details class="episode"') == 7
    assert "an integer of about 401 digits" in page and "an integer of about 5001 digits" in page
    assert '<span class="reward r-zero">nan</span>' in page and '<span class="reward r-zero">inf</span>' in page
    assert "+1.000e+308" in page and "{nested: [nan, {deep: an integer of about 5001 digits}]}" in page
    # Each odd value had its own rule: the fallback line is for the one thing that is not a record.
    assert page.count("could not be laid out") == 1 and "<pre>[not, a, record]</pre>" in page
    # The task's header: the mean of its finite rewards (0.5, 1e308, 1e308), and how many were not.
    assert "5 episodes · mean reward +6.667e+307 · 2 rewards not a finite number" in page


def test_random_records_of_odd_values_in_every_field_all_lay_out():
    import random

    rng = random.Random(38)
    odd = [10**400, -(10**5000), float("nan"), float("inf"), -float("inf"), 1e308, -1e-320, True, None, "", "<b>x</b>",
           "\ud800", [], {}, [[[[[1]]]]], {"a": {"b": {"c": {"d": 10**400}}}}, [float("nan")] * 50, 0, -1, 2**63]
    fields = ["task_id", "rollout_id", "step", "reward", "advantage", "num_turns", "end", "error", "success", "turns"]
    turn_fields = ["t", "advantage", "m", "ratio", "update_order", "context_tokens", "context_kept_tokens",
                   "response_tokens", "finish_reason", "response", "context_delta", "tool_calls", "observation"]
    records = []
    for _ in range(300):
        turn = {k: rng.choice(odd) for k in rng.sample(turn_fields, rng.randint(0, len(turn_fields)))}
        if rng.random() < 0.5:
            turn["tool_calls"] = [{"name": rng.choice(odd), "arguments": rng.choice(odd)}, rng.choice(odd)]
            turn["observation"] = [{"role": rng.choice(odd), "name": rng.choice(odd), "content": rng.choice(odd)}]
        record = {k: rng.choice(odd) for k in rng.sample(fields, rng.randint(0, len(fields)))}
        if rng.random() < 0.7:
            record["turns"] = [turn, rng.choice(odd)]
        records.append(record)
    page = render_page(records)
    assert page.count('<details class="episode"') == 300 and "could not be laid out" not in page
    assert "<b>x" not in page and page.count("<script") == 1
    page.encode("utf-8")


def test_view_of_a_run_whose_reward_is_10_to_the_400_writes_the_page(tmp_path, capsys):
    # As the attack wrote it: a JSON int of 401 digits, NaN and Infinity in the run's own file.
    lines = ['{"task_id": "t", "step": 1, "rollout_id": "a", "reward": 1' + "0" * 400 + "}",
             '{"task_id": "t", "step": 1, "rollout_id": "b", "reward": NaN, "advantage": Infinity}',
             '{"task_id": "t", "step": 2, "rollout_id": "c", "reward": -Infinity, "turns": [{"ratio": 1e999}]}']
    with gzip.open(tmp_path / ROLLOUTS_FILE, "wt") as f:
        f.write("\n".join(lines) + "\n")
    assert view_main([str(tmp_path)]) == 0
    page = (tmp_path / "rollouts.html").read_text()
    assert page.count('<details class="episode"') == 3 and "an integer of about 401 digits" in page
    assert 'data-reward="Infinity"' in page and 'data-reward="NaN"' in page and 'data-reward="-Infinity"' in page


def test_view_of_a_run_with_a_record_nested_past_the_parser_and_an_alias_bomb_config_writes_the_page(tmp_path):
    # A record nested 100,000 levels deep (json.loads raises RecursionError) is skipped like any bad line;
    # a config.yaml alias bomb costs the page its one-line summary, not a hang.
    lines = ['{"task_id": "t", "step": 1, "rollout_id": "a", "reward": 1.0}', '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    with gzip.open(tmp_path / ROLLOUTS_FILE, "wt") as f:
        f.write("\n".join(lines) + "\n")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + k)}: &{chr(98 + k)} [*{chr(97 + k)}, *{chr(97 + k)}, *{chr(97 + k)}, *{chr(97 + k)}, *{chr(97 + k)}, "
        f"*{chr(97 + k)}, *{chr(97 + k)}, *{chr(97 + k)}, *{chr(97 + k)}]\n" for k in range(9))
    (tmp_path / "config.yaml").write_text(bomb)
    assert view_main([str(tmp_path)]) == 0
    assert (tmp_path / "rollouts.html").read_text().count('<details class="episode"') == 1


# --------------------------------------------------------------------------------- red team: --serve


def served(page_text="<!DOCTYPE html><p>the rollouts</p>", **options):
    """A `serve()` server on a free port, serving in a thread; yields (server, port)."""
    import contextlib
    import tempfile

    @contextlib.contextmanager
    def running():
        with tempfile.TemporaryDirectory() as folder:
            page = Path(folder) / "p.html"
            page.write_text(page_text)
            server = serve(page, port=0, **options)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            try:
                yield server, server.server_address[1]
            finally:
                server.shutdown()
                server.server_close()
                thread.join(timeout=10)

    return running()


def raw_request(port, head: bytes, timeout=10.0) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_serve_answers_only_its_own_host_header_so_dns_rebinding_reads_nothing():
    with served() as (_, port):
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}"):
            reply = raw_request(port, f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert reply.startswith(b"HTTP/1.0 200") and b"the rollouts" in reply, host
        for head in (f"GET / HTTP/1.1\r\nHost: evil.example:{port}\r\n\r\n",  # a rebound name
                     f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}.evil.example\r\n\r\n",
                     f"GET / HTTP/1.1\r\nHost: localhost.:{port}\r\n\r\n",
                     f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port + 1}\r\n\r\n",
                     "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                     f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example\r\n\r\n",
                     "GET / HTTP/1.0\r\n\r\n"):  # no Host at all
            reply = raw_request(port, head.encode())
            assert reply.startswith(b"HTTP/1.0 403") and b"the rollouts" not in reply, head


def test_serve_cuts_a_request_head_that_drips_or_idles_past_its_deadline():
    import socket
    import time

    with served(head_timeout_s=1.0) as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n")
            start = time.monotonic()
            cut = None
            for _ in range(40):  # a header byte every 0.2 s: each read is quick, the head never ends
                try:
                    sock.sendall(b"X")
                except OSError:
                    cut = time.monotonic() - start
                    break
                time.sleep(0.2)
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        cut = time.monotonic() - start
                        break
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            assert cut is not None and cut < 3.0, cut
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:  # says nothing at all
            start = time.monotonic()
            assert idle.recv(1) == b"" and time.monotonic() - start < 3.0


def test_serve_holds_1500_idle_sockets_in_a_bounded_number_of_threads_and_still_answers_a_reader():
    import socket
    import time

    before = threading.active_count()
    # A long head deadline: the real request below is answered although no idle socket has timed out.
    with served(head_timeout_s=60.0) as (_, port):
        sockets, peak = [], 0
        try:
            for _ in range(1500):
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                peak = max(peak, threading.active_count() - before)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                peak = max(peak, threading.active_count() - before)
                time.sleep(0.02)
            assert peak <= 40, peak  # 32 connection slots and the serving thread, not 1,500 threads
            start = time.monotonic()
            reply = raw_request(port, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert reply.startswith(b"HTTP/1.0 200") and b"the rollouts" in reply
            assert time.monotonic() - start < 10
            assert sockets[0].recv(64) == b""  # the longest-idle socket gave way (closed, nothing sent)
            peak = max(peak, threading.active_count() - before)
            assert peak <= 40, peak
        finally:
            for sock in sockets:
                sock.close()


def test_serve_evicts_an_unfinished_head_for_a_new_request_and_answers_503_only_when_every_slot_is_sending():
    import socket
    import time

    with served("x" * (32 << 20), max_connections=2) as (_, port):
        held = []
        try:
            for _ in range(2):  # two heads under way (a request line, no end)
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(b"GET / HTTP/1.1\r\n")
                held.append(sock)
            time.sleep(0.3)
            # The oldest gives way: a third client's request is answered.
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                assert sock.recv(12) == b"HTTP/1.0 200"
            assert held[0].recv(64) == b""
            # Two clients that asked for the 32 MiB page and do not read it: no head is awaited,
            # nothing to evict, so a third is told the server is busy (and the two keep their replies).
            deadline = time.monotonic() + 20
            while True:  # the closed heads' slots free once the server sees them go (later under load)
                for sock in held:
                    sock.close()
                held = []
                for _ in range(2):
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                    held.append(sock)
                if all(sock.recv(12) == b"HTTP/1.0 200" for sock in held):  # their heads are in; the replies wait
                    break
                assert time.monotonic() < deadline, "two clients were never both served"
                time.sleep(0.2)
            reply = raw_request(port, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert reply.startswith(b"HTTP/1.0 503")
        finally:
            for sock in held:
                sock.close()


# --------------------------------------------------------------------------------- the filters (issue 40)


def filter_records():
    """Task a: rewards 0 and 1 at steps 1, 2; task b: 1, 0.5 and a missing reward at steps 1, 2, 3."""
    return [{"task_id": "a", "step": 1, "rollout_id": "a1", "reward": 0.0},
            {"task_id": "a", "step": 2, "rollout_id": "a2", "reward": 1.0},
            {"task_id": "b", "step": 1, "rollout_id": "b1", "reward": 1.0},
            {"task_id": "b", "step": 2, "rollout_id": "b2", "reward": 0.5},
            {"task_id": "b", "step": 3, "rollout_id": "b3", "reward": None}]


def task_headers(dom: str) -> dict[str, str]:
    return dict(re.findall(r'<section class="task" data-task="(\w+)"[^>]*><h2>Task <code>\w+</code> '
                           r'<span class="meta task-stats">([^<]*)</span>', dom))


def test_task_headers_of_the_page_as_written_count_every_episode():
    assert task_headers(render_page(filter_records())) == {
        "a": "2 episodes · mean reward +0.500", "b": "3 episodes · mean reward +0.750 · 1 reward not a finite number"}


@needs_chromium
def test_chromium_task_headers_count_only_the_episodes_the_filters_keep(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(render_page(filter_records()))
    expected = {
        "": {"a": "2 episodes · mean reward +0.500", "b": "3 episodes · mean reward +0.750 · 1 reward not a finite number"},
        "#smin=2": {"a": "1 of 2 episodes · mean reward +1.000",
                    "b": "2 of 3 episodes · mean reward +0.500 · 1 reward not a finite number"},
        "#rmin=0.6": {"a": "1 of 2 episodes · mean reward +1.000", "b": "1 of 3 episodes · mean reward +1.000"},
    }
    for address, headers in expected.items():
        dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri() + address)
        assert task_headers(dom) == headers, address


def none_shown(dom: str) -> str | None:
    """The text of the nothing-matches message if the page shows it, else None."""
    match = re.search(r'<p id="none-shown" class="none"( hidden(="")?)?>(.*?)</p>', dom)
    assert match, "the page has no nothing-matches message"
    return None if match.group(1) else re.sub(r"<[^>]+>", "", match.group(3))


@needs_chromium
def test_chromium_a_filter_that_matches_nothing_says_so_and_how_to_clear_it(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(render_page(filter_records()))
    assert none_shown(chromium(tmp_path / "profile", "--dump-dom", page.as_uri())) is None
    for address, named in (("#text=zzz", 'text "zzz"'), ("#rmin=2", "reward from 2 to any"),
                           ("#task=a&smin=3", "task a, step from 3 to any"),
                           ("#task=nope", "task nope")):  # a task the page does not hold: not "every task"
        dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri() + address)
        message = none_shown(dom)
        assert message is not None and f"No episode matches the filters ({named})" in message, address
        assert "Clear the filters" in message and '<span id="shown">0</span>' in dom, address
    # The address is hostile too: what the page writes from it (the message, a task option) is text.
    hostile = urllib.parse.quote("<img src=x onerror=\"document.title='pwned'\">")
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri() + f"#task={hostile}&text={hostile}")
    assert "<img" not in dom and "pwned</title>" not in dom and "task &lt;img src=x" in dom


@needs_chromium
def test_chromium_clear_the_filters_button_shows_every_episode_again(tmp_path):
    """Clicked in a running Chromium, over the DevTools protocol."""
    page = tmp_path / "page.html"
    page.write_text(render_page(filter_records()))
    with devtools_page(tmp_path / "profile", page.as_uri() + "#text=zzz") as evaluate:
        assert evaluate("document.getElementById('shown').textContent") == "0"
        assert evaluate("document.getElementById('none-shown').hidden") is False
        evaluate("document.getElementById('f-clear').click()")
        assert evaluate("document.getElementById('shown').textContent") == "5"
        assert evaluate("document.getElementById('none-shown').hidden") is True
        assert evaluate("document.getElementById('f-text').value") == ""
        assert evaluate("location.hash") == ""  # the address no longer holds the filters
        assert evaluate("document.querySelectorAll('section.task:not([hidden])').length") == 2


def devtools_page(profile: Path, url: str, timeout: float = 60):
    """A headless Chromium showing `url`; yields evaluate(expression) -> its value (DevTools protocol)."""
    import contextlib
    import time

    from websockets.sync.client import connect

    @contextlib.contextmanager
    def running():
        assert CHROMIUM is not None
        browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--remote-debugging-port=0", f"--user-data-dir={profile}", url],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            port_file = profile / "DevToolsActivePort"
            while not port_file.exists() or not port_file.read_text().strip():
                assert time.monotonic() < deadline and browser.poll() is None, "Chromium did not start"
                time.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            while True:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                    targets = [t for t in json.loads(reply.read()) if t.get("type") == "page"]
                if targets:
                    break
                assert time.monotonic() < deadline, "Chromium opened no page"
                time.sleep(0.1)
            with connect(targets[0]["webSocketDebuggerUrl"], open_timeout=10, max_size=None) as ws:
                ids = iter(range(1, 10**6))

                def evaluate(expression: str):
                    number = next(ids)
                    ws.send(json.dumps({"id": number, "method": "Runtime.evaluate",
                                        "params": {"expression": expression, "returnByValue": True}}))
                    while True:
                        message = json.loads(ws.recv(timeout=timeout))
                        if message.get("id") == number:
                            assert "exceptionDetails" not in message["result"], message["result"]
                            return message["result"]["result"].get("value")

                while evaluate("location.protocol + document.readyState") != "file:complete":
                    assert time.monotonic() < deadline, "the page did not load"
                    time.sleep(0.1)
                yield evaluate
        finally:
            browser.terminate()
            try:
                browser.wait(timeout=10)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait(timeout=10)

    return running()
