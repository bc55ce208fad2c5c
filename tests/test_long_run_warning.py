"""A one-line warning before an eval or a comparison that may run past ten minutes on a CPU."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.training.model_source import warn_if_long as _warn_if_long
from seeupo_gym.training.compare.cli import long_compare_warning
from seeupo_gym.training.compare.plan import EvalPlan, build_plan, load_raw, parse_algorithms, plan_token_budget
from seeupo_gym.training.evaluation import (
    CPU_TOKEN_RATE,
    KNOWN_PARAMETERS,
    cpu_tokens_per_second,
    episode_turns,
    long_run_warning,
    pace_warning,
    token_budget,
)


def test_the_warning_fires_past_ten_minutes_on_a_cpu_only():
    assert long_run_warning("x", 600 * 10, 10.0, on_cpu=True, hint="h") is None  # exactly 10 min
    line = long_run_warning("x", 601 * 10, 10.0, on_cpu=True, hint="fewer tasks")
    assert line is not None and "\n" not in line
    assert line.startswith("x: warning: up to ~10 min on this CPU (6,010 tokens at most") and line.endswith("fewer tasks")
    assert long_run_warning("x", 10**9, 10.0, on_cpu=False, hint="h") is None  # an accelerator


def test_the_readme_embedded_eval_is_estimated_in_hours_and_a_small_tiny_eval_passes_quietly():
    # seeupo-eval --model embedded --env seeupo/TurnBandit-v0 -k 4: 64 tasks x 4 rollouts, 10 turns, 256 tokens.
    embedded = cpu_tokens_per_second(KNOWN_PARAMETERS["embedded"])
    assert embedded == pytest.approx(CPU_TOKEN_RATE / 4.94e8)
    tokens = token_budget(64 * 4, episode_turns({"variant": "easy"}), 256)
    assert tokens == 655_360
    # A bound: the README's run took ~20 min, its responses ending long before 10 x 256 tokens; the
    # pace of the first tasks (below) gives the likely time.
    assert "~12 days on this CPU" in long_run_warning("seeupo-eval", tokens, embedded, on_cpu=True, hint="h")
    # seeupo-eval --model tiny --max-tasks 4 -k 1 --max-new-tokens 16 with 2 turns: seconds.
    tiny = cpu_tokens_per_second(KNOWN_PARAMETERS["tiny"])
    assert long_run_warning("seeupo-eval", token_budget(4, episode_turns({"max_turns": 2}), 16), tiny,
                            on_cpu=True, hint="h") is None


def test_seeupo_eval_warns_from_the_parameter_count_of_a_stand_in_model(capsys):
    model = torch.nn.Linear(1000, 1000)  # ~1M parameters: ~300 tokens/s by the declared rate
    _warn_if_long(model, episodes=100, env_kwargs={"max_turns": 10}, max_new_tokens=256)  # 256k tokens: ~14 min
    err = capsys.readouterr().err
    assert err.startswith("seeupo-eval: warning: up to ~14 min") and "--max-tasks" in err
    _warn_if_long(model, episodes=10, env_kwargs={"max_turns": 10}, max_new_tokens=256)
    assert capsys.readouterr().err == ""


def _plan(tmp_path, *overrides):
    raw = load_raw("smoke", list(overrides))
    return build_plan(raw, parse_algorithms("seeupo,grpo"), [0, 1], tmp_path / "cmp",
                      EvalPlan(every=5, k=2, max_tasks=3))


def test_a_comparison_budget_counts_every_runs_rollouts_and_evaluations(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    # Each of 4 runs: 15 steps x 4 tasks x 8 rollouts, evals at 0, 5, 10, 15 of 3 tasks x 2; 1 turn, 1 token.
    assert plan_token_budget(plan) == 4 * (15 * 4 * 8 + 4 * 3 * 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert long_compare_warning(plan) is None  # the smoke preset: seconds
    long = _plan(tmp_path, "model.name_or_path=embedded", "sampling.max_new_tokens=256")
    assert long_compare_warning(long).startswith("seeupo-compare: warning: up to ~")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert long_compare_warning(long) is None


def test_the_pace_of_the_first_tasks_warns_when_the_rest_passes_ten_minutes():
    # 8 of 64 tasks in 90 s: 56 more at 11.25 s each = 10.5 min.
    assert pace_warning("seeupo-eval", 8, 64, 90.0) == (
        "seeupo-eval: warning: at the pace of the first 8 of 64 tasks, about 10 min more")
    assert pace_warning("seeupo-eval", 8, 64, 85.0) is None  # 9.9 min
    assert pace_warning("seeupo-eval", 8, 8, 9999.0) is None  # nothing left
