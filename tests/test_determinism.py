"""Every frozen pass of the policy and the reference is deterministic, in every configuration.

Ratios (PPO's rho, GSPO's s(y), SeeUPO's M) compare two passes of the same weights; any dropout
left on would make them differ where nothing changed. Presets that name the embedded model run
here with the tiny model, keeping their LoRA, dtype and gradient-checkpointing settings.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.models import load_model
from seeupo_gym.training.config import ConfigError, load_config, presets
from seeupo_gym.training.policy import build_policy, disable_dropout


def _tiny_overrides(preset: str) -> list[str]:
    config = load_config(preset)
    overrides = ["model.name_or_path=tiny", "model.dtype=float32"]
    if config.model.lora is not None:
        # Module patterns written for the 24-layer embedded model match nothing in the 2-layer one.
        overrides.append("model.lora.target_modules=all-linear")
    return overrides


def _frozen_passes_bitwise_equal(policy, samples) -> None:
    learner = policy.learner
    first, second = learner.logprobs(samples, grad=False), learner.logprobs(samples, grad=False)
    assert torch.equal(first.logprobs, second.logprobs)
    ref_first, ref_second = learner.ref_logprobs(samples), learner.ref_logprobs(samples)
    assert torch.equal(ref_first.logprobs, ref_second.logprobs)
    # Before any update the policy is the reference: the same numbers from either pass.
    assert torch.equal(first.logprobs, ref_first.logprobs)


# Every preset on the tiny model: the full-fine-tuning and LoRA smoke presets in the default suite,
# the rest (the same code paths with other numbers) in the slow suite.
FAST_PRESETS = ("tiny-cpu", "demo")


@pytest.mark.parametrize("preset", [pytest.param(p, marks=() if p in FAST_PRESETS else pytest.mark.slow) for p in presets()])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_two_frozen_passes_are_bitwise_equal_for_every_preset(preset, gradient_checkpointing):
    config = load_config(preset, [*_tiny_overrides(preset), f"model.gradient_checkpointing={gradient_checkpointing}"])
    policy = build_policy(config, Accelerator(cpu=True), needs_value_model=False)
    # Gradient checkpointing keeps the model in train mode, where dropout would act.
    assert policy.model.training == gradient_checkpointing
    _frozen_passes_bitwise_equal(policy, synthetic_batch(seed=1).samples())


def test_gradient_checkpointing_with_lora_passes_are_bitwise_equal():
    config = load_config("tiny-cpu", ["model.lora={r: 4, alpha: 8}", "model.gradient_checkpointing=true"])
    policy = build_policy(config, Accelerator(cpu=True), needs_value_model=False)
    assert policy.model.training and hasattr(policy.model, "disable_adapter")
    _frozen_passes_bitwise_equal(policy, synthetic_batch(seed=2).samples())


def test_disable_dropout_makes_a_train_mode_model_with_lora_dropout_deterministic():
    model, _ = load_model("tiny", seed=0, lora={"r": 4, "alpha": 8, "dropout": 0.5})
    model.config.attention_dropout = 0.5
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    model.train()
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        noisy = [model(input_ids=ids).logits for _ in range(2)]
    assert not torch.equal(*noisy)  # the test can fail: dropout does act in train mode
    disable_dropout(model)
    with torch.no_grad():
        quiet = [model(input_ids=ids).logits for _ in range(2)]
    assert torch.equal(*quiet)
    assert model.config.attention_dropout == 0.0


def test_lora_dropout_is_refused_with_the_key_named():
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout"):
        load_config("tiny-cpu", ["model.lora={r: 4, alpha: 8, dropout: 0.05}"])
