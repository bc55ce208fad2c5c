"""SeeUPO's ratios after pool t measured inside the next pool's first gradient pass: the same
update as a separate frozen pass, with one policy pass fewer per pool (tiny model, real learner)."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.models import load_model
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.training.learner import LLMLearner, frozen_copy


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def run(tiny, options: dict):
    model = copy.deepcopy(tiny[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    learner = LLMLearner(Accelerator(cpu=True), model, optimizer, pad_token_id=tiny[1].pad_token_id,
                         reference=frozen_copy(model), max_tokens_per_microbatch=128)
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.01, **options})
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=3, seed=4)
    algorithm.update(batch, learner, torch.Generator().manual_seed(0))
    return algorithm.schedule, model, learner.tokens_fed["policy"]


@pytest.mark.parametrize("options", [
    {"order": "reverse"},
    {"order": "natural", "m_clip": [0.8, 1.2]},
    {"order": "reverse", "epochs": 2, "minibatch_size": 2, "old_policy": "turn_start"},
])
def test_shared_ratio_pass_gives_the_unshared_update_with_fewer_policy_tokens(tiny, options):
    shared, model_shared, tokens_shared = run(tiny, {**options, "share_ratio_pass": True})
    apart, model_apart, tokens_apart = run(tiny, {**options, "share_ratio_pass": False})
    assert [p.turn for p in shared] == [p.turn for p in apart] and len(shared) >= 2
    for a, b in zip(shared, apart):
        assert a.rollout_ids == b.rollout_ids and a.optimizer_steps == b.optimizer_steps
        assert a.ratios_after.keys() == b.ratios_after.keys()
        for rid in a.ratios_after:
            assert a.ratios_after[rid] == pytest.approx(b.ratios_after[rid], rel=1e-6)
        for rid in a.weights:
            assert a.weights[rid] == pytest.approx(b.weights[rid], rel=1e-6, abs=1e-9)
    assert any(abs(r - 1) > 1e-3 for p in apart for r in p.ratios_after.values())  # M really moved
    for p, q in zip(model_shared.parameters(), model_apart.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    if "minibatch_size" in options:  # only the pool's first minibatch shares: it may hold none of them
        assert tokens_shared <= tokens_apart
    else:
        assert tokens_shared < tokens_apart
