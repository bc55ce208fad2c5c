"""`key=value` overrides go anywhere on a command line, before, between or after the flags, in
every command that takes them (argparse's parse_intermixed_args). Each installed command runs in
a subprocess, as a user types it."""

from __future__ import annotations

import yaml

from cli_helpers import dead_port, run


def test_seeupo_train_takes_overrides_after_the_flags(tmp_path):
    done = run("seeupo-train", "train.seed=5", "--config", "smoke", "--out", str(tmp_path / "x"), "train.steps=3",
               "--print-config", "optim.lr=0.5")
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert (config["train"]["seed"], config["train"]["steps"], config["optim"]["lr"]) == (5, 3, 0.5)
    assert config["log"]["output_dir"] == str(tmp_path / "x")


def test_seeupo_eval_takes_overrides_after_the_flags():
    url = f"http://127.0.0.1:{dead_port()}/v1"  # the plan line is printed before the (failing) server check
    done = run("seeupo-eval", "--base-url", url, "--model", "m", "env.id=seeupo/TurnBandit-v0", "--no-progress",
               "env.kwargs.num_tasks=3", "--max-tasks", "9")
    assert "unrecognized arguments" not in done.stderr, done.stderr
    assert "on seeupo/TurnBandit-v0: 3 tasks x 1 rollouts" in done.stderr, done.stderr


def test_seeupo_compare_takes_overrides_after_the_flags(tmp_path):
    url = f"http://127.0.0.1:{dead_port()}/v1"
    done = run("seeupo-compare", "--model", f"a=m@{url}", "env.id=seeupo/TurnBandit-v0", "--out", str(tmp_path / "c"),
               "env.kwargs.num_tasks=3", "--eval-tasks", "0")
    assert "unrecognized arguments" not in done.stderr, done.stderr
    assert "on seeupo/TurnBandit-v0: 3 tasks x 4 rollouts" in done.stderr, done.stderr


def test_seeupo_serve_takes_env_kwargs_after_the_flags():
    done = run("seeupo-serve", "seeupo/TurnBandit-v0", "variant=easy", "--host", "0.0.0.0", "max_turns=4")
    assert "unrecognized arguments" not in done.stderr, done.stderr
    assert "binding 0.0.0.0 exposes the env" in done.stderr  # parsed whole, refused for its own reason


def test_seeupo_export_takes_its_folder_after_the_flags(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    done = run("seeupo-export", "--format", "jsonl", str(folder), str(tmp_path / "out.jsonl"))
    assert "unrecognized arguments" not in done.stderr, done.stderr
    assert done.returncode == 2 and done.stderr.startswith("seeupo-export: ")  # no rollouts there: one line


def test_counts_read_as_english():
    from seeupo_gym.text import counted

    assert [counted(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
