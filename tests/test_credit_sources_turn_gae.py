"""`turn_gae` against a transcription of areal-project/AReaL 8966ca17970010a23094071cd8a55e1c53385955
areal/trainer/ppo/gae.py `_compute_turn_level_gae`, written from the source in plain numpy with its
names and control flow (token rows, turn ids, scatter and gather); our code is not called to compute it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.turn_gae import turn_level_gae

ENV_TOKENS = 2  # observation tokens before each reply: no loss, turn id -1


def _compute_turn_level_gae(rewards, values, loss_mask, turn_ids, seq_no_eos_mask, discount, gae_lambda):
    bs, max_seqlen = rewards.shape
    valid_token_mask = loss_mask.astype(bool)
    safe_turn_ids = np.clip(turn_ids, 0, max_seqlen - 1)

    turn_rewards = np.zeros_like(rewards)
    for b in range(bs):  # scatter_add_ along dim 1
        for j in range(max_seqlen):
            turn_rewards[b, safe_turn_ids[b, j]] += rewards[b, j] * valid_token_mask[b, j]

    first_turn_positions = np.full_like(safe_turn_ids, max_seqlen)
    for b in range(bs):  # scatter_reduce_ "amin", include_self
        for j in range(max_seqlen):
            src = j if valid_token_mask[b, j] else max_seqlen
            k = safe_turn_ids[b, j]
            first_turn_positions[b, k] = min(first_turn_positions[b, k], src)
    valid_turn_mask = first_turn_positions < max_seqlen

    turn_values = np.take_along_axis(values, np.minimum(first_turn_positions, max_seqlen - 1), axis=1)
    turn_values = turn_values * valid_turn_mask

    turn_advantages = np.zeros((bs, max_seqlen))
    lastgaelam = np.zeros(bs)
    nextvalues = values[:, max_seqlen - 1] * seq_no_eos_mask
    discounted_lambda = discount * gae_lambda
    max_active_turn = np.where(valid_token_mask, safe_turn_ids, -1).max()
    num_turn_slots = int(max_active_turn) + 1
    for turn_idx in reversed(range(num_turn_slots)):
        delta = turn_rewards[:, turn_idx] + discount * nextvalues - turn_values[:, turn_idx]
        newgaelam = delta + discounted_lambda * lastgaelam
        mask = valid_turn_mask[:, turn_idx]
        turn_advantages[:, turn_idx] = np.where(mask, newgaelam, 0.0)
        nextvalues = np.where(mask, turn_values[:, turn_idx], nextvalues)
        lastgaelam = np.where(mask, newgaelam, lastgaelam)

    turn_returns = turn_advantages + turn_values
    advantages = np.take_along_axis(turn_advantages, safe_turn_ids, axis=1)
    returns = np.take_along_axis(turn_returns, safe_turn_ids, axis=1)
    advantages = advantages * loss_mask
    returns = returns * loss_mask + values * (1 - loss_mask)
    return advantages, returns


def areal(batch, gamma, lam, seed):
    """Token rows built from our records; each turn's reward on its last response token (a turn without
    tokens has none to carry it). Returns the per-turn (A, return) read off the turn's tokens, and the
    first-token values handed to ours."""
    rng = np.random.default_rng(seed)
    layouts = []
    for trajectory in batch:
        rows, spans = {"reward": [], "mask": [], "turn": []}, []
        for t, (turn, r) in enumerate(zip(trajectory.turns, step_rewards(trajectory))):
            rows["reward"] += [0.0] * ENV_TOKENS
            rows["mask"] += [0] * ENV_TOKENS
            rows["turn"] += [-1] * ENV_TOKENS
            n = turn.num_response_tokens
            spans.append((len(rows["mask"]), len(rows["mask"]) + n))
            rows["reward"] += [0.0] * (n - 1) + [r] if n else []
            rows["mask"] += [1] * n
            rows["turn"] += [t] * n
        layouts.append((rows, spans))
    max_seqlen = max(len(rows["mask"]) for rows, _ in layouts) + 1
    pad = lambda row, fill: row + [fill] * (max_seqlen - len(row))  # noqa: E731
    rewards = np.array([pad(rows["reward"], 0.0) for rows, _ in layouts])
    loss_mask = np.array([pad(rows["mask"], 0) for rows, _ in layouts], dtype=float)
    turn_ids = np.array([pad(rows["turn"], -1) for rows, _ in layouts])
    values = rng.normal(size=rewards.shape)
    seq_no_eos_mask = np.zeros(len(layouts))  # every episode ended
    advantages, returns = _compute_turn_level_gae(rewards, values, loss_mask, turn_ids, seq_no_eos_mask, gamma, lam)
    adv, ret, first_values = {}, {}, {}
    for b, (trajectory, (_, spans)) in enumerate(zip(batch, layouts)):
        for t, (start, end) in enumerate(spans, start=1):
            key = (trajectory.rollout_id, t)
            if start == end:  # no loss token: nothing of the source's reaches this turn
                adv[key], ret[key] = 0.0, 0.0
                continue
            assert np.all(advantages[b, start:end] == advantages[b, start])
            adv[key], ret[key] = float(advantages[b, start]), float(returns[b, start])
            first_values[key] = float(values[b, start])
    return adv, ret, first_values


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_turn_gae_equals_areal_compute_turn_level_gae(seed, gamma, lam):
    batch = random_batch(seed, empty_turns=True, dense=seed % 2 == 1)
    theirs_adv, theirs_ret, first_values = areal(batch, gamma, lam, seed)
    ours_adv, ours_ret = turn_level_gae(batch, first_values, gamma, lam)
    assert max_abs_difference(ours_adv, theirs_adv) < 1e-9
    assert max_abs_difference(ours_ret, theirs_ret) < 1e-9


def test_turn_gae_passes_over_a_turn_without_tokens_as_areal():
    # Turns: [reply, empty, reply]; rewards [0.2, 0.5, 1.0]; V at the replies 0.4 and 0.7.
    turns = [Turn([0], [1], [0.0]), Turn([0, 1], [], []), Turn([0, 1, 2], [3], [0.0])]
    batch = RolloutBatch([Trajectory("t", "g", "a", turns, 1.7, True, info={"turn_rewards": [0.2, 0.5, 1.0]})])
    adv, ret = turn_level_gae(batch, {("a", 1): 0.4, ("a", 3): 0.7}, gamma=0.9, lam=1.0)
    delta3 = 1.0 - 0.7
    # Turn 1's next value is turn 3's (no timestep between), and the empty turn's 0.5 is lost.
    delta1 = 0.2 + 0.9 * 0.7 - 0.4
    assert adv[("a", 3)] == pytest.approx(delta3)
    assert adv[("a", 1)] == pytest.approx(delta1 + 0.9 * delta3)
    assert adv[("a", 2)] == 0.0 and ret[("a", 2)] == 0.0
    assert ret[("a", 1)] == pytest.approx(adv[("a", 1)] + 0.4)


class _StubValueLearner:
    """Stands in for the learner: value of token j of each sample's response = 0.1 x (its turn) + j."""

    def values(self, samples):
        width = max(s.turn.num_response_tokens for s in samples)
        return torch.tensor([[0.1 * s.t + j for j in range(width)] for s in samples])


def test_turn_gae_with_a_stub_value_learner_takes_first_token_values_and_skips_the_empty_turn():
    turns = [Turn([0], [1, 2], [0.0, 0.0]), Turn([0, 1], [], []), Turn([0, 1, 2], [3], [0.0])]
    batch = RolloutBatch([Trajectory("t", "g", "a", turns, 1.0, True)])
    algorithm = make_algorithm("turn_gae", {"gamma": 1.0, "lam": 1.0})
    adv = algorithm.turn_advantages(batch, _StubValueLearner())
    # V_1 = 0.1, V_3 = 0.3; reward 1 on the last turn: A_3 = 1 - 0.3, A_1 = 1 - 0.1.
    assert adv == pytest.approx({("a", 1): 0.9, ("a", 2): 0.0, ("a", 3): 0.7})
    assert float(algorithm.old_values[("a", 2)]) == 0.0 and float(algorithm.value_targets[("a", 1)]) == pytest.approx(1.0)
