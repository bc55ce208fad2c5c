"""Training configs: YAML + dotted overrides -> dataclasses; bad keys and values are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from seeupo_gym.training.config import Config, ConfigError, config_from_dict, load_config, save_config
from seeupo_gym.training.trainer import build_algorithm

from seeupo_gym.training.config import PRESETS_DIR as CONFIGS


def test_defaults_are_the_papers():
    config = Config()
    assert config.optim.lr == 1e-6
    assert config.train.tasks_per_step == 32 and config.train.group_size == 8
    assert config.env.kwargs["max_turns"] == 10
    algorithm = build_algorithm(config)
    assert algorithm.name == "seeupo"
    assert algorithm.config.clip_low == 0.2 and algorithm.config.clip_high == 0.2
    assert algorithm.config.kl_coef == 0.002


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_build_their_algorithm(path):
    config = load_config(path)
    build_algorithm(config)


def test_dotted_overrides_parse_values_as_yaml(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("optim:\n  lr: 1e-6\nalgorithm:\n  name: seeupo\n  order: natural\n")
    config = load_config(
        file,
        ["optim.lr=3e-5", "model.lora.r=4", "env.train_tasks=[a, b]", "algorithm.name=grpo", "algorithm.epochs=2",
         "resume_from=null", "log.trackers=[]"],
    )
    assert config.optim.lr == pytest.approx(3e-5)  # YAML 1.1 reads 1e-6 as a string; still a float
    assert config.model.lora is not None and config.model.lora.r == 4 and config.model.lora.alpha == 32
    assert config.env.train_tasks == ["a", "b"]
    assert config.algorithm.name == "grpo"
    # The file's seeupo-only `order` survives the name override and is rejected by GRPO by name.
    assert config.algorithm.options == {"order": "natural", "epochs": 2}
    with pytest.raises(ConfigError, match="order"):
        build_algorithm(config)
    assert config.log.trackers == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", r"unknown key\(s\) optim.lrr; allowed in optim: beta1, beta2, eps, lr"),
        ("model.dtype=int8", r"model.dtype is 'int8'; allowed: 'float32', 'bfloat16' or 'float16'"),
        ("train.steps=many", r"train.steps must be an integer, got 'many'"),
        ("train.steps=0", r"train.steps must be > 0"),
        ("sampling.top_p=2", r"sampling.top_p must be in \(0, 1\]"),
        ("env.train_tasks=[]", r"env.train_tasks is an empty list"),
        ("wandb=1", r"unknown key\(s\) wandb; allowed in the top level: algorithm, env, generation, log, model"),
        ("optim=3", r"optim must be a mapping"),
        ("lr", r"not of the form dotted.key=value"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_algorithm_and_unknown_algorithm_option_are_named():
    with pytest.raises(ConfigError, match=r"unknown algorithm 'sppo'; registered: \[.*'grpo'.*'seeupo'"):
        build_algorithm(config_from_dict({"algorithm": {"name": "sppo"}}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) algorithm.kl; allowed in algorithm: .*kl_coef"):
        build_algorithm(config_from_dict({"algorithm": {"name": "seeupo", "kl": 0.1}}))
    with pytest.raises(ConfigError, match="order must be one of"):
        build_algorithm(config_from_dict({"algorithm": {"name": "seeupo", "order": "sideways"}}))


def test_missing_file_bad_yaml_and_missing_plugin_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"plugins: loading '.*missing_algo.py' failed"):
        build_algorithm(config_from_dict({"plugins": [str(tmp_path / "missing_algo.py")]}))


def test_saved_config_loads_back_identically(tmp_path):
    config = load_config(CONFIGS / "qwen0.5b-lora-cpu.yaml", ["algorithm.order=random"])
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == config


def test_an_exponent_without_a_dot_is_a_float_everywhere():
    config = load_config("tiny-cpu", ["algorithm.kl_coef=1e-3", "optim.lr=2E-4", "env.kwargs={max_turns: 2, scale: 5e-1}"])
    assert config.algorithm.options["kl_coef"] == 1e-3  # YAML 1.1 would read the string '1e-3'
    assert config.optim.lr == 2e-4 and config.env.kwargs["scale"] == 0.5
    assert build_algorithm(config).config.kl_coef == 1e-3


def test_algorithm_options_are_typed_and_named_like_the_rest(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.kl_coef must be a number, got 'lots'"):
        build_algorithm(config_from_dict({"algorithm": {"name": "grpo", "kl_coef": "lots"}}))
    with pytest.raises(ConfigError, match=r"algorithm.epochs must be an integer, got 1.5"):
        build_algorithm(config_from_dict({"algorithm": {"name": "seeupo", "epochs": 1.5}}))
    assert build_algorithm(config_from_dict({"algorithm": {"name": "seeupo", "m_clip": [0.8, 1.2]}})).config.m_clip == (0.8, 1.2)


def test_seeupo_train_with_kl_coef_1e_3_trains(tmp_path):
    import json

    from seeupo_gym.training.cli import train_main

    code = train_main(["--config", "tiny-turnbandit", "algorithm.kl_coef=1e-3", "train.steps=1", "train.save_every=0",
                       f"log.output_dir={tmp_path}", "log.progress_bars=false"])
    assert code == 0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and "update/kl" in record
    assert load_config(tmp_path / "config.yaml").algorithm.options["kl_coef"] == 1e-3
