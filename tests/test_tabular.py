"""The tabular softmax learner and exact TurnBandit evaluation; SeeUPO's improvement and convergence on it."""

import itertools
import math

import pytest
import torch

from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.tabular import TabularPolicy, context_ids, expected_batch, sample_batch
from seeupo_gym.turnbandit import make_tasks

torch.set_num_threads(1)


def test_logprobs_follow_the_table_and_autograd_only_when_asked():
    tasks = make_tasks("random", 2, seed=0, turns=(2, 2), options=3)
    policy = TabularPolicy(tasks)
    with torch.no_grad():
        policy.logits[policy.index[(1, 2)]] = torch.tensor([0.0, math.log(2.0), math.log(5.0)])
    batch = sample_batch(policy, 4, torch.Generator().manual_seed(0))
    samples = batch.samples()
    out = policy.logprobs(samples)
    assert out.logprobs.shape == (len(samples), 1) and out.mask.all() and out.logprobs.requires_grad
    assert not policy.logprobs(samples, grad=False).logprobs.requires_grad
    assert policy.probs(1, (2,)).tolist() == pytest.approx([1 / 8, 2 / 8, 5 / 8])
    for s, lp in zip(samples, out.logprobs[:, 0].tolist()):
        assert lp == pytest.approx(s.turn.sample_logprobs[0])  # what the sampler saw


def test_reference_is_the_initial_table_and_optimize_moves_the_policy_only():
    tasks = make_tasks("climbing", 1, seed=0)
    policy = TabularPolicy(tasks, lr=1.0)
    samples = sample_batch(policy, 8, torch.Generator().manual_seed(1)).samples()
    ref_before = policy.ref_logprobs(samples).logprobs.clone()
    loss = -policy.logprobs(samples).logprobs.sum() + (policy.values(samples) ** 2).sum()
    metrics = policy.optimize(loss)
    assert metrics["grad_norm"] > 0 and policy.optimizer_steps == 1
    assert not torch.allclose(policy.logprobs(samples, grad=False).logprobs, ref_before)
    assert torch.equal(policy.ref_logprobs(samples).logprobs, ref_before)


def test_exact_return_enumerates_joint_actions():
    tasks = make_tasks("mixed", 3, seed=2)
    policy = TabularPolicy(tasks)
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(0))
    for k, task in enumerate(tasks):
        table = policy.log_probs_table().exp()
        brute = 0.0
        for actions in itertools.product(range(task.num_options), repeat=task.num_turns):
            p = math.prod(float(table[policy.index[tuple(context_ids(k, actions[:t]))], a]) for t, a in enumerate(actions))
            brute += p * task.reward(actions)
        assert policy.exact_return(k) == pytest.approx(brute)
        assert sum(policy.joint_action_probabilities(k).values()) == pytest.approx(1.0)


def test_exact_values_are_consistent_with_the_exact_return():
    tasks = make_tasks("mixed", 2, seed=3)
    policy = TabularPolicy(tasks)
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(1))
    for k, task in enumerate(tasks):
        v, q = policy.exact_values(k)
        assert v[()] == pytest.approx(policy.exact_return(k))
        best, actions = task.optimal()
        assert q[actions] == best
        # V(h) is the policy-weighted mean of Q(h, a) at every history.
        for history, value in v.items():
            probs = policy.probs(k, history).tolist()
            assert value == pytest.approx(sum(p * q[history + (a,)] for a, p in enumerate(probs)))
        # A Monte-Carlo-free check of Q at the first turn: the return conditioned on a_1.
        joint = policy.joint_action_probabilities(k)
        for a in range(task.num_options):
            mass = sum(p for acts, p in joint.items() if acts[0] == a)
            conditional = sum(p * task.reward(acts) for acts, p in joint.items() if acts[0] == a) / mass
            assert q[(a,)] == pytest.approx(conditional)


def test_sampled_batches_follow_the_policy():
    tasks = make_tasks("random", 1, seed=0, turns=(2, 2), options=2)
    policy = TabularPolicy(tasks)
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(4))
    batch = sample_batch(policy, 4000, torch.Generator().manual_seed(0))
    mean_reward = sum(t.reward for t in batch) / len(batch)
    assert mean_reward == pytest.approx(policy.exact_return(0), abs=0.03)  # ~4 standard errors


def test_expected_batch_has_g_rollouts_per_task_in_proportion_to_the_policy():
    tasks = make_tasks("mixed", 2, seed=0)
    policy = TabularPolicy(tasks)
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(0))
    batch = expected_batch(policy, 500)
    for k, task in enumerate(tasks):
        group = batch.groups()[task.task_id]
        assert len(group) == 500
        probs = policy.joint_action_probabilities(k)
        for actions, p in probs.items():
            count = sum(tuple(turn.response_ids[0] for turn in t.turns) == actions for t in group)
            assert abs(count - 500 * p) < 1.0


def test_policy_rejects_a_context_it_does_not_know():
    tasks = make_tasks("random", 1, seed=0)
    other = sample_batch(TabularPolicy(make_tasks("random", 2, seed=0)), 1, torch.Generator()).samples()
    with pytest.raises(KeyError, match="context"):
        TabularPolicy(tasks).logprobs([s for s in other if s.turn.context_ids[0] == 1])


# --- SeeUPO on exact(ly expected) batches --------------------------------------------------------------


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_seeupo_exact_return_never_decreases_with_small_steps(order):
    # Deterministic batches that follow the policy (no sampling noise), small SGD steps.
    tasks = make_tasks("mixed", 4, seed=1, turns=(2, 3))
    policy = TabularPolicy(tasks, lr=2.0)
    algorithm = make_algorithm("seeupo", {"order": order, "kl_coef": 0.0, "minibatch_size": 10_000})
    generator = torch.Generator().manual_seed(0)
    returns = [[policy.exact_return(k) for k in range(len(tasks))]]
    for _ in range(15):
        algorithm.update(expected_batch(policy, 200), policy, generator)
        returns.append([policy.exact_return(k) for k in range(len(tasks))])
    for before, after in zip(returns, returns[1:]):
        for k in range(len(tasks)):
            assert after[k] >= before[k] - 1e-9, (k, before[k], after[k])
    assert all(returns[-1][k] > returns[0][k] + 0.05 for k in range(len(tasks)))  # and it did improve


def run_seeupo(tasks, batches, iterations: int, seed: int = 0, lr: float = 0.1, **options) -> TabularPolicy:
    policy = TabularPolicy(tasks, lr=lr, optimizer="adam")
    algorithm = make_algorithm("seeupo", {"order": "reverse", "kl_coef": 0.0, "minibatch_size": 10_000, **options})
    generator = torch.Generator().manual_seed(seed)
    for _ in range(iterations):
        algorithm.update(batches(policy, generator), policy, generator)
    return policy


def test_reverse_seeupo_reaches_the_optimum_of_every_deceptive_instance_on_expected_batches():
    tasks = make_tasks("climbing", 4, seed=0, turns=(2, 3))
    assert all(t.deceptive for t in tasks)
    policy = run_seeupo(tasks, lambda p, g: expected_batch(p, 100), iterations=50)
    ratios = [policy.exact_return(k) / t.optimal_value for k, t in enumerate(tasks)]
    assert min(ratios) >= 0.99, ratios


# Finding (see the report): with sampled batches the claim does not hold for every seed. On the 8-task
# climbing suite (task seed 0, K=3, T=2..4), G=32, Adam lr 0.1, 200 iterations, reverse SeeUPO ends within 1%
# of J* on 23 of 24 (seed, task) runs; seed 2 collapses on task climbing-0-5's decoy first option
# (J/J* = 0.80): once the first turn stops sampling the optimal option, its continuation gets no samples
# and cannot learn that the optimum lies behind it. Exact (expected) batches do not collapse (test above).
@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="sampled SeeUPO can collapse on a deceptive decoy (finding)")
def test_reverse_seeupo_reaches_the_optimum_on_every_deceptive_instance_for_every_seed():
    tasks = make_tasks("climbing", 8, seed=0)
    misses = []
    for seed in range(3):
        policy = run_seeupo(tasks, lambda p, g: sample_batch(p, 32, g), iterations=200, seed=seed)
        misses += [(seed, t.task_id, round(policy.exact_return(k), 3)) for k, t in enumerate(tasks) if policy.exact_return(k) < 0.99 * t.optimal_value]
    assert misses == []


# --- episodes whose length the policy chooses (TurnBandit `stopping`) ------------------------------


def test_exact_return_of_a_stopping_task_is_the_return_of_the_policy_played_through_the_env():
    """An independent exact return: the probability of every path the env plays (reset, step until it
    ends, the stop included) times the reward the env pays, summed."""
    from seeupo_gym.turnbandit import LABELS, TurnBanditEnv

    env = TurnBanditEnv(variant="stopping", num_tasks=6, seed=0)
    policy = TabularPolicy(env.tasks)
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(0))
    table = policy.log_probs_table().exp()
    for k, task in enumerate(env.tasks):
        total, lengths = 0.0, set()

        def play(prefix, p):
            nonlocal total
            for a in range(task.num_options):
                env.reset(options={"task_id": task.task_id})
                for earlier in (*prefix, a):
                    _, reward, terminated, _, _ = env.step(LABELS[earlier])
                q = p * float(table[policy.index[tuple(context_ids(k, prefix))], a])
                if terminated:
                    total += q * reward
                    lengths.add(len(prefix) + 1)
                else:
                    play((*prefix, a), q)

        play((), 1.0)
        assert policy.exact_return(k) == pytest.approx(total, abs=1e-12)
        assert sum(policy.joint_action_probabilities(k).values()) == pytest.approx(1.0)
        assert len(lengths) > 1  # episodes of several lengths
        v, q = policy.exact_values(k)
        assert v[()] == pytest.approx(total, abs=1e-12)
        assert q[(task.stops[0],)] == task.reward((task.stops[0],))


def test_sampled_and_expected_batches_of_stopping_tasks_end_at_the_stop():
    tasks = make_tasks("stopping", 6, seed=0)
    policy = TabularPolicy(tasks)
    for batch in (sample_batch(policy, 64, torch.Generator().manual_seed(0)), expected_batch(policy, 64)):
        lengths = [t.num_turns for t in batch]
        assert min(lengths) == 1 and max(lengths) == max(t.num_turns for t in tasks)
        for trajectory in batch:
            k = int(trajectory.turns[0].context_ids[0])
            actions = tuple(turn.response_ids[0] for turn in trajectory.turns)
            assert tasks[k].ends(actions) and not any(tasks[k].ends(actions[:n]) for n in range(1, len(actions)))
            assert trajectory.reward == tasks[k].reward(actions)


def test_reverse_seeupo_reaches_the_optimum_of_every_stopping_instance_on_expected_batches():
    """Stopping first is a sure mid-size decoy; the optimum goes on to the end, stops later, or is
    the first stop (task index mod 3). Exact (expected) batches: within 1% of J* on every task."""
    tasks = make_tasks("stopping", 9, seed=0, turns=(2, 4))
    assert {len(t.optimal()[1]) < t.num_turns for t in tasks} == {True, False}
    assert any(t.deceptive for t in tasks)
    policy = run_seeupo(tasks, lambda p, g: expected_batch(p, 100), iterations=50)
    ratios = [policy.exact_return(k) / t.optimal_value for k, t in enumerate(tasks)]
    assert min(ratios) >= 0.99, ratios


def test_the_study_script_writes_its_table_and_curves(tmp_path, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "turnbandit_study.py"
    args = [str(script), "--out", str(tmp_path), "--num-tasks", "2", "--seeds", "1", "--iterations", "3",
            "--rollouts", "4", "--only", "seeupo reverse/batch", "grpo"]
    monkeypatch.setattr(sys, "argv", args)
    runpy.run_path(str(script), run_name="__main__")
    table = (tmp_path / "results.md").read_text()
    assert "| seeupo reverse/batch |" in table and "| grpo |" in table and "| ppo |" not in table
    assert (tmp_path / "curves.png").stat().st_size > 1000
