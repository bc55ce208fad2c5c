"""A user YAML builds on a preset (`extends:`), several --config files merge in order, and a
group of one is refused when the algorithm's baseline is the group."""

from __future__ import annotations

import pytest
import yaml

from seeupo_gym.training.cli import train_main
from seeupo_gym.training.config import ConfigError, load_config


def test_a_yaml_that_extends_a_preset_keeps_the_preset_and_overrides_key_by_key(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: tiny-turnbandit\ntrain: {steps: 7}\nenv: {kwargs: {num_tasks: 3}}\n")
    config = load_config(mine)
    preset = load_config("tiny-turnbandit")
    assert config.train.steps == 7 and config.train.group_size == preset.train.group_size == 2
    assert config.env.id == "seeupo/TurnBandit-v0"
    assert config.env.kwargs == {**preset.env.kwargs, "num_tasks": 3}  # merged, not replaced
    assert config.model.name_or_path == "tiny"


def test_extends_finds_a_file_beside_the_yaml_and_refuses_a_cycle(tmp_path):
    (tmp_path / "base.yaml").write_text("extends: smoke\ntrain: {steps: 5}\n")
    (tmp_path / "top.yaml").write_text("extends: base.yaml\noptim: {lr: 0.5}\n")
    config = load_config(tmp_path / "top.yaml")
    assert (config.train.steps, config.optim.lr, config.env.kwargs["variant"]) == (5, 0.5, "capital")
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_two_config_flags_merge_in_order_the_later_winning(tmp_path, capsys):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("train: {steps: 3, group_size: 4}\noptim: {lr: 0.25}\n")
    second.write_text("train: {steps: 9}\n")
    assert train_main(["--config", "smoke", "--config", str(first), "--config", str(second), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 9  # the last file
    assert printed["train"]["group_size"] == 4 and printed["optim"]["lr"] == 0.25  # the middle one
    assert printed["env"]["kwargs"]["variant"] == "capital"  # the first


@pytest.mark.parametrize("algorithm", ["grpo", "seeupo", "gspo"])
def test_a_group_of_one_is_refused_with_the_reason(algorithm):
    with pytest.raises(ConfigError, match="group_size is 1; .*at least 2 per task.*no baseline"):
        load_config("smoke", ["train.group_size=1", f"algorithm.name={algorithm}"])


def test_a_group_of_one_is_allowed_with_a_value_model():
    assert load_config("smoke", ["train.group_size=1", "algorithm.name=ppo"]).train.group_size == 1
