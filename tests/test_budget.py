"""Update budgets (algorithms/budget.py): every registered algorithm predicts the optimizer steps,
gradient passes and gradient tokens its update spends, and the counting learner holds it to them."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import seeupo_gym.algorithms as kit
from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, UpdatePhase, algorithm_class, available_algorithms, load_plugin, make_algorithm
from seeupo_gym.algorithms.budget import CountingLearner, UpdateBudget, minibatch_cut
from seeupo_gym.algorithms.tabular import TabularPolicy, expected_batch, sample_batch
from seeupo_gym.turnbandit import make_tasks

ROOT = Path(__file__).resolve().parents[1]


def _shipped_algorithms() -> list[str]:
    """Every algorithm the kit ships (each module of the package imported, so a new one registers) and
    the docs' plug-in example; other test files register throwaway algorithms that are left out."""
    for module in pkgutil.iter_modules(kit.__path__):
        importlib.import_module(f"seeupo_gym.algorithms.{module.name}")
    load_plugin(ROOT / "docs" / "examples" / "rloo.py")
    return [name for name in available_algorithms()
            if algorithm_class(name).__module__.startswith(("seeupo_gym.algorithms.", "seeupo_plugin_rloo"))]


ALGORITHMS = _shipped_algorithms()


def _ragged_setup(microbatch_samples: int | None = None) -> tuple[TabularPolicy, object]:
    """TurnBandit `stopping`: episodes of 1 to 3 turns, sampled, with turn rewards and observations."""
    tasks = make_tasks("stopping", num_tasks=3, seed=0, turns=(3, 3), options=3, turn_rewards=True)
    policy = TabularPolicy(tasks, lr=0.3, optimizer="adam", observations=True, microbatch_samples=microbatch_samples)
    batch = sample_batch(policy, 4, torch.Generator().manual_seed(1))
    return policy, batch


def test_the_ragged_batch_has_episodes_of_several_lengths():
    _, batch = _ragged_setup()
    assert len({t.num_turns for t in batch}) > 1


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("epochs,minibatch_size", [(1, 64), (2, 5)])
def test_every_registered_algorithm_spends_the_budget_it_predicts(name, epochs, minibatch_size):
    policy, batch = _ragged_setup()
    algorithm = make_algorithm(name, {"epochs": epochs, "minibatch_size": minibatch_size})
    generator = torch.Generator().manual_seed(3)
    predicted = algorithm.budget(batch, generator)
    counter = CountingLearner(policy)
    algorithm.update(batch, counter, generator)
    assert predicted is not None, f"{name} cannot predict its budget"
    assert predicted == counter.budget()
    assert counter.optimizer_steps == policy.optimizer_steps > 0
    assert counter.gradient_tokens >= epochs * sum(t.num_turns for t in batch)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_registered_algorithm_predicts_without_a_generator_where_the_cut_is_fixed(name):
    # Every episode 3 turns long: how minibatches of whole trajectories cut does not depend on the shuffle.
    tasks = make_tasks("follow", num_tasks=2, seed=0, turns=(3, 3), options=3, turn_rewards=True)
    policy = TabularPolicy(tasks, lr=0.3, optimizer="adam", observations=True)
    batch = sample_batch(policy, 4, torch.Generator().manual_seed(2))
    algorithm = make_algorithm(name, {"epochs": 3, "minibatch_size": 7})
    predicted = algorithm.budget(batch)
    counter = CountingLearner(policy)
    algorithm.update(batch, counter, torch.Generator().manual_seed(5))
    assert predicted == counter.budget()


def test_seeupo_takes_epochs_times_minibatches_per_non_empty_turn_pool():
    _, batch = _ragged_setup()
    pools = [len(batch.turn_pool(t)) for t in range(1, batch.max_turns + 1)]
    budget = make_algorithm("seeupo", {"epochs": 2, "minibatch_size": 5}).budget(batch)
    assert budget.optimizer_steps == 2 * sum(-(-n // 5) for n in pools if n)
    assert budget.gradient_tokens == 2 * batch.num_response_tokens()
    # GRPO on the same batch: one pass over every sample per epoch.
    assert make_algorithm("grpo", {"epochs": 2}).budget(batch).optimizer_steps == 2


def test_seeupo_does_not_count_the_ratios_it_measures_inside_a_gradient_pass():
    policy, batch = _ragged_setup()  # one part per minimize: the ratios after a pool ride in the next pass
    assert policy.measures_alongside
    counter = CountingLearner(policy)
    make_algorithm("seeupo").update(batch, counter, torch.Generator().manual_seed(0))
    assert counter.gradient_tokens == batch.num_response_tokens()
    # Cut into parts, the learner measures them apart: the same count.
    policy, batch = _ragged_setup(microbatch_samples=2)
    counter = CountingLearner(policy)
    make_algorithm("seeupo").update(batch, counter, torch.Generator().manual_seed(0))
    assert counter.gradient_tokens == batch.num_response_tokens()


def test_the_single_phase_cut_is_unpredictable_without_the_generator_only_for_ragged_batches_over_several_minibatches():
    _, batch = _ragged_setup()
    samples = batch.samples()
    assert minibatch_cut(samples, 5, 1) is None
    assert minibatch_cut(samples, len(samples), 2) == UpdateBudget(2, 2, 2 * len(samples))
    assert make_algorithm("grpo", {"minibatch_size": 5}).budget(batch) is None
    assert make_algorithm("grpo", {"minibatch_size": 5}).budget(batch, torch.Generator().manual_seed(0)) is not None


def test_an_update_that_selects_nothing_predicts_and_spends_nothing():
    policy, batch = _ragged_setup()
    for trajectory in batch:
        trajectory.truncated = True
    from seeupo_gym.algorithms.base import UpdateSelection

    algorithm = algorithm_class("seeupo")({}, selection=UpdateSelection(truncated="mask"))
    counter = CountingLearner(policy)
    algorithm.update(batch, counter, torch.Generator().manual_seed(0))
    assert algorithm.budget(batch) == counter.budget() == UpdateBudget()


class _OneGraphReinforce(Algorithm):
    """A user algorithm on the simple path: one `logprobs(grad=True)` graph and one `optimize`."""

    def update(self, batch, learner, generator):
        samples = batch.samples()
        new = learner.logprobs(samples)
        weights = core.per_sample(core.trajectory_advantages(batch, "none"), samples, new.logprobs)
        loss = -(core.masked_mean(new.logprobs, new.mask, dim=-1) * weights).mean()
        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), {}, 1))
        return learner.optimize(loss)


def test_the_counting_learner_counts_the_simple_path_and_leaves_frozen_passes_out():
    policy, batch = _ragged_setup()
    counter = CountingLearner(policy)
    core.frozen_logprobs(counter, batch.samples())  # no autograd: no gradient pass
    _OneGraphReinforce().update(batch, counter, torch.Generator())
    assert counter.budget() == UpdateBudget(1, 1, batch.num_response_tokens())
    assert _OneGraphReinforce().budget(batch) == counter.budget()  # the default fits it: one step over the batch
    counter.reset()
    assert counter.budget() == UpdateBudget()


def test_a_step_a_stand_in_learner_reports_skipping_still_counts_as_asked_and_is_counted_apart():
    policy, batch = _ragged_setup()
    for trajectory in batch:  # one reward everywhere: zero advantages
        trajectory.reward = 0.5

    class ZeroGradientSkipping:  # a learner that reports skipping a zero-gradient step, as the trainer's does
        def __getattr__(self, name):
            return getattr(policy, name)

        def minimize(self, samples, loss, **kwargs):
            policy.minimize(samples, loss, **kwargs)
            return {"skipped_no_gradient": 1.0}

    counter = CountingLearner(ZeroGradientSkipping())
    make_algorithm("grpo", {"kl_coef": 0.0}).update(batch, counter, torch.Generator())
    assert counter.optimizer_steps == 1 and counter.skipped_steps == 1


def test_the_counting_learner_is_the_wrapped_learner_for_everything_else():
    policy, batch = _ragged_setup()
    counter = CountingLearner(policy)
    assert counter.measures_alongside is policy.measures_alongside
    assert counter.exact_return(0) == policy.exact_return(0)
    expected = expected_batch(policy, 2)
    assert torch.equal(counter.logprobs(expected.samples(), grad=False).logprobs,
                       policy.logprobs(expected.samples(), grad=False).logprobs)
