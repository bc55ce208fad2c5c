"""The credit study's regimes: the shared-parameter policy and the long, stochastic TurnBandit suites, against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.shared_policy import SharedPolicy
from seeupo_gym.algorithms.tabular import TabularPolicy, context_ids, expected_batch, sample_batch
from seeupo_gym.turnbandit import make_tasks

torch.set_num_threads(1)


def _randomized(policy: SharedPolicy, seed: int) -> SharedPolicy:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters[:-1]:
            parameter.normal_(generator=generator)
    return policy


def _brute_force_return(task, probs) -> float:
    """sum over chosen and executed sequences of prod pi(a_t | executed history) P(e_t | a_t) r(e)."""
    total = 0.0

    def visit(executed: tuple, weight: float) -> None:
        nonlocal total
        if executed and task.ends(executed):
            total += weight * task.reward(executed)
            return
        pi = probs(executed)
        for a in range(task.num_options):
            for e in range(task.num_options):
                moved = (1 - task.slip if e == a else task.slip / (task.num_options - 1)) if task.slip else float(e == a)
                if moved:
                    visit(executed + (e,), weight * pi[a] * moved)

    visit((), 1.0)
    return total


@pytest.mark.parametrize("variant,turns,options,slip", [("stopping", (2, 3), 3, 0.0), ("ladder", (3, 4), 2, 0.0),
                                                       ("ladder", (2, 3), 2, 0.2), ("stopping", (2, 3), 3, 0.1)])
def test_shared_policy_exact_return_matches_brute_force_over_choices_and_slips(variant, turns, options, slip):
    tasks = make_tasks(variant, 3, seed=1, turns=turns, options=options, slip=slip)
    policy = _randomized(SharedPolicy(tasks), 0)
    table = policy.log_probs_table().exp()
    for k, task in enumerate(tasks):
        brute = _brute_force_return(task, lambda h: table[policy.index[tuple(context_ids(k, h))]].tolist())
        assert policy.exact_return(k) == pytest.approx(brute, rel=1e-6)  # float32 tables
        assert policy.exact_returns()[k] == pytest.approx(brute, rel=1e-6)  # float32 tables
        v, _ = policy.exact_values(k)
        assert v[()] == pytest.approx(brute, rel=1e-6)  # float32 tables


def test_shared_policy_logits_are_the_sum_of_its_shared_and_per_turn_weights():
    tasks = make_tasks("climbing", 2, seed=0, turns=(3, 3))
    policy = _randomized(SharedPolicy(tasks), 1)
    row = policy.index[(1, 2, 0)]  # task 1, turn 3 (0-based 2), previous choice 0
    expected = policy.option + policy.task[1] + policy.previous[0] + policy.task_turn[1, 2]
    assert torch.allclose(policy.logits_table()[row], expected)
    first = policy.index[(1,)]
    assert torch.allclose(policy.logits_table()[first], policy.option + policy.task[1] + policy.previous[3] + policy.task_turn[1, 0])


def _update_on_turn(policy, turn: int) -> None:
    samples = [s for s in sample_batch(policy, 8, torch.Generator().manual_seed(0)).samples() if s.t == turn]
    policy.optimize(-policy.logprobs(samples).logprobs.sum())


def test_an_update_on_one_turn_moves_another_turns_policy_only_when_parameters_are_shared():
    tasks = make_tasks("climbing", 2, seed=0, turns=(3, 3))
    for cls, moves in ((SharedPolicy, True), (TabularPolicy, False)):
        policy = cls(tasks, lr=0.5)
        first_turn = [policy.index[(k,)] for k in range(len(tasks))]
        before = policy.log_probs_table()[first_turn].clone()
        _update_on_turn(policy, 3)  # samples of turn 3 only
        moved = (policy.log_probs_table()[first_turn] - before).abs().max().item()
        assert (moved > 1e-3) if moves else moved == 0.0, (cls.__name__, moved)


def test_shared_policy_runs_every_registered_turn_method_unchanged():
    from seeupo_gym.algorithms.base import available_algorithms, make_algorithm

    tasks = make_tasks("ladder", 2, seed=0, turns=(3, 4), options=2, slip=0.1)
    for name in available_algorithms():
        policy = SharedPolicy(tasks, lr=0.1, optimizer="adam")
        generator = torch.Generator().manual_seed(0)
        make_algorithm(name, {"kl_coef": 0.0}).update(sample_batch(policy, 4, generator), policy, generator)
        assert policy.optimizer_steps >= 1, name


def _best_deterministic_policy_value(task) -> float:
    """max over every deterministic closed-loop policy (an option per executed history) of its exact J."""
    histories = [h for depth in range(task.num_turns) for h in itertools.product(range(task.num_options), repeat=depth)
                 if not (h and task.ends(h)) and not any(task.ends(h[:i]) for i in range(1, len(h)))]
    best = -1.0
    for choice in itertools.product(range(task.num_options), repeat=len(histories)):
        act = dict(zip(histories, choice))
        best = max(best, _brute_force_return(task, lambda h: [float(a == act[h]) for a in range(task.num_options)]))
    return best


@pytest.mark.parametrize("variant,turns,options,slip", [("ladder", (3, 3), 2, 0.0), ("ladder", (2, 3), 2, 0.2),
                                                       ("stopping", (2, 2), 3, 0.1), ("climbing", (2, 2), 2, 0.3)])
def test_new_suites_optimum_is_the_best_deterministic_policy_by_brute_force(variant, turns, options, slip):
    for task in make_tasks(variant, 2, seed=3, turns=turns, options=options, slip=slip):
        assert task.optimal_value == pytest.approx(_best_deterministic_policy_value(task), abs=1e-9)


def test_ladder_is_long_deceptive_and_worth_one_at_its_optimum():
    tasks = make_tasks("ladder", 10, seed=0, turns=(6, 10), options=2)
    assert max(t.num_turns for t in tasks) == 10 and min(t.num_turns for t in tasks) >= 6
    for task in tasks:
        value, actions = task.optimal()
        assert value == 1.0 and task.reward(actions) == 1.0 and len(actions) == task.num_turns
        assert task.deceptive  # the decoy's 0.5 beats climbing under a uniform continuation


def test_existing_tasks_are_unchanged_by_the_new_options():
    # The short tasks draw as before (a sample of the options' texts and rewards pinned here).
    task = make_tasks("climbing", 1, seed=0, turns=(2, 3))[0]
    again = make_tasks("climbing", 1, seed=0, turns=(2, 3), slip=0.0)[0]
    assert task == again and task.slip == 0.0 and math.isclose(task.optimal_value, 1.0)


def test_expected_batch_refuses_stochastic_transitions_and_sampling_keeps_the_chosen_option():
    tasks = make_tasks("ladder", 2, seed=0, turns=(4, 4), options=2, slip=0.5)
    policy = TabularPolicy(tasks)
    with pytest.raises(ValueError, match="slip"):
        expected_batch(policy, 4)
    batch: RolloutBatch = sample_batch(policy, 16, torch.Generator().manual_seed(0))
    slipped = 0
    for trajectory in batch.trajectories:
        executed = tuple(trajectory.turns[t + 1].context_ids[-1] for t in range(len(trajectory.turns) - 1))
        chosen = tuple(turn.response_ids[0] for turn in trajectory.turns[:-1])
        slipped += sum(e != c for e, c in zip(executed, chosen))
    assert slipped > 0  # half the choices slip: some executed option differs from the chosen one
