"""GSPO's sequence loss against verl's `compute_policy_loss_gspo` and `agg_loss` (verl 0.9), written out
here from their source: the behaviour weight once per trajectory whatever the micro-batch cut, the
mean log-ratio clamped at 10 where verl clamps it, and responses without tokens left out."""

from __future__ import annotations

import math

import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import TokenLogprobs
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn


def verl_gspo_loss(old, new, advantages, mask, clip_low, clip_high, rollout_is_weights=None):
    """verl's `compute_policy_loss_gspo` with `loss_agg_mode="seq-mean-token-mean"` and `agg_loss`
    without global batch info (the sequence count is the rows with a token). [n, L] tensors."""
    mask = mask.to(new.dtype)
    negative_approx_kl = new - old
    seq_lengths = mask.sum(-1).clamp(min=1)
    negative_approx_kl_seq = (negative_approx_kl * mask).sum(-1) / seq_lengths
    log_seq_importance_ratio = new - new.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    # agg_loss, seq-mean-token-mean
    seq_tokens = mask.sum(-1)
    seq_losses = (pg_losses * mask).sum(-1) / (seq_tokens + 1e-8)
    seq_mask = (seq_tokens > 0).to(new.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_agg_seq_mean(loss_mat, mask, mode, global_batch_size=None):
    """verl's `agg_loss` for the seq-mean modes: called alone (fully masked rows leave both sums), or
    with verl v1's `global_batch_size` (the mini-batch's row count, zero-length rows included)."""
    mask = mask.to(loss_mat.dtype)
    seq_tokens = mask.sum(-1)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    else:
        seq_losses = (loss_mat * mask).sum(-1)
    return (seq_losses * seq_mask).sum() / (seq_mask.sum() if global_batch_size is None else global_batch_size)


LENGTHS = {"a": [2, 3, 1], "b": [4], "c": [1, 2]}
ADVANTAGES = {"a": 1.5, "b": -0.5, "c": 0.3, "d": -1.2}


def batch_of(lengths: dict[str, list[int]]) -> RolloutBatch:
    return RolloutBatch([
        Trajectory("task", "g", rid, [Turn([1, 2], [5] * n, [0.0] * n) for n in turns], 0.0, False)
        for rid, turns in lengths.items()
    ])


def token_rows(samples, seed, scale=0.3, offset=-1.0, dtype=torch.float64):
    """Per-turn rows [n, L] of random logprobs, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([s.turn.num_response_tokens for s in samples])
    width = max(int(lengths.max()), 1)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    values = offset + scale * torch.randn(len(samples), width, generator=generator, dtype=torch.float64)
    return (values * mask).to(dtype), mask


def trajectory_rows(samples, rows, mask, key=lambda s: s.rollout_id):
    """verl's layout: one row per sequence (`key`), the response tokens of its turns concatenated."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for k, s in enumerate(samples):
        pieces.setdefault(key(s), []).append(rows[k][mask[k]])
    keys = list(pieces)
    flat = [torch.cat(p) for p in pieces.values()]
    width = max(max(len(f) for f in flat), 1)
    out = torch.zeros(len(flat), width, dtype=rows.dtype)
    out_mask = torch.zeros(len(flat), width, dtype=torch.bool)
    for i, f in enumerate(flat):
        out[i, : len(f)], out_mask[i, : len(f)] = f, True
    return keys, out, out_mask


def shares(samples, new, mask, old, weights, totals, cuts, **kwargs):
    """The kit's loss as the sum of the shares of the parts `cuts` (lists of row indices), and the
    summed diagnostics."""
    total, stats = 0.0, {}
    for rows in cuts:
        part = [samples[i] for i in rows]
        tokens = TokenLogprobs(new.logprobs[rows], mask[rows], sampled=None if new.sampled is None else new.sampled[rows],
                               sampled_cap=new.sampled_cap)
        loss, part_stats = core.sequence_policy_loss(tokens, old[rows], weights[rows], totals=totals.part(part), **kwargs)
        total = total + loss
        for key, value in vars(part_stats).items():
            if value is not None:
                stats[key] = stats.get(key, 0.0) + value
    return total, stats


# --------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("cut", ["whole", "one trajectory per part", "one trajectory alone"])
def test_gspo_trajectory_behaviour_weight_counts_each_trajectory_once_as_verl(cut):
    batch = batch_of(LENGTHS)
    samples = batch.samples()
    new_rows, mask = token_rows(samples, seed=1)
    old, _ = token_rows(samples, seed=2)
    sampled, _ = token_rows(samples, seed=3)
    weights = torch.tensor([ADVANTAGES[s.rollout_id] for s in samples], dtype=torch.float64)
    cap = 1.3
    new = TokenLogprobs(new_rows.clone().requires_grad_(True), mask, sampled=sampled, sampled_cap=cap)
    by_trajectory = [[k for k, s in enumerate(samples) if s.rollout_id == rid] for rid in LENGTHS]
    cuts = {"whole": [list(range(len(samples)))], "one trajectory per part": by_trajectory,
            "one trajectory alone": by_trajectory[:1]}[cut]
    kept = [rid for rid, rows in zip(LENGTHS, by_trajectory) if rows in cuts or cut == "whole"]
    minibatch = [s for s in samples if s.rollout_id in kept]
    totals = core.Totals.of(minibatch, "trajectory")
    ours, stats = shares(samples, new, mask, old, weights, totals, cuts, clip_low=0.2, clip_high=0.28)
    ours.backward()

    # verl: one row per trajectory, its advantage and its truncated weight broadcast over the row. The
    # weight is the kit's (the length-normalized one, computed here over the trajectory's tokens).
    rows = [k for k, s in enumerate(samples) if s.rollout_id in kept]
    keys, v_new, v_mask = trajectory_rows([samples[k] for k in rows], new_rows[rows], mask[rows])
    _, v_old, _ = trajectory_rows([samples[k] for k in rows], old[rows], mask[rows])
    _, v_sampled, _ = trajectory_rows([samples[k] for k in rows], sampled[rows], mask[rows])
    v_new = v_new.clone().requires_grad_(True)
    log_w = ((v_old - v_sampled) * v_mask).sum(-1) / v_mask.sum(-1)
    w = torch.exp(log_w).clamp(max=cap)
    advantages = torch.tensor([ADVANTAGES[k] for k in keys], dtype=torch.float64)[:, None].expand_as(v_new)
    theirs = verl_gspo_loss(v_old, v_new, advantages, v_mask, 0.2, 0.28, rollout_is_weights=w[:, None] * v_mask)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-7)
    assert stats["is_weight_mean"] == pytest.approx(float(w.mean()), abs=1e-7)
    # The same gradient on every response token.
    for i, key in enumerate(keys):
        ours_grad = torch.cat([new.logprobs.grad[k][mask[k]] for k in rows if samples[k].rollout_id == key])
        torch.testing.assert_close(ours_grad, v_new.grad[i][v_mask[i]], atol=1e-7, rtol=0)


def test_gspo_trajectory_loss_with_unit_weights_is_the_plain_loss_not_one_count_per_turn():
    # The audit's case: one 3-turn trajectory alone in its micro-batch, every weight 1, A = 1, ratios 1.
    batch = batch_of({"a": [2, 3, 1]})
    samples = batch.samples()
    rows, mask = token_rows(samples, seed=0)
    new = TokenLogprobs(rows.clone(), mask, sampled=rows.clone(), sampled_cap=2.0)
    totals = core.Totals.of(samples, "trajectory").part(samples)
    loss, stats = core.sequence_policy_loss(new, rows.clone(), torch.ones(3, dtype=torch.float64),
                                            clip_low=0.2, clip_high=0.2, totals=totals)
    assert float(loss) == pytest.approx(-1.0) and stats.is_weight_mean == pytest.approx(1.0)


def test_gspo_update_with_stale_rollouts_runs_whatever_the_trajectories_per_part():
    # Through GSPO's update on a learner that hands the sampler's logprobs to the loss, cut one
    # sample per part (trajectories split) or whole: the split is refused clearly, whole runs.
    from seeupo_gym.algorithms.base import make_algorithm
    from seeupo_gym.algorithms.tabular import TabularPolicy

    class StaleTabular(TabularPolicy):
        def minimize(self, samples, loss, *, values=False):
            def with_sampled(part, new, values):
                sampled = torch.tensor([[s.turn.sample_logprobs[0]] for s in part], dtype=new.logprobs.dtype)
                return loss(part, TokenLogprobs(new.logprobs, new.mask, sampled=sampled, sampled_cap=2.0), values)

            return super().minimize(samples, with_sampled, values=values)

    class Task:
        task_id, num_turns, num_options = "t", 3, 2

        def reward(self, actions):
            return float(sum(actions))

    def run(microbatch_samples):
        policy = StaleTabular([Task()], lr=0.5, microbatch_samples=microbatch_samples)
        trajectories = [
            Trajectory("t", "t", f"r{k}", [Turn([0, *actions[:t]], [a], [math.log(0.4)]) for t, a in enumerate(actions)],
                       float(sum(actions)), False)
            for k, actions in enumerate([(0, 1, 1), (1, 1, 0), (0, 0, 0)])
        ]
        algo = make_algorithm("gspo", {"sequence": "trajectory", "kl_coef": 0.0, "minibatch_size": 1})
        return algo.update(RolloutBatch(trajectories), policy, torch.Generator().manual_seed(0))

    metrics = run(None)  # one trajectory per minibatch, three turns each
    # Every sampled prob 0.4 against the policy's 0.5: weight (0.5 / 0.4) once per trajectory.
    assert metrics["is_weight_mean"] == pytest.approx(1.25, rel=1e-6)
    with pytest.raises(ValueError, match="micro-batches"):
        run(1)


# --------------------------------------------------------------------------- item 4

# Mean log-ratios per row: inside the range, past verl's clamp (10), past float32's exp (88), far below.
MEAN_LOG_RATIOS = [0.05, -0.3, 12.0, 50.0, 100.0, -100.0]


@pytest.mark.parametrize("advantage", [-1.0, 0.7])
def test_sequence_ratio_is_clamped_at_ten_as_verl_with_no_nan_or_inf(advantage):
    rows, width = len(MEAN_LOG_RATIOS), 3
    generator = torch.Generator().manual_seed(0)
    old = (-2.0 + 0.1 * torch.randn(rows, width, generator=generator)).float()
    noise = 0.2 * torch.randn(rows, width, generator=generator)
    noise = noise - noise.mean(-1, keepdim=True)  # the row's mean log-ratio is exactly the target
    new_values = (old + torch.tensor(MEAN_LOG_RATIOS)[:, None] + noise).float()
    mask = torch.ones(rows, width, dtype=torch.bool)
    advantages = torch.full((rows,), advantage)

    new = TokenLogprobs(new_values.clone().requires_grad_(True), mask)
    ours, _ = core.sequence_policy_loss(new, old, advantages, clip_low=0.2, clip_high=0.2)
    ours.backward()
    v_new = new_values.clone().requires_grad_(True)
    theirs = verl_gspo_loss(old, v_new, advantages[:, None].expand(rows, width), mask, 0.2, 0.2)
    theirs.backward()
    assert torch.isfinite(ours) and torch.isfinite(new.logprobs.grad).all()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    torch.testing.assert_close(new.logprobs.grad, v_new.grad, rtol=1e-5, atol=1e-7)
    if advantage < 0:  # past the clamp the ratio is e^10 and the row has no gradient
        assert new.logprobs.grad[2:5].abs().max() == 0.0
    # The ratios SeeUPO multiplies into M are clamped the same way.
    ratios = core.sequence_ratio(new_values, old, mask)
    assert torch.isfinite(ratios).all() and float(ratios.max()) == pytest.approx(math.exp(10.0), rel=1e-5)


# --------------------------------------------------------------------------- item 6


def test_a_zero_length_response_adds_no_loss_and_counts_in_gspo_per_turn_as_verl_v1():
    lengths = {"a": [2, 0, 1], "b": [0], "c": [1, 2], "d": [3, 0]}
    samples = batch_of(lengths).samples()
    new_rows, mask = token_rows(samples, seed=4)
    old, _ = token_rows(samples, seed=5)
    weights = torch.tensor([ADVANTAGES.get(s.rollout_id, 0.4) for s in samples], dtype=torch.float64)
    new = TokenLogprobs(new_rows.clone().requires_grad_(True), mask)
    totals = core.Totals.of(samples, "turn")
    ours, stats = core.sequence_policy_loss(new, old, weights, clip_low=0.2, clip_high=0.2, totals=totals)
    advantages = weights[:, None].expand_as(new_rows)
    theirs = verl_gspo_loss(old, new_rows, advantages, mask, 0.2, 0.2)
    assert totals.samples == 8  # 8 turns, 3 without a token: verl v1 counts every row of a mini-batch
    assert float(ours) == pytest.approx(float(theirs) * 5 / 8, abs=1e-7)  # agg_loss alone divides by 5
    assert stats.ratio_mean == pytest.approx(float(core.sequence_ratio(new_rows, old, mask)[mask.any(-1)].mean()), abs=1e-7)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_zero_length_response_adds_no_loss_and_counts_in_seq_mean_aggregation_per_turn(mode):
    lengths = {"a": [2, 0, 1], "b": [0], "c": [1, 2]}
    samples = batch_of(lengths).samples()
    values, mask = token_rows(samples, seed=6)
    totals = core.Totals.of(samples, "turn")
    # Cut into parts: the shares add up to verl's aggregate over the whole minibatch.
    ours = sum(float(core.aggregate(values[r], mask[r], mode, totals.part([samples[i] for i in r])))
               for r in ([0, 1], [2, 3, 4], [5]))
    assert ours == pytest.approx(float(verl_agg_seq_mean(values, mask, mode, global_batch_size=len(samples))), abs=1e-7)
    # Without minibatch totals, a part is its own minibatch and only rows with a token count (agg_loss alone).
    assert float(core.aggregate(values, mask, mode)) == pytest.approx(float(verl_agg_seq_mean(values, mask, mode)), abs=1e-7)
