"""Reverse SeeUPO on exact (expected) batches of TurnBandit `stopping` suites beyond the default
suite's K=3 one (tests/test_tabular.py): more options, one-turn tasks, five options. Every task
within 1% of J*, whether its optimum stops first, at a later stop, or goes on to the end."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.tabular import TabularPolicy, expected_batch
from seeupo_gym.turnbandit import make_tasks


@pytest.mark.slow
@pytest.mark.parametrize("suite", [dict(seed=1, options=4), dict(seed=2, turns=(1, 4)),
                                   dict(seed=3, options=5, turns=(3, 4))], ids=["K4", "T1-4", "K5"])
def test_reverse_seeupo_reaches_the_optimum_of_every_stopping_instance_on_expected_batches(suite):
    tasks = make_tasks("stopping", 9, **suite)
    ends = {"first" if len(a) == 1 else "end" if len(a) == t.num_turns and a[-1] != t.stops[-1] else "later"
            for t in tasks for a in [t.optimal()[1]]}
    assert ends == {"first", "later", "end"} and any(t.deceptive for t in tasks)
    policy = TabularPolicy(tasks, lr=0.1, optimizer="adam")
    algorithm = make_algorithm("seeupo", {"order": "reverse", "kl_coef": 0.0, "minibatch_size": 10_000})
    generator = torch.Generator().manual_seed(0)
    start = [policy.exact_return(k) / t.optimal_value for k, t in enumerate(tasks)]
    for _ in range(50):
        algorithm.update(expected_batch(policy, 100), policy, generator)
    ratios = [policy.exact_return(k) / t.optimal_value for k, t in enumerate(tasks)]
    assert min(start) < 0.9 and min(ratios) >= 0.99, ratios
