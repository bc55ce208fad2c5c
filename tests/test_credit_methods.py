"""The turn-level credit methods (docs/credit.md): advantages computed by hand on small batches, and
each method training the tabular policy on TurnBandit through the kit's interface."""

from __future__ import annotations

import math

import pytest
import torch

from seeupo_gym.algorithms.base import available_algorithms, make_algorithm
from seeupo_gym.algorithms.broadcast import rloo_advantages
from seeupo_gym.algorithms.gigpo import gigpo_advantages
from seeupo_gym.algorithms.mt_grpo import mt_grpo_advantages
from seeupo_gym.algorithms.mt_grpo_atropos import mt_grpo_atropos_advantages
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.tabular import TabularPolicy, expected_batch
from seeupo_gym.algorithms.turn_gae import turn_level_gae
from seeupo_gym.turnbandit import make_tasks


def _traj(rid: str, group: str, actions: list[int], reward: float, *, turn_rewards=None, observations=None) -> Trajectory:
    turns = [Turn(context_ids=[0, *actions[:t]], response_ids=[a], sample_logprobs=[0.0]) for t, a in enumerate(actions)]
    info = {}
    if turn_rewards is not None:
        info["turn_rewards"] = turn_rewards
    if observations is not None:
        info["observations"] = observations
    return Trajectory(group, group, rid, turns, reward, reward >= 1, info=info)


CREDIT_METHODS = [
    "gigpo", "mt_grpo", "mt_grpo_atropos", "broadcast", "turn_gae",
    "prime_rl_turn_credit", "nemo_rl_turn_grpo", "roll_step_reinforce",
]


def test_every_credit_method_is_registered_by_name():
    assert set(CREDIT_METHODS) <= set(available_algorithms())


def test_gigpo_episode_term_weighs_by_turns_and_step_term_by_anchor():
    # Group g: a = 2 turns (R=1), b = 1 turn (R=0). Rows: a1, a2, b1 -> episode mean (1+1+0)/3 = 2/3.
    # Anchors: a1 and b1 share context [0] (first turn); a2 is alone -> step term 0.
    # gamma 0.5, reward on the last turn: G(a1) = 0.5, G(a2) = 1, G(b1) = 0. Step group {a1, b1}: mean 0.25.
    # Group h: one trajectory of one turn, R = 0.7: episode mean 0 (one row) -> 0.7; step term 0.
    batch = RolloutBatch([_traj("a", "g", [1, 2], 1.0), _traj("b", "g", [0], 0.0), _traj("c", "h", [1], 0.7)])
    adv = gigpo_advantages(batch, gamma=0.5, step_advantage_w=1.0)
    assert adv[("a", 1)] == pytest.approx(1 / 3 + 0.25)
    assert adv[("a", 2)] == pytest.approx(1 / 3 + 0.0)
    assert adv[("b", 1)] == pytest.approx(-2 / 3 - 0.25)
    assert adv[("c", 1)] == pytest.approx(0.7)


def test_gigpo_repeated_anchor_observations_join_step_groups_across_turn_indices():
    # Observations given: a's turn 2 and b's turn 1 show the same observation "x"; a's turn 1 shows "s".
    # Per-turn rewards: a = [0.5, 0.5], b = [0.0]; gamma 1: G(a1) = 1, G(a2) = 0.5, G(b1) = 0.
    batch = RolloutBatch(
        [
            _traj("a", "g", [1, 2], 1.0, turn_rewards=[0.5, 0.5], observations=["s", "x"]),
            _traj("b", "g", [0], 0.0, turn_rewards=[0.0], observations=["x"]),
        ]
    )
    adv = gigpo_advantages(batch, gamma=1.0, step_advantage_w=2.0)
    episode_a, episode_b = 1 - 2 / 3, 0 - 2 / 3
    assert adv[("a", 1)] == pytest.approx(episode_a + 0.0)  # alone under "s"
    assert adv[("a", 2)] == pytest.approx(episode_a + 2 * (0.5 - 0.25))
    assert adv[("b", 1)] == pytest.approx(episode_b + 2 * (0.0 - 0.25))
    # mean_std_norm: episode std of (1, 1, 0) (unbiased) = sqrt(1/3); step std of (0.5, 0) = sqrt(0.125).
    adv = gigpo_advantages(batch, gamma=1.0, step_advantage_w=1.0, mode="mean_std_norm", epsilon=0.0)
    assert adv[("a", 2)] == pytest.approx((1 / 3) / math.sqrt(1 / 3) + 0.25 / math.sqrt(0.125))


def test_mt_grpo_splits_after_the_first_turn_and_gives_one_turn_rollouts_the_combined_advantage():
    # Group: a = 3 turns [1, 0, 1] (R=2), b = 1 turn [0] (R=0), c = 2 turns [1, 0.5] (R=1.5).
    batch = RolloutBatch(
        [
            _traj("a", "g", [0, 0, 0], 2.0, turn_rewards=[1.0, 0.0, 1.0]),
            _traj("b", "g", [1], 0.0, turn_rewards=[0.0]),
            _traj("c", "g", [2, 2], 1.5, turn_rewards=[1.0, 0.5]),
            _traj("d", "solo", [1, 1], 0.4, turn_rewards=[0.1, 0.3]),
        ]
    )
    adv = mt_grpo_advantages(batch, turn_advantage_coef=0.5)

    def normalized(x, mean, var):  # (x - mean) / (unbiased std + 1e-4)
        return (x - mean) / (math.sqrt(var) + 1e-4)

    # Turn reward r_1: (1, 0, 1), mean 2/3, unbiased var 1/3. Outcome R - r_1: (1, 0, 0.5), mean 0.5, var 1/4.
    # Combined R: (2, 0, 1.5), mean 7/6, var ((5/6)^2 + (7/6)^2 + (1/3)^2) / 2.
    turn_a = normalized(1, 2 / 3, 1 / 3)
    outcome_a, outcome_c = normalized(1, 0.5, 0.25), normalized(0.5, 0.5, 0.25)
    combined_var = ((5 / 6) ** 2 + (7 / 6) ** 2 + (1 / 3) ** 2) / 2
    assert adv[("a", 1)] == pytest.approx(outcome_a + 0.5 * turn_a)
    assert adv[("a", 2)] == adv[("a", 3)] == pytest.approx(outcome_a)
    assert adv[("c", 1)] == pytest.approx(outcome_c + 0.5 * turn_a)
    assert adv[("c", 2)] == pytest.approx(outcome_c)
    # b has one turn: no result message in the source, so the combined advantage.
    assert adv[("b", 1)] == pytest.approx(normalized(0, 7 / 6, combined_var))
    # A group of one: std 0, every term r - r = 0.
    assert adv[("d", 1)] == pytest.approx(0.0) and adv[("d", 2)] == pytest.approx(0.0)


def test_mt_grpo_atropos_normalizes_each_turn_index_with_padded_zeros_and_outcome_alone_on_the_last_turn():
    # Group: a = 3 turns rewards [1, 0, 1] (R=1), b = 1 turn [0] (R=0), c = 2 turns [1, 0.5] (R=0.5).
    batch = RolloutBatch(
        [
            _traj("a", "g", [0, 0, 0], 1.0, turn_rewards=[1.0, 0.0, 1.0]),
            _traj("b", "g", [1], 0.0, turn_rewards=[0.0]),
            _traj("c", "g", [2, 2], 0.5, turn_rewards=[1.0, 0.5]),
            _traj("d", "solo", [1, 1], 0.4, turn_rewards=[0.1, 0.3]),
        ]
    )
    adv = mt_grpo_atropos_advantages(batch, lam=0.5)
    # Outcome: (1, 0, 0.5), mean 0.5, population std sqrt(1/6).
    s = math.sqrt(1 / 6)
    outcome = {"a": 0.5 / s, "b": -0.5 / s, "c": 0.0}
    # Turn index 1: (1, 0, 1): mean 2/3, population std sqrt(2/9).
    t1 = math.sqrt(2 / 9)
    assert adv[("a", 1)] == pytest.approx((1 - 2 / 3) / t1 + 0.5 * outcome["a"])
    assert adv[("c", 1)] == pytest.approx((1 - 2 / 3) / t1 + 0.5 * outcome["c"])
    # Index 2 padded: (0, 0, 0.5): mean 1/6, std sqrt(1/18); a's turn 2 is not its last.
    assert adv[("a", 2)] == pytest.approx((0 - 1 / 6) / math.sqrt(1 / 18) + 0.5 * outcome["a"])
    # Last turns: the outcome term alone.
    assert adv[("a", 3)] == pytest.approx(outcome["a"])
    assert adv[("b", 1)] == pytest.approx(outcome["b"])
    assert adv[("c", 2)] == pytest.approx(outcome["c"])
    # A group of one: every std is 0 -> 1, every term r - r = 0.
    assert adv[("d", 1)] == pytest.approx(0.0) and adv[("d", 2)] == pytest.approx(0.0)
    # The later version: the last turn too gets A^T + lambda A^O.
    later = mt_grpo_atropos_advantages(batch, lam=0.5, last_turn_outcome_only=False)
    assert later[("b", 1)] == pytest.approx((0 - 2 / 3) / t1 + 0.5 * outcome["b"])


def test_broadcast_rloo_leaves_one_out_and_copies_to_every_turn():
    batch = RolloutBatch([_traj("a", "g", [0, 1], 1.0), _traj("b", "g", [1], 0.0), _traj("c", "g", [2, 2, 2], 0.5), _traj("d", "h", [0], 0.3)])
    assert rloo_advantages(batch) == pytest.approx({"a": 0.75, "b": -0.75, "c": 0.0, "d": 0.3})
    algorithm = make_algorithm("broadcast", {"estimator": "rloo"})
    adv = algorithm.turn_advantages(batch, learner=None)
    assert adv[("c", 1)] == adv[("c", 2)] == adv[("c", 3)] == pytest.approx(0.0)
    assert adv[("a", 1)] == adv[("a", 2)] == pytest.approx(0.75)
    grpo = make_algorithm("broadcast", {"estimator": "grpo"}).turn_advantages(batch, learner=None)
    # GRPO, group g: mean 0.5, unbiased std 0.5 -> a: 1, b: -1; group of one: R / (1 + eps).
    assert grpo[("a", 2)] == pytest.approx(1.0, abs=1e-5) and grpo[("d", 1)] == pytest.approx(0.3, abs=1e-5)


def test_turn_level_gae_by_hand():
    # a: 2 turns, rewards [0.2, 1.0], V = [0.5, 0.8]; b: 1 turn, reward [0], V = [0.4].
    batch = RolloutBatch([_traj("a", "g", [0, 1], 1.2, turn_rewards=[0.2, 1.0]), _traj("b", "g", [1], 0.0)])
    values = {("a", 1): 0.5, ("a", 2): 0.8, ("b", 1): 0.4}
    adv, ret = turn_level_gae(batch, values, gamma=0.9, lam=0.5)
    d2 = 1.0 + 0.0 - 0.8
    d1 = 0.2 + 0.9 * 0.8 - 0.5
    assert adv[("a", 2)] == pytest.approx(d2)
    assert adv[("a", 1)] == pytest.approx(d1 + 0.9 * 0.5 * d2)
    assert adv[("b", 1)] == pytest.approx(-0.4)
    assert ret[("a", 1)] == pytest.approx(adv[("a", 1)] + 0.5)
    # gamma = lambda = 1: A_t = G_t - V_t whatever the values.
    adv, _ = turn_level_gae(batch, values, gamma=1.0, lam=1.0)
    assert adv[("a", 1)] == pytest.approx(1.2 - 0.5)


@pytest.mark.parametrize("name", CREDIT_METHODS)
def test_each_credit_method_raises_the_exact_return_on_follow(name):
    tasks = make_tasks("follow", num_tasks=3, seed=0, turns=(2, 3), options=3)
    policy = TabularPolicy(tasks, lr=0.5, optimizer="adam")
    before = sum(policy.exact_return(k) for k in range(len(tasks)))
    algorithm = make_algorithm(name, {"kl_coef": 0.0, "minibatch_size": 10_000})
    generator = torch.Generator().manual_seed(0)
    for _ in range(15):
        algorithm.update(expected_batch(policy, 32), policy, generator)
    after = sum(policy.exact_return(k) for k in range(len(tasks)))
    assert after > before + 0.5
