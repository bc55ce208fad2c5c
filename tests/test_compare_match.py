"""--match steps (seeupo_gym/training/compare/match.py): on the same batch every compared method takes as
many optimizer steps as the one taking the most, through more epochs, on the tabular policy."""

from __future__ import annotations

import torch

from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.budget import CountingLearner
from seeupo_gym.algorithms.tabular import TabularPolicy, sample_batch
from seeupo_gym.training.compare.match import StepMatched
from seeupo_gym.turnbandit import make_tasks

METHODS = ["seeupo", "grpo", "gspo", "ppo", "gigpo"]


def _setup(variant: str, turns: tuple[int, int], seed: int = 0):
    tasks = make_tasks(variant, num_tasks=3, seed=0, turns=turns, options=3, turn_rewards=True)
    policy = TabularPolicy(tasks, lr=0.3, optimizer="adam", observations=True)
    return policy, sample_batch(policy, 4, torch.Generator().manual_seed(seed))


def _counted(name: str, peers: list[str], variant: str, turns: tuple[int, int], options: dict) -> tuple[int, dict]:
    policy, batch = _setup(variant, turns)
    matched = StepMatched(make_algorithm(name, options), [make_algorithm(p, options) for p in peers])
    counter = CountingLearner(policy)
    metrics = matched.update(batch, counter, torch.Generator().manual_seed(7))
    return counter.optimizer_steps, metrics


def test_steps_matching_gives_every_method_the_same_optimizer_steps_on_the_same_batch():
    # Three-turn episodes: SeeUPO takes 3 pools x 1 minibatch; the others 1 step per epoch, raised to 3.
    counts = {name: _counted(name, METHODS, "follow", (3, 3), {})[0] for name in METHODS}
    assert set(counts.values()) == {3}, counts


def test_without_matching_the_same_batch_gives_seeupo_a_step_per_pool_and_the_others_one():
    policy, batch = _setup("follow", (3, 3))
    counts = {}
    for name in METHODS:
        counter = CountingLearner(policy)
        make_algorithm(name).update(batch, counter, torch.Generator().manual_seed(7))
        counts[name] = counter.optimizer_steps
    assert counts == {"seeupo": 3, "grpo": 1, "gspo": 1, "ppo": 1, "gigpo": 1}


def test_a_target_that_is_no_multiple_of_an_epochs_steps_gets_the_next_whole_epoch():
    # minibatch_size 5 over 12 three-turn episodes (36 samples, 2 trajectories per minibatch): GRPO 6 steps
    # per epoch; SeeUPO 3 pools x 3 minibatches of 5, 5, 2 = 9. GRPO: 2 epochs, 12 steps (>= 9, < 9 + 6).
    options = {"minibatch_size": 5}
    steps, metrics = _counted("grpo", ["seeupo", "grpo"], "follow", (3, 3), options)
    assert metrics["budget_target_steps"] == 9.0 and metrics["budget_epochs"] == 2.0
    assert steps == 12
    assert _counted("seeupo", ["seeupo", "grpo"], "follow", (3, 3), options)[0] == 9


def test_the_method_with_the_most_steps_keeps_its_own_epochs_and_ragged_batches_match_too():
    steps, metrics = _counted("seeupo", ["seeupo", "grpo"], "stopping", (3, 3), {"epochs": 2})
    assert metrics["budget_epochs"] == 2.0 and steps == metrics["budget_target_steps"]
    grpo_steps, grpo_metrics = _counted("grpo", ["seeupo", "grpo"], "stopping", (3, 3), {"epochs": 2, "minibatch_size": 4})
    assert grpo_metrics["budget_matched"] == 1.0 and grpo_steps >= grpo_metrics["budget_target_steps"]


def test_a_step_matched_algorithm_is_the_wrapped_one_to_the_trainer():
    algorithm = make_algorithm("seeupo")
    matched = StepMatched(algorithm, [algorithm])
    matched.schedule = []
    assert matched.name == "seeupo" and matched.schedule is algorithm.schedule
    assert matched.state_dict() == algorithm.state_dict() and matched.needs_value_model is False
