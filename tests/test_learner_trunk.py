"""The frozen-trunk cache: when only the last layers train, the layers below run once per trajectory.

Every check compares a learner with the cache against the same learner without it (the full
recomputation, `trunk_cache_mib=0`) on a 4-layer random Qwen2 with the real tokenizer.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.models import _apply_lora, tiny_config
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.training.learner import LLMLearner, frozen_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def four_layers(tiny):
    tokenizer = tiny[1]
    config = tiny_config(tokenizer)
    config.num_hidden_layers = 4
    config.layer_types = ["full_attention"] * 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    return model, tokenizer


def _lora_last(model, k: int):
    model = _apply_lora(copy.deepcopy(model), {"r": 4, "alpha": 8, "last_layers": k})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0; a non-zero adapter makes policy != reference
                p.data.normal_(0, 0.05)
    return model


def _frozen_lower(model, k_trainable: int):
    model = copy.deepcopy(model)
    model.get_input_embeddings().requires_grad_(False)  # tied to the LM head: that freezes the head too
    for layer in model.get_decoder().layers[: len(model.get_decoder().layers) - k_trainable]:
        layer.requires_grad_(False)
    return model


def _learner(model, tokenizer, cache_mib: int, reference=None) -> LLMLearner:
    model = copy.deepcopy(model)
    is_lora = hasattr(model, "disable_adapter")
    if reference is None and not is_lora:
        reference = frozen_copy(model)
    # SGD: Adam would blow float noise in a zero gradient (k_proj's bias) up to full-size steps.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return LLMLearner(
        Accelerator(cpu=True), model, optimizer, pad_token_id=tokenizer.pad_token_id, reference=reference,
        max_tokens_per_microbatch=64, trunk_cache_mib=cache_mib,
    )


def _packed_tokens(batch) -> int:
    return sum(len(t.turns[-1].context_ids) + len(t.turns[-1].response_ids) for t in batch)


def _trained(learner):
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


def test_the_cache_is_on_only_when_the_leading_layers_are_frozen(four_layers):
    model, tokenizer = four_layers
    assert _learner(model, tokenizer, 64).trunk is None  # full fine-tuning: nothing frozen
    assert _learner(_apply_lora(copy.deepcopy(model), {"r": 4}), tokenizer, 64).trunk is None  # LoRA everywhere
    assert _learner(_lora_last(model, 2), tokenizer, 64).trunk.depth == 2
    assert _learner(_lora_last(model, 1), tokenizer, 64).trunk.depth == 3
    assert _learner(_frozen_lower(model, 1), tokenizer, 64).trunk.depth == 3
    assert _learner(_lora_last(model, 2), tokenizer, 0).trunk is None  # trunk_cache_mib=0: off


@pytest.mark.parametrize("setup", ["lora_last_2", "frozen_lower_3"])
def test_every_pass_with_the_cache_equals_the_full_recomputation(four_layers, setup):
    model, tokenizer = four_layers
    model = _lora_last(model, 2) if setup == "lora_last_2" else _frozen_lower(model, 1)
    cached, plain = _learner(model, tokenizer, 64), _learner(model, tokenizer, 0)
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=4, seed=5)
    samples = batch.samples()
    for name, run in {
        "old": lambda learner: learner.logprobs(samples, grad=False),
        "reference": lambda learner: learner.ref_logprobs(samples),
        "with grad": lambda learner: learner.logprobs(samples, grad=True),
    }.items():
        a, b = run(cached), run(plain)
        torch.testing.assert_close(a.logprobs.detach(), b.logprobs.detach(), atol=1e-5, rtol=0, msg=name)
    # SeeUPO's pools: prefix-length gradient passes read the first rows of a trajectory's entry.
    for t in range(batch.max_turns, 0, -1):
        pool = batch.turn_pool(t)
        loss = lambda part, new, values: -(new.logprobs * new.mask).sum() / 100.0  # noqa: E731
        norms = [learner.minimize(pool, loss)["grad_norm"] for learner in (cached, plain)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-4) and norms[0] > 0
    for (name, a), b in zip(_trained(cached).items(), _trained(plain).values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    # The trunk ran once per trajectory, over its longest sequence; every later pass read the cache.
    assert cached.trunk.stats["tokens"] == _packed_tokens(batch)
    assert cached.trunk.stats["hits"] > 0 and cached.trunk.stats["not_cached"] == 0
    assert cached.tokens_fed["policy"] == plain.tokens_fed["policy"]  # the same rows reach the layers above


@pytest.mark.parametrize("name,checkpointing", [("seeupo", False), ("seeupo", True), ("grpo", False)])
def test_an_update_with_the_cache_equals_the_update_without(four_layers, name, checkpointing):
    model, tokenizer = four_layers
    model = _lora_last(model, 2)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    cached, plain = _learner(model, tokenizer, 64), _learner(model, tokenizer, 0)
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=4, seed=7)
    options = {"minibatch_size": 4, "epochs": 2}
    metrics = [make_algorithm(name, options).update(batch, learner, torch.Generator().manual_seed(0))
               for learner in (cached, plain)]
    assert metrics[0].keys() == metrics[1].keys() and "optimizer_steps" in metrics[0]
    for key, value in metrics[1].items():
        assert metrics[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for (param, a), b in zip(_trained(cached).items(), _trained(plain).values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=param)
    assert cached.trunk.stats["tokens"] == _packed_tokens(batch)  # once per trajectory, whatever the passes


def test_a_reference_with_another_trunk_is_scored_in_full(four_layers):
    model, tokenizer = four_layers
    model = _frozen_lower(model, 1)
    reference = frozen_copy(model)
    with torch.no_grad():
        reference.get_decoder().layers[0].mlp.down_proj.weight.mul_(1.5)  # not the policy's trunk
    cached, plain = _learner(model, tokenizer, 64, reference), _learner(model, tokenizer, 0, reference)
    samples = synthetic_batch(seed=3).samples()
    assert not cached.trunk.shares_trunk(reference)
    torch.testing.assert_close(cached.ref_logprobs(samples).logprobs, plain.ref_logprobs(samples).logprobs,
                               atol=1e-5, rtol=0)
    assert cached.ref_logprobs(samples).logprobs.sub(cached.logprobs(samples, grad=False).logprobs).abs().max() > 1e-3


def test_the_cache_holds_at_most_its_budget_and_dies_with_the_batch(four_layers):
    model, tokenizer = four_layers
    model = _lora_last(model, 2)
    cached, plain = _learner(model, tokenizer, 64), _learner(model, tokenizer, 0)
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=4, seed=5)
    per_token = model.config.hidden_size * 4  # float32 states
    cached.trunk.budget_bytes = 40 * per_token  # room for a trajectory or two, not six
    samples = batch.samples()
    for learner in (cached, plain):
        learner.logprobs(samples, grad=False)
    again = cached.logprobs(samples, grad=False).logprobs
    torch.testing.assert_close(again, plain.logprobs(samples, grad=False).logprobs, atol=1e-5, rtol=0)
    assert 0 < cached.trunk.bytes <= cached.trunk.budget_bytes
    assert cached.trunk.stats["not_cached"] > 0  # what did not fit was recomputed, not kept
    assert cached.trunk.stats["tokens"] > _packed_tokens(batch)
    del batch, samples
    gc.collect()
    assert cached.trunk.bytes == 0 and not cached.trunk._entries
