"""The LLM learner (algorithms/learner.py) on the tiny random-init model, one process."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.scoring import response_logprobs
from seeupo_gym.training.learner import LLMLearner, ValueModel, frozen_copy, lm_backbone


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture
def make_learner(tiny):
    def make(lora: dict | None = None, value: bool = False, lr: float = 1e-2) -> tuple[LLMLearner, torch.nn.Module]:
        return _make_learner(tiny, lora, value, lr)

    return make


def _make_learner(tiny, lora, value, lr):
    accelerator = Accelerator(cpu=True)
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    if lora:
        model = get_peft_model(model, LoraConfig(target_modules="all-linear", **lora))
    reference = None if lora else frozen_copy(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    value_model = value_optimizer = None
    if value:
        critic = copy.deepcopy(tiny[0])
        value_model = ValueModel(lm_backbone(critic), critic.config.hidden_size)
        value_optimizer = torch.optim.AdamW(value_model.parameters(), lr=lr)
    learner = LLMLearner(
        accelerator,
        model,
        optimizer,
        pad_token_id=tokenizer.pad_token_id,
        reference=reference,
        value_model=value_model,
        value_optimizer=value_optimizer,
        max_tokens_per_microbatch=40,
    )
    return learner, model


def test_logprobs_equal_teacher_forced_scoring_and_carry_grad(make_learner):
    learner, model = make_learner()
    samples = synthetic_batch().samples()
    out = learner.logprobs(samples, grad=True)
    expected, mask = response_logprobs(
        model, [s.turn.context_ids for s in samples], [s.turn.response_ids for s in samples], pad_token_id=151643
    )
    assert out.logprobs.requires_grad
    assert torch.equal(out.mask, mask)
    torch.testing.assert_close(out.logprobs.detach(), expected, atol=1e-5, rtol=0)
    # The no-grad path runs in micro-batches of at most 40 tokens and gives the same numbers.
    frozen = learner.logprobs(samples, grad=False)
    assert not frozen.logprobs.requires_grad
    torch.testing.assert_close(frozen.logprobs, expected, atol=1e-5, rtol=0)


def test_optimize_changes_policy_but_not_the_full_finetune_reference(make_learner):
    learner, _ = make_learner()
    samples = synthetic_batch().samples()
    before = learner.logprobs(samples, grad=False).logprobs
    ref_before = learner.ref_logprobs(samples).logprobs
    torch.testing.assert_close(before, ref_before)
    new = learner.logprobs(samples)
    metrics = learner.optimize(-(new.logprobs * new.mask).sum() / new.mask.sum())
    assert metrics["grad_norm"] > 0
    after = learner.logprobs(samples, grad=False).logprobs
    mask = learner.logprobs(samples, grad=False).mask
    assert (after[mask] - before[mask]).abs().max() > 1e-3
    torch.testing.assert_close(learner.ref_logprobs(samples).logprobs, ref_before)


def test_lora_reference_is_the_base_with_the_adapter_disabled(make_learner):
    learner, model = make_learner(lora={"r": 4, "lora_alpha": 8})
    samples = synthetic_batch().samples()
    base_before = learner.ref_logprobs(samples).logprobs
    new = learner.logprobs(samples)
    learner.optimize(-(new.logprobs * new.mask).sum() / new.mask.sum())
    mask = new.mask
    after = learner.logprobs(samples, grad=False).logprobs
    ref_after = learner.ref_logprobs(samples).logprobs
    assert (after[mask] - base_before[mask]).abs().max() > 1e-4  # the adapter learned
    torch.testing.assert_close(ref_after, base_before)  # the base did not move
    with model.disable_adapter():
        plain, _ = response_logprobs(
            model, [s.turn.context_ids for s in samples], [s.turn.response_ids for s in samples], pad_token_id=151643
        )
    torch.testing.assert_close(ref_after, plain, atol=1e-5, rtol=0)


def test_values_align_with_logprobs_start_at_zero_and_train(make_learner):
    learner, _ = make_learner(value=True)
    samples = synthetic_batch().samples()
    mask = learner.logprobs(samples, grad=False).mask
    values = learner.values(samples)
    assert values.shape == mask.shape and values.requires_grad
    assert torch.all(values.detach() == 0)  # zero-initialized head
    target = torch.ones_like(values)
    loss = ((values - target) ** 2)[mask].mean()
    metrics = learner.optimize(loss)
    assert metrics["value_grad_norm"] > 0
    trained = learner.values(samples).detach()
    assert trained[mask].mean() > 0 and torch.all(trained[~mask] == 0)


def test_values_without_value_model_is_a_clear_error(make_learner):
    learner, _ = make_learner()
    with pytest.raises(RuntimeError, match="needs_value_model"):
        learner.values(synthetic_batch().samples())


def test_nonfinite_loss_skips_the_step_and_leaves_weights_alone(make_learner):
    learner, model = make_learner()
    samples = synthetic_batch().samples()
    weights = [p.detach().clone() for p in model.parameters()]
    new = learner.logprobs(samples)
    metrics = learner.optimize(new.logprobs.sum() * float("nan"))
    assert metrics == {"skipped_nonfinite": 1.0}
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
