"""The shared algorithm parts against hand-computed values."""

import math

import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

T, F = True, False


def close(actual: torch.Tensor, expected: list, tol: float = 1e-4) -> bool:
    return torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol)


# Group 0 rewards [1, 0, 0]; group 1 a single trajectory with reward 1.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 1])


def test_grae_without_normalization_subtracts_the_group_mean():
    # The singleton group has no baseline: A = R, as verl's GRPO (mean 0 for a group of one).
    assert close(core.group_advantages(REWARDS, GROUPS, "none"), [2 / 3, -1 / 3, -1 / 3, 1.0])


def test_grae_group_normalization_divides_by_the_group_std():
    # std of [1, 0, 0] (unbiased) = sqrt(1/3); a singleton group divides by 1 + eps (verl: std 1).
    s = math.sqrt(1 / 3)
    assert close(core.group_advantages(REWARDS, GROUPS, "group"), [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 1.0])


def test_grae_batch_normalization_standardizes_over_the_trajectories():
    # A = [2/3, -1/3, -1/3, 1]: mean 1/4, deviations [5, -7, -7, 9] / 12, unbiased std below.
    s = math.sqrt((25 + 49 + 49 + 81) / 144 / 3)
    assert close(core.group_advantages(REWARDS, GROUPS, "batch"), [5 / 12 / s, -7 / 12 / s, -7 / 12 / s, 9 / 12 / s])


def test_unknown_normalization_is_a_clear_error():
    with pytest.raises(ValueError, match="normalization"):
        core.group_advantages(REWARDS, GROUPS, "turn")


def _trajectory(rid: str, group: str, turns: int, reward: float) -> Trajectory:
    return Trajectory(rid, group, rid, [Turn([1], [2], [-0.1]) for _ in range(turns)], reward, reward == 1.0)


def test_batch_normalization_counts_each_trajectory_once_whatever_its_number_of_turns():
    batch = RolloutBatch(
        [_trajectory("a", "g", 3, 1.0), _trajectory("b", "g", 1, 0.0), _trajectory("c", "h", 1, 0.5), _trajectory("d", "h", 2, 0.0)]
    )
    advantages = core.trajectory_advantages(batch, "batch")
    # GRAE: a=0.5, b=-0.5, c=0.25, d=-0.25; mean 0, unbiased std sqrt(0.625/3).
    s = math.sqrt((0.25 + 0.25 + 0.0625 + 0.0625) / 3)
    expected = {"a": 0.5 / s, "b": -0.5 / s, "c": 0.25 / s, "d": -0.25 / s}
    assert advantages == pytest.approx(expected, abs=1e-4)


def test_token_ratio_is_one_at_padding():
    new = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old = torch.tensor([[-1.5, -2.0], [-0.5, 9.0]])
    mask = torch.tensor([[T, T], [T, F]])
    assert close(core.token_ratio(new, old, mask), [[math.exp(0.5), 1.0], [1.0, 1.0]])


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio_over_real_tokens():
    new = torch.tensor([[-1.0, -1.0, 5.0], [-1.0, -3.0, 0.0]])
    old = torch.tensor([[-2.0, -1.5, 0.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[T, T, F], [T, T, T]])
    # Row 0: diffs 1, 0.5 -> mean 0.75; row 1: 1, -1, 0 -> mean 0.
    assert close(core.sequence_ratio(new, old, mask), [math.exp(0.75), 1.0])


def test_clipped_objective_takes_the_pessimistic_branch():
    r = torch.tensor([0.5, 1.5, 0.5, 1.5, 1.1])
    a = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    assert close(core.clipped_objective(r, a, 0.2, 0.2), [0.5, 1.2, -0.8, -1.5, 2.2])
    # Separate low/high clip: [1 - 0.1, 1 + 0.3].
    assert close(core.clipped_objective(r, a, 0.1, 0.3), [0.5, 1.3, -0.9, -1.5, 2.2])


def test_clip_fraction_marks_only_the_clipped_branch():
    r = torch.tensor([0.5, 1.5, 0.5, 1.5])
    a = torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert close(core.clip_fraction(r, a, 0.2, 0.2), [0.0, 1.0, 1.0, 0.0])


def test_k3_kl_matches_its_formula_and_vanishes_at_equality():
    new = torch.tensor([-1.0, -2.0, -1.0])
    ref = torch.tensor([-1.0, -1.0, -2.0])
    assert close(core.kl_estimate(new, ref, "k3"), [0.0, math.e - 2.0, math.exp(-1) + 1 - 1])


def test_loss_aggregation_modes():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[T, T, T], [T, F, F]])
    assert float(core.aggregate(values, mask, "token-mean")) == pytest.approx(2.5)
    assert float(core.aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(core.aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="aggregation"):
        core.aggregate(values, mask, "sum")


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    values = torch.tensor([[0.2, 0.5, 0.7], [0.4, 0.9, 123.0]])
    mask = torch.tensor([[T, T, T], [T, T, F]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    advantages, returns = core.gae(rewards, values, mask, 1.0, 1.0)
    assert close(advantages, [[0.8, 0.5, 0.3], [0.1, -0.4, 0.0]])
    assert close(returns, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]])


def test_gae_with_discount_and_lambda():
    values = torch.tensor([[0.2, 0.5, 0.7]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    advantages, _ = core.gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), 0.9, 0.5)
    a2 = 1.0 - 0.7
    a1 = 0.9 * 0.7 - 0.5 + 0.45 * a2
    a0 = 0.9 * 0.5 - 0.2 + 0.45 * a1
    assert close(advantages, [[a0, a1, a2]])


def test_clipped_value_loss_takes_the_larger_error():
    values = torch.tensor([[1.0, 0.3]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.5, 1.0]])
    # Token 0: max(0.5^2, (0.2-0.5)^2) = 0.25; token 1: max(0.7^2, (0.2-1)^2) = 0.64.
    loss = core.clipped_value_loss(values, old, returns, torch.ones(1, 2, dtype=torch.bool), 0.2)
    assert float(loss) == pytest.approx(0.5 * (0.25 + 0.64) / 2)


def test_whiten_uses_real_tokens_only():
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[T, T], [T, F]])
    assert close(core.whiten(values, mask), [[-1.0, 0.0], [1.0, 0.0]])


def test_whiten_follows_verls_convention_rsqrt_of_var_plus_1e_8():
    values = torch.tensor([[0.5, 0.8, -0.5, 0.0, 0.3]], dtype=torch.float64)
    mask = torch.ones_like(values, dtype=torch.bool)
    expected = (values - values.mean()) * torch.rsqrt(values.var() + 1e-8)
    torch.testing.assert_close(core.whiten(values, mask), expected, atol=1e-12, rtol=0)


def test_token_policy_loss_ignores_padding_in_loss_and_kl():
    new_lp = torch.tensor([[-1.0, -1.0], [-2.0, 50.0]])
    mask = torch.tensor([[T, T], [T, F]])
    new = core.TokenLogprobs(new_lp, mask)
    old = torch.tensor([[-1.0, -1.1], [-2.0, -9.0]])
    ref = torch.tensor([[-2.0, -1.0], [-2.0, -9.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = core.token_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.2, ref=ref, kl_coef=0.1)
    r = math.exp(0.1)  # token (0, 1): ratio e^0.1 < 1.2, unclipped
    policy = -(1.0 + r - 1.0) / 3
    kl = (math.exp(-1) + 1 - 1 + 0.0 + 0.0) / 3
    assert float(loss) == pytest.approx(policy + 0.1 * kl, abs=1e-5)
    assert stats.kl == pytest.approx(kl, abs=1e-5)


def test_sequence_policy_loss_weights_every_sample_once():
    new = core.TokenLogprobs(torch.tensor([[-1.0, -1.0], [-0.5, 0.0]]), torch.tensor([[T, T], [T, F]]))
    old = torch.tensor([[-1.5, -1.5], [-0.5, 7.0]])
    ref = torch.tensor([[-1.0, -2.0], [-1.5, 7.0]])
    weights = torch.tensor([2.0, -1.0])
    loss, _ = core.sequence_policy_loss(new, old, weights, clip_low=0.2, clip_high=0.2, ref=ref, kl_coef=0.5)
    # s = [e^0.5 -> clipped at 1.2 with A>0, 1.0]; objective [2.4, -1.0].
    policy = -(2.4 - 1.0) / 2
    k3 = lambda d: math.exp(d) - d - 1  # d = l_ref - l_new
    kl = ((k3(0.0) + k3(-1.0)) / 2 + k3(-1.0)) / 2
    assert float(loss) == pytest.approx(policy + 0.5 * kl, abs=1e-5)


def one_turn_samples(n: int):
    return RolloutBatch([Trajectory("t", "g", f"r{k}", [Turn([1], [2], [0.0])], 0.0, False) for k in range(n)]).samples()


def test_minibatches_visit_every_sample_once_per_epoch():
    items = one_turn_samples(10)
    batches = list(core.minibatches(items, 4, 2, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    ids = sorted(s.rollout_id for s in items)
    assert sorted(s.rollout_id for b in batches[:3] for s in b) == ids
    assert sorted(s.rollout_id for b in batches[3:] for s in b) == ids


def test_minibatches_keep_a_trajectorys_turns_together_and_close_at_the_size():
    turns = [Turn([1], [2], [0.0])] * 3
    batch = RolloutBatch([Trajectory("t", "g", f"r{k}", turns[: k % 3 + 1], 0.0, False) for k in range(6)])
    minibatches = list(core.minibatches(batch.samples(), 4, 1, torch.Generator().manual_seed(0)))
    for minibatch in minibatches:
        for rid in {s.rollout_id for s in minibatch}:
            assert [s.t for s in minibatch if s.rollout_id == rid] == list(range(1, batch[rid].num_turns + 1))
    assert all(len(m) >= 4 for m in minibatches[:-1]) and sum(len(m) for m in minibatches) == 12


def test_losses_cut_into_parts_with_minibatch_totals_add_up_to_the_whole():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 1, 4, 2])
    mask = torch.arange(4)[None, :] < lengths[:, None]
    new = core.TokenLogprobs(torch.randn(4, 4, generator=generator) * 0.1 - 1, mask)
    old, ref = new.logprobs + 0.05 * torch.randn(4, 4, generator=generator), new.logprobs - 0.2
    adv = torch.randn(4, 4, generator=generator)
    totals = core.Totals.of_mask(mask)
    for agg in core.LOSS_AGGREGATIONS:
        kwargs = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.1, loss_agg=agg, loss_scale_factor=7.0)
        whole, whole_stats = core.token_policy_loss(new, old, adv, ref=ref, **kwargs)
        parts = [core.token_policy_loss(core.TokenLogprobs(new.logprobs[rows], mask[rows]), old[rows], adv[rows],
                                        ref=ref[rows], totals=totals, **kwargs) for rows in ([0, 2], [1], [3])]
        assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-6)
        assert sum(p[1].clipfrac for p in parts) == pytest.approx(whole_stats.clipfrac, abs=1e-6)
    whole, _ = core.sequence_policy_loss(new, old, adv[:, 0], clip_low=0.2, clip_high=0.2, ref=ref, kl_coef=0.1)
    parts = [core.sequence_policy_loss(core.TokenLogprobs(new.logprobs[rows], mask[rows]), old[rows], adv[rows, 0],
                                       clip_low=0.2, clip_high=0.2, ref=ref[rows], kl_coef=0.1, totals=totals)[0]
             for rows in ([0], [1, 2, 3])]
    assert float(sum(parts)) == pytest.approx(float(whole), abs=1e-6)
