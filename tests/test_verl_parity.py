"""The shared parts against verl's formulas (`verl/trainer/ppo/core_algos.py`: `kl_penalty`,
`compute_policy_loss_vanilla`, `agg_loss`, `compute_policy_loss_gspo`), written out here from their
definitions, on fixed inputs that include extreme log-ratios; and each aggregation mode against
its stated formula on a multi-turn batch cut into parts."""

from __future__ import annotations

import math

import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import TokenLogprobs
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

# l_new - l_ref (and l_new - l_old) from far below to far above, with the everyday range between.
LOG_RATIOS = torch.tensor([-30.0, -21.0, -12.0, -5.0, -1.0, -0.1, 0.0, 0.1, 1.0, 2.0, 5.0, 12.0, 21.0, 30.0], dtype=torch.float64)


def verl_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = torch.clamp(ref_logprob - logprob, -20, 20)  # k3 / low_var_kl
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


def verl_token_losses(old, new, advantages, clip_low, clip_high, clip_ratio_c):
    ratio = torch.exp(torch.clamp(new - old, -20.0, 20.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped1 = torch.maximum(losses1, losses2)
    clipped2 = torch.minimum(-advantages * clip_ratio_c, clipped1)
    return torch.where(advantages < 0, clipped2, clipped1)


@pytest.mark.parametrize("estimator", ("k1", "k2", "k3", "low_var_kl"))  # the rest: test_verl_options.py
def test_each_kl_estimator_equals_verls_including_extreme_log_ratios(estimator):
    new = torch.full_like(LOG_RATIOS, -3.0) + LOG_RATIOS
    ref = torch.full_like(LOG_RATIOS, -3.0)
    ours = core.kl_estimate(new, ref, estimator)
    theirs = verl_kl(new, ref, "k1" if estimator == "k1" else "k2" if estimator == "k2" else "k3")
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_k3_is_clamped_where_the_unclamped_estimate_explodes():
    new, ref = torch.tensor([-10.0, -26.0], requires_grad=True), torch.tensor([-5.0, -5.0])
    kl = core.kl_estimate(new, ref, "k3")
    assert kl.tolist() == [10.0, 10.0]  # e^5 - 6 = 142 and e^21 - 22 = 1.3e9 unclamped
    kl.sum().backward()
    assert new.grad.tolist() == [0.0, 0.0]  # clamped: no gradient from the runaway tokens


def test_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="k1"):
        core.kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


@pytest.mark.parametrize("clip_ratio_c", [3.0, 10.0])
def test_dual_clip_token_loss_equals_verls_vanilla_loss_including_extreme_ratios(clip_ratio_c):
    grid_new, grid_adv = torch.meshgrid(LOG_RATIOS, torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], dtype=torch.float64), indexing="ij")
    new, advantages = grid_new.reshape(1, -1) - 2.0, grid_adv.reshape(1, -1)
    old = torch.full_like(new, -2.0)
    mask = torch.ones_like(new, dtype=torch.bool)
    loss, _ = core.token_policy_loss(
        TokenLogprobs(new, mask), old, advantages, clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_ratio_c
    )
    expected = verl_token_losses(old, new, advantages, 0.2, 0.28, clip_ratio_c).mean()
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    # The case the dual clip exists for: A < 0 at a ratio of e^2 costs c * |A|, not e^2 * |A|.
    objective = core.clipped_objective(torch.tensor([math.exp(2)]), torch.tensor([-1.0]), 0.2, 0.2, 3.0)
    assert float(-objective) == pytest.approx(3.0)
    assert float(-core.clipped_objective(torch.tensor([math.exp(2)]), torch.tensor([-1.0]), 0.2, 0.2)) == pytest.approx(math.exp(2))


def test_dual_clip_must_bound_the_ratio_above_one():
    from seeupo_gym.algorithms.grpo import GRPOConfig

    with pytest.raises(ValueError, match="clip_ratio_c"):
        GRPOConfig(clip_ratio_c=0.9)
    assert GRPOConfig(clip_ratio_c=None).clip_ratio_c is None


# --------------------------------------------------------------------------- multi-turn aggregation


def multi_turn_batch() -> RolloutBatch:
    """Three trajectories of 1-3 turns; response lengths differ per turn."""
    lengths = {"a": [2, 3, 1], "b": [4], "c": [1, 2]}
    trajectories = [
        Trajectory("task", "g", rid, [Turn([1, 2], [5] * n, [0.0] * n) for n in turns], 0.0, False)
        for rid, turns in lengths.items()
    ]
    return RolloutBatch(trajectories)


def rows_of(samples, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([s.turn.num_response_tokens for s in samples])
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    values = torch.randn(len(samples), width, generator=generator, dtype=torch.float64)
    return values, mask


def stated(values, mask, samples, mode, sequence):
    """Each mode's formula written directly: sequences as lists of token values."""
    sequences: dict[str, list[float]] = {}
    for k, s in enumerate(samples):
        key = s.rollout_id if sequence == "trajectory" else f"{s.rollout_id}/{s.t}"
        sequences.setdefault(key, []).extend(values[k][mask[k]].tolist())
    tokens = [v for seq in sequences.values() for v in seq]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-mean":
        return sum(sum(seq) / len(seq) for seq in sequences.values()) / len(sequences)
    return sum(sum(seq) for seq in sequences.values()) / len(sequences)


@pytest.mark.parametrize("sequence", core.SEQUENCES)
@pytest.mark.parametrize("mode", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))  # the rest: test_verl_options.py
def test_each_aggregation_mode_equals_its_formula_when_cut_into_parts(mode, sequence):
    samples = multi_turn_batch().samples()
    values, mask = rows_of(samples)
    totals = core.Totals.of(samples, sequence)
    # Parts that split trajectory "a" across them: the shares still add up to the whole.
    cuts = ([0, 3], [1, 4], [2, 5])
    total = sum(
        float(core.aggregate(values[rows], mask[rows], mode, totals.part([samples[i] for i in rows]))) for rows in cuts
    )
    assert total == pytest.approx(stated(values, mask, samples, mode, sequence), abs=1e-12)


def test_trajectory_aggregation_equals_verls_agg_loss_on_concatenated_trajectory_rows():
    samples = multi_turn_batch().samples()
    values, mask = rows_of(samples, seed=3)
    rows = {}
    for k, s in enumerate(samples):
        rows.setdefault(s.rollout_id, []).append(values[k][mask[k]])
    concatenated = torch.nn.utils.rnn.pad_sequence([torch.cat(r) for r in rows.values()], batch_first=True)
    row_mask = torch.nn.utils.rnn.pad_sequence([torch.ones(sum(len(x) for x in r)) for r in rows.values()], batch_first=True)
    # verl's agg_loss, seq-mean-token-mean, one row per trajectory.
    verl = ((concatenated * row_mask).sum(-1) / (row_mask.sum(-1) + 1e-8)).mean()
    ours = core.aggregate(values, mask, "seq-mean-token-mean", core.Totals.of(samples, "trajectory").part(samples))
    assert float(ours) == pytest.approx(float(verl), abs=1e-6)


def test_gspo_trajectory_ratio_equals_verls_sequence_ratio_over_all_turns():
    samples = multi_turn_batch().samples()
    new_values, mask = rows_of(samples, seed=1)
    old_values, _ = rows_of(samples, seed=2)
    new_values, old_values = -1 + 0.1 * new_values, -1 + 0.1 * old_values
    advantages = {"a": 1.5, "b": -0.5, "c": 0.3}
    weights = torch.tensor([advantages[s.rollout_id] for s in samples], dtype=torch.float64)
    new = TokenLogprobs(new_values.clone().requires_grad_(True), mask)
    totals = core.Totals.of(samples, "trajectory")
    loss, _ = core.sequence_policy_loss(new, old_values, weights, clip_low=10.0, clip_high=10.0, totals=totals.part(samples))
    # verl: log s_i = mean over the trajectory's response tokens of (l_new - l_old), one per trajectory.
    expected = 0.0
    for rid, a in advantages.items():
        rows = [k for k, s in enumerate(samples) if s.rollout_id == rid]
        diffs = torch.cat([(new_values[k] - old_values[k])[mask[k]] for k in rows])
        expected += -a * math.exp(float(diffs.mean()))
    assert float(loss.detach()) == pytest.approx(expected / 3, abs=1e-9)
    # The turn sequence (the SeeUPO paper's) is a different objective on the same numbers.
    turn_loss, _ = core.sequence_policy_loss(new, old_values, weights, clip_low=10.0, clip_high=10.0,
                                             totals=core.Totals.of(samples, "turn"))
    assert float(turn_loss.detach()) != pytest.approx(float(loss.detach()), abs=1e-6)


def test_gspo_trajectory_ratio_refuses_a_trajectory_split_across_parts():
    samples = multi_turn_batch().samples()
    values, mask = rows_of(samples)
    totals = core.Totals.of(samples, "trajectory")
    part = [samples[0]]  # one of trajectory "a"'s three turns
    with pytest.raises(ValueError, match="micro-batches"):
        core.sequence_policy_loss(TokenLogprobs(values[:1], mask[:1]), values[:1], torch.ones(1, dtype=torch.float64),
                                  clip_low=0.2, clip_high=0.2, totals=totals.part(part))
