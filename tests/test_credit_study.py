"""scripts/credit_study.py as a researcher meets it: budgets stated and matched, names checked, plug-ins added."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--tasks", "3", "--seeds", "2", "--iterations", "2", "--eval-every", "0", "--suites", "climbing"]

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("credit_study", ROOT / "scripts" / "credit_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["credit_study"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _runs(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["results"]


def test_match_steps_gives_every_method_as_many_optimizer_steps_as_seeupo(study, tmp_path, capsys):
    study.main([*SMALL, "--policies", "shared", "--match", "steps", "samples", "--out", str(tmp_path),
                "--methods", "seeupo reverse/batch", "grpo", "ppo", "turn_gae"])
    results = _runs(tmp_path)
    matched = {label: [r["optimizer_steps"] for r in by_suite["climbing"]] for label, by_suite in results["shared|steps"].items()}
    # SeeUPO takes one step per turn pool: seed 0's 3 tasks have 2 turns, seed 1's up to 3 (2 iterations each).
    assert set(map(tuple, matched.values())) == {(4, 6)}, matched
    own = {label: [r["optimizer_steps"] for r in by_suite["climbing"]] for label, by_suite in results["shared|samples"].items()}
    assert own == {"seeupo reverse/batch": [4, 6], "grpo": [2, 2], "ppo": [2, 2], "turn_gae": [2, 2]}
    table = (tmp_path / "results.md").read_text()
    assert "budget steps" in table and "| grpo | 0.1 | " in table and "| 2.5, " in table
    assert "steps/it 2.5" in capsys.readouterr().out


def test_an_unknown_method_exits_non_zero_with_one_line_naming_the_known_ones(study, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        study.main(["--methods", "no_such_method", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_such_method" in err and "'grpo'" in err and "seeupo reverse/batch" in err


def test_an_unknown_suite_exits_non_zero_with_one_line_through_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "credit_study.py"), "--suites", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "'nope'" in done.stderr and "ladder+slip" in done.stderr


def test_a_method_takes_algorithm_options_by_name(study, tmp_path):
    study.main([*SMALL, "--policies", "tabular", "--match", "samples", "--out", str(tmp_path),
                "--methods", "seeupo:order=natural,normalization=group"])
    assert list(_runs(tmp_path)["tabular|samples"]) == ["seeupo:order=natural,normalization=group"]
    with pytest.raises(SystemExit):
        study.main([*SMALL, "--out", str(tmp_path), "--methods", "seeupo:order"])


def test_a_plugin_file_adds_its_method_beside_the_named_ones(study, tmp_path):
    plugin = ROOT / "docs" / "examples" / "turn_credit_plugin.py"
    study.main([*SMALL, "--policies", "tabular", "--match", "samples", "--out", str(tmp_path),
                "--methods", "grpo", "--plugin", str(plugin)])
    runs = _runs(tmp_path)["tabular|samples"]
    assert list(runs) == ["grpo", "reward_to_go"]
    assert all(0 < r["mean"] <= 1 for r in runs["reward_to_go"]["climbing"])


def test_a_plugin_class_by_module_and_name_is_registered_and_runs(study, tmp_path, monkeypatch):
    (tmp_path / "my_credit.py").write_text(
        "from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm\n"
        "class LastTurnOnly(TurnAdvantageAlgorithm):\n"
        "    def turn_advantages(self, batch, learner):\n"
        "        return {(s.rollout_id, s.t): (s.trajectory.reward - 0.5 if s.t == s.trajectory.num_turns else 0.0)\n"
        "                for s in batch.samples()}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    study.main([*SMALL, "--policies", "tabular", "--match", "samples", "--out", str(tmp_path / "out"),
                "--methods", "grpo", "--plugin", "my_credit:LastTurnOnly"])
    assert list(_runs(tmp_path / "out")["tabular|samples"]) == ["grpo", "lastturnonly"]
