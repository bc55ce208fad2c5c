"""verl's options against verl's formulas, transcribed here by hand from verl 0.9.1
(`verl/trainer/ppo/core_algos.py`: `agg_loss`, `kl_penalty`, `kl_penalty_forward`,
`AdaptiveKLController`, `compute_policy_loss_vanilla`, `compute_policy_loss_gspo`,
`compute_grpo_outcome_advantage`, `compute_gae_advantage_return`; `ray_trainer.apply_kl_penalty`;
`verl/workers/utils/losses.ppo_loss` (entropy and KL terms); `rollout_corr_helper.py`:
`compute_rollout_correction_weights`, `compute_rollout_rejection_mask`). Nothing here calls the
kit to compute the expected numbers.

The end-to-end checks drive GRPO and GSPO with a stand-in learner (`ScalarPolicy`: token logprobs
`base + theta * feature`, one scalar parameter), replacing the policy to test what surrounds it:
advantages, the rollout correction, the loss terms and their aggregation over a minibatch cut into
parts. verl's rows are whole trajectories (all turns' response tokens), as its multi-turn rows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_verl_parity import verl_token_losses

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import TokenLogprobs, loss_share, make_algorithm
from seeupo_gym.algorithms.kl import KLControl, KLController
from seeupo_gym.algorithms.ppo import trajectory_gae
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.rollout_correction import RolloutCorrection, correct
from seeupo_gym.algorithms.tabular import TabularPolicy

F64 = torch.float64

# ------------------------------------------------------------------------------------------
# verl, transcribed
# ------------------------------------------------------------------------------------------


def verl_kl_forward(logprob, ref_logprob, kind):
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_kl_penalty(logprob, ref_logprob, kind):
    base = kind[:-1] if kind.endswith("+") else kind
    forward = verl_kl_forward(logprob, ref_logprob, base)
    if not kind.endswith("+") or kind in ("mse", "k2"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None, global_batch_size=None):
    """verl 0.9.1's `agg_loss` (dp_size 1). global_batch_size: what verl v1's trainer passes
    (`trainer_base._update_actor`: `ppo_mini_batch_size * rollout.n`, the mini-batch's row count,
    through `losses.ppo_loss`'s `global_batch_info`); None is `agg_loss` called alone."""
    loss_mask = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "token-sum":
        return (loss_mat * loss_mask).sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss_mat * loss_mask).sum(-1)
        seq_mask = (loss_mask.sum(-1) > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    assert mode == "seq-mean-token-mean"
    counts = loss_mask.sum(-1)
    seq_losses = (loss_mat * loss_mask).sum(-1) / (counts + 1e-8)
    seq_mask = (counts > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return (seq_losses * seq_mask).sum() / global_batch_size


# verl's compute_policy_loss_vanilla per token, as transcribed once for tests/test_verl_parity.py.
verl_vanilla_pg_losses = verl_token_losses


def verl_gspo_loss(old_log_prob, log_prob, advantages, mask, clip_low, clip_high, loss_agg_mode, version="0.9.1", **agg):
    """`compute_policy_loss_gspo`'s pg_loss: verl 0.9.1 aggregates `pg_losses` with `loss_agg_mode`;
    verl 0.9.0 (and 0.8) with "seq-mean-token-mean" whatever `loss_agg_mode` says."""
    pg_losses = verl_gspo_pg_losses(old_log_prob, log_prob, advantages, mask, clip_low, clip_high) * agg.pop("weights", 1.0)
    return verl_agg_loss(pg_losses, mask, loss_agg_mode if version == "0.9.1" else "seq-mean-token-mean", **agg)


def verl_gspo_pg_losses(old_log_prob, log_prob, advantages, mask, clip_low, clip_high):
    m = mask.to(log_prob.dtype)
    neg = log_prob - old_log_prob
    seq = (neg * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    return torch.maximum(-advantages * s, -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high))


def verl_grpo_advantages(scores, index, eps=1e-6):
    out = scores.clone()
    for g in set(index):
        members = [i for i, x in enumerate(index) if x == g]
        group = scores[members]
        mean, std = (group.mean(), group.std()) if len(members) > 1 else (torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64))
        out[members] = (group - mean) / (std + eps)
    return out


class VerlAdaptiveKL:
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def verl_is_weights(log_ratio, mask, level, threshold, batch_normalize):
    m = mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, -20, 20))
    else:
        raw = torch.exp(torch.clamp((log_ratio * m).sum(-1, keepdim=True), -20, 20)).expand_as(log_ratio)
    raw = raw * m
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(x) for x in threshold.split("_"))
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(max=float(threshold))
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / (m.sum() + 1e-8)  # verl_F.masked_mean
        else:
            seq_w = (w * m).sum(-1) / (m.sum(-1) + 1e-8)
            seq_mask = (m.sum(-1) > 0).to(w.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_rs_mask(log_ratio, mask, options, thresholds):
    safe = torch.clamp(log_ratio, -20, 20)
    stats = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    m = mask.to(log_ratio.dtype)
    combined = torch.ones_like(m)
    for option, spec in zip(options.split(","), thresholds.split(",") if len(thresholds.split(",")) > 1 else [thresholds] * len(options.split(","))):
        est = option[-2:]
        value = stats[est]
        if option.startswith("seq_sum"):
            value = (value * m).sum(-1, keepdim=True)
        elif option.startswith("seq_mean"):
            value = ((value * m).sum(-1) / (m.sum(-1) + 1e-8)).unsqueeze(-1)
        elif option.startswith("seq_max"):
            v = value.masked_fill(~mask, float("-inf")).max(-1).values
            value = torch.where(v == float("-inf"), torch.zeros_like(v), v).unsqueeze(-1)
        if est == "k1":
            lower, upper = (float(x) for x in spec.split("_")) if "_" in spec else (1.0 / float(spec), float(spec))
            keep = (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            keep = value <= float(spec)
        combined = combined * keep.expand_as(m).to(m.dtype)
    return (m * combined) > 0.5


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam = 0, 0
    advantages_reversed = []
    length = token_level_rewards.shape[-1]
    m = response_mask.to(values.dtype)
    for t in reversed(range(length)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


# ------------------------------------------------------------------------------------------
# Pure parts
# ------------------------------------------------------------------------------------------

LOG_RATIOS = torch.tensor([-30.0, -21.0, -12.0, -5.0, -1.0, -0.1, 0.0, 0.1, 1.0, 2.0, 5.0, 12.0, 21.0, 30.0], dtype=F64)


@pytest.mark.parametrize("name", core.KL_ESTIMATORS)
def test_every_kl_name_verl_accepts_has_verls_value_and_gradient(name):
    new_ours = (LOG_RATIOS - 3.0).clone().requires_grad_(True)
    new_verl = (LOG_RATIOS - 3.0).clone().requires_grad_(True)
    ref = torch.full_like(LOG_RATIOS, -3.0)
    ours, theirs = core.kl_estimate(new_ours, ref, name), verl_kl_penalty(new_verl, ref, name)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(new_ours.grad, new_verl.grad, atol=1e-6, rtol=0)


def test_straight_through_k3_has_k3s_value_and_k2s_gradient():
    new = torch.tensor([-1.0, -4.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-2.0, -2.0], dtype=F64)
    kl = core.kl_estimate(new, ref, "k3+")
    d = [1.0, -2.0]  # l_new - l_ref
    assert kl.tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d], abs=1e-12)
    kl.sum().backward()
    assert new.grad.tolist() == pytest.approx(d, abs=1e-12)  # d/dl 0.5 d^2


def rows_and_mask(seed=0, lengths=(3, 1, 4, 2, 5)):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return torch.randn(len(lengths), width, generator=g, dtype=F64), mask


@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
def test_each_loss_agg_mode_equals_verls_agg_loss_when_cut_into_parts(mode):
    values, mask = rows_and_mask()
    totals = core.Totals.of_mask(mask)
    parts = ([0, 3], [1], [2, 4])
    ours = sum(float(core.aggregate(values[p], mask[p], mode, totals, loss_scale_factor=7.0)) for p in parts)
    # (verl's seq-mean-token-mean divides by count + 1e-8: a 1e-9 difference)
    assert ours == pytest.approx(float(verl_agg_loss(values, mask, mode, loss_scale_factor=7.0)), abs=1e-6)


def test_seq_mean_token_sum_norm_refuses_to_guess_its_scale_factor():
    values, mask = rows_and_mask()
    with pytest.raises(ValueError, match="loss_scale_factor"):
        core.aggregate(values, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        make_algorithm("grpo", {"loss_agg": "seq-mean-token-sum-norm"})
    assert make_algorithm("ppo", {"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 4096}).config.loss_scale_factor == 4096


@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kl_name", ["kl", "low_var_kl+", "abs"])
def test_token_loss_with_entropy_kl_and_rollout_weights_equals_verls_ppo_loss(mode, kl_name):
    values, mask = rows_and_mask(1)
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(values.shape, generator=g, dtype=F64) * 3
    new = old + 0.3 * values
    ref = old - 0.2 * torch.randn(values.shape, generator=g, dtype=F64)
    adv = torch.randn(values.shape, generator=g, dtype=F64)
    entropy = torch.rand(values.shape, generator=g, dtype=F64)
    weights = torch.rand(values.shape, generator=g, dtype=F64) * 2
    loss, stats = core.token_policy_loss(
        TokenLogprobs(new, mask, entropy=entropy), old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, ref=ref,
        kl_coef=0.05, kl_estimator=kl_name, loss_agg=mode, loss_scale_factor=6.0, rollout_is_weights=weights,
        entropy_coeff=0.01,
    )
    pg = verl_agg_loss(verl_vanilla_pg_losses(old, new, adv, 0.2, 0.28, 3.0) * weights, mask, mode, 6.0)
    expected = pg - 0.01 * verl_agg_loss(entropy, mask, mode, 6.0) + 0.05 * verl_agg_loss(verl_kl_penalty(new, ref, kl_name), mask, mode, 6.0)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert stats.entropy == pytest.approx(float(verl_agg_loss(entropy, mask, mode, 6.0)), abs=1e-6)


def test_entropy_coeff_without_a_learner_entropy_is_a_clear_error():
    values, mask = rows_and_mask()
    with pytest.raises(ValueError, match="entropy"):
        core.token_policy_loss(TokenLogprobs(values, mask), values, values, clip_low=0.2, clip_high=0.2, entropy_coeff=0.1)


def test_adaptive_kl_controller_follows_verls_over_many_steps():
    ours = KLController(KLControl(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=500))
    theirs = VerlAdaptiveKL(0.05, 0.1, 500)
    for kl in [0.0, 0.05, 0.1, 0.2, 0.5, 3.0, 0.11, 0.09]:
        ours.update(kl, 64)
        theirs.update(kl, 64)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)
    fixed = KLController(KLControl(type="fixed", kl_coef=0.05))
    fixed.update(3.0, 64)
    assert fixed.value == 0.05


@pytest.mark.parametrize("control", [{"type": "pid"}, {"type": "adaptive", "horizon": 0}, {"kl_coef": -1.0}])
def test_bad_kl_ctrl_is_refused(control):
    with pytest.raises(ValueError, match="kl_ctrl"):
        make_algorithm("grpo", {"use_kl_in_reward": True, "kl_ctrl": control})


# ------------------------------------------------------------------------------------------
# Rollout correction
# ------------------------------------------------------------------------------------------


def single_turn_samples(log_ratio, mask):
    """One turn per row; the step-start logprobs `old` and the sampler's differ by `log_ratio`."""
    trajectories, old = [], {}
    for i in range(log_ratio.shape[0]):
        n = int(mask[i].sum())
        l_old = torch.linspace(-0.5, -2.0, n, dtype=F64)
        turn = Turn(context_ids=[1, 2], response_ids=list(range(3, 3 + n)), sample_logprobs=(l_old - log_ratio[i, :n]).tolist())
        trajectories.append(Trajectory(f"t{i}", "g", f"r{i}", [turn], 1.0, True))
        old[(f"r{i}", 1)] = l_old.float()
    return RolloutBatch(trajectories).samples(), old


IS_CASES = [
    ("token", 2.0, False), ("token", 2.0, True), ("sequence", 5.0, False), ("sequence", 5.0, True),
    ("token", "0.5_2.0", False), ("token", "0.5_2.0", True), ("sequence", "0.2_5.0", False), ("sequence", "0.2_5.0", True),
]


@pytest.mark.parametrize("level,threshold,normalize", IS_CASES)
def test_importance_weights_equal_verls_tis_icepop_and_batch_normalized(level, threshold, normalize):
    g = torch.Generator().manual_seed(3)
    _, mask = rows_and_mask(0, (3, 1, 4, 2, 5, 2))
    log_ratio = torch.randn(mask.shape, generator=g, dtype=F64) * 0.8 * mask
    samples, old = single_turn_samples(log_ratio, mask)
    log_ratio = torch.stack([torch.nn.functional.pad(old[(f"r{i}", 1)].double() - torch.tensor(samples[i].turn.sample_logprobs, dtype=F64), (0, mask.shape[1] - int(mask[i].sum()))) for i in range(len(samples))])
    result = correct(samples, old, RolloutCorrection(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize), "turn")
    expected = verl_is_weights(log_ratio, mask, level, threshold, normalize)
    for i, s in enumerate(samples):
        torch.testing.assert_close(result.weights[(s.rollout_id, 1)].double(), expected[i, : int(mask[i].sum())], atol=1e-6, rtol=0)
    if isinstance(threshold, str):  # IcePop zeroes some weights rather than capping them
        assert any((w == 0).any() for w in result.weights.values())


RS_CASES = [
    ("token_k1", "0.6_1.5"), ("token_k1", "1.5"), ("token_k2", "0.1"), ("token_k3", "0.1"),
    ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", "0.4"), ("seq_sum_k3", "0.4"),
    ("seq_mean_k1", "0.7_1.4"), ("seq_mean_k2", "0.1"), ("seq_mean_k3", "0.1"),
    ("seq_max_k2", "0.2"), ("seq_max_k3", "0.2"), ("token_k1,seq_max_k2", "0.5_2.0,0.3"),
]


@pytest.mark.parametrize("options,threshold", RS_CASES)
def test_rejection_keeps_the_tokens_verl_keeps(options, threshold):
    g = torch.Generator().manual_seed(4)
    _, mask = rows_and_mask(0, (3, 1, 4, 2, 5, 2, 6, 3))
    log_ratio = torch.randn(mask.shape, generator=g, dtype=F64) * 0.5 * mask
    samples, old = single_turn_samples(log_ratio, mask)
    log_ratio = torch.stack([torch.nn.functional.pad(old[(f"r{i}", 1)].double() - torch.tensor(samples[i].turn.sample_logprobs, dtype=F64), (0, mask.shape[1] - int(mask[i].sum()))) for i in range(len(samples))])
    result = correct(samples, old, RolloutCorrection(rollout_rs=options, rollout_rs_threshold=threshold), "turn")
    expected = verl_rs_mask(log_ratio, mask, options, threshold)
    kept = [result.keep[(s.rollout_id, 1)].tolist() for s in samples]
    assert kept == [expected[i, : int(mask[i].sum())].tolist() for i in range(len(samples))]
    flat = [k for row in kept for k in row]
    assert 0 < sum(flat) < len(flat)  # the case rejects some tokens and keeps others


def test_verls_older_rejection_names_are_the_k1_criteria():
    assert RolloutCorrection(rollout_rs="geometric", rollout_rs_threshold="0.5_2.0").rs_bounds == {"seq_mean_k1": (0.5, 2.0)}
    assert RolloutCorrection(rollout_rs="sequence", rollout_rs_threshold=2.0).rs_bounds == {"seq_sum_k1": (0.5, 2.0)}
    assert RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0).rs_bounds == {"token_k1": (0.5, 2.0)}


@pytest.mark.parametrize(
    "options,match",
    [
        ({"rollout_is": "tokens"}, "rollout_is"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "lower <= upper"),
        ({"rollout_is": "token", "rollout_is_threshold": "abc"}, "not a number"),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 2.0}, "unknown criteria"),
        ({"rollout_rs": "token_k2"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "one upper bound"),
        ({"rollout_rs": "token_k2,seq_max_k3", "rollout_rs_threshold": "1,2,3"}, "3 values for 2"),
        ({}, "neither"),
    ],
)
def test_bad_rollout_correction_is_refused_with_the_key(options, match):
    with pytest.raises(ValueError, match=match):
        make_algorithm("grpo", {"rollout_correction": options})


@pytest.mark.parametrize("name", ["gspo", "seeupo"])
def test_token_level_weights_are_refused_for_sequence_level_losses(name):
    with pytest.raises(ValueError, match="rollout_is: sequence"):
        make_algorithm(name, {"rollout_correction": {"rollout_is": "token"}})
    assert make_algorithm(name, {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 3.0}})


# ------------------------------------------------------------------------------------------
# End to end: GRPO and GSPO with a stand-in learner
# ------------------------------------------------------------------------------------------


class ScalarPolicy:
    """Stand-in learner: token logprobs `base + theta * feature`, entropy `h * exp(theta)`, the
    reference at theta_ref. `minimize` cuts each minibatch into two parts by trajectory, records the
    summed shares and theta, and takes one SGD step."""

    def __init__(self, batch: RolloutBatch, seed: int = 0, lr: float = 0.3, theta_ref: float = -0.5):
        g = torch.Generator().manual_seed(seed)
        self.base, self.feature, self.h = {}, {}, {}
        for s in batch.samples():
            n = s.turn.num_response_tokens
            key = (s.rollout_id, s.t)
            self.base[key] = -0.3 - 2.0 * torch.rand(n, generator=g, dtype=F64)
            self.feature[key] = torch.randn(n, generator=g, dtype=F64)
            self.h[key] = 0.5 + torch.rand(n, generator=g, dtype=F64)
        self.theta = torch.zeros((), dtype=F64, requires_grad=True)
        self.theta_ref, self.lr = theta_ref, lr
        self.records: list[tuple[float, list, float, dict]] = []

    def rows(self, samples, theta, table=None):
        rows = [(table or self.base)[(s.rollout_id, s.t)] + (0 if table else theta * self.feature[(s.rollout_id, s.t)]) for s in samples]
        width = max((r.numel() for r in rows), default=0)
        mask = torch.arange(width)[None, :] < torch.tensor([r.numel() for r in rows])[:, None]
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]), mask

    def logprobs(self, samples, *, grad=True):
        with torch.set_grad_enabled(grad):
            values, mask = self.rows(samples, self.theta)
        return TokenLogprobs(values if grad else values.detach(), mask)

    def ref_logprobs(self, samples):
        values, mask = self.rows(samples, torch.tensor(self.theta_ref, dtype=F64))
        return TokenLogprobs(values.detach(), mask)

    def minimize(self, samples, loss, *, values=False, entropy=False):
        ids = list(dict.fromkeys(s.rollout_id for s in samples))
        first = set(ids[: max(1, len(ids) // 2)])
        total, stats_sum = torch.zeros((), dtype=F64), {}
        for part in ([s for s in samples if s.rollout_id in first], [s for s in samples if s.rollout_id not in first]):
            if not part:
                continue
            new = self.logprobs(part)
            if entropy:
                h, _ = self.rows(part, None, self.h)
                new.entropy = h * torch.exp(self.theta)
            share, stats = loss_share(loss(part, new, None))
            total = total + share
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v
        self.records.append((float(self.theta.detach()), [(s.rollout_id, s.t) for s in samples], float(total.detach()), stats_sum))
        total.backward()
        with torch.no_grad():
            self.theta -= self.lr * self.theta.grad
        self.theta.grad = None
        return {"loss": float(total)}


def off_policy_batch(seed: int = 0) -> RolloutBatch:
    """Two groups of three trajectories, 1-3 turns of 1-4 tokens, sampled by a policy that differs
    from the learner's (sample_logprobs set later from the stand-in's base)."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for k in range(6):
        turns = []
        for t in range(1 + int(torch.randint(3, (1,), generator=g))):
            n = 1 + int(torch.randint(4, (1,), generator=g))
            turns.append(Turn(context_ids=[k, t], response_ids=list(range(n)), sample_logprobs=[0.0] * n))
        trajectories.append(Trajectory(f"task{k // 3}", f"g{k // 3}", f"r{k}", turns, float(k % 3 == 0) + 0.25 * (k % 2), k % 3 == 0))
    return RolloutBatch(trajectories)


def with_sampler(batch: RolloutBatch, policy: ScalarPolicy, seed: int = 1, scale: float = 0.4) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    for trajectory in batch:
        for t, turn in enumerate(trajectory.turns, start=1):
            base = policy.base[(trajectory.rollout_id, t)]
            turn.sample_logprobs = (base + scale * torch.randn(base.shape, generator=g, dtype=F64)).tolist()
    return batch


def verl_rows(batch, keys, table):
    """verl's rows: each trajectory's response tokens of all turns, in order, right-padded."""
    by_rid: dict[str, list] = {}
    for key in keys:
        by_rid.setdefault(key[0], []).append(key)
    rids = list(by_rid)
    rows = [torch.cat([table[k] for k in sorted(by_rid[r], key=lambda k: k[1])]) for r in rids]
    width = max(r.numel() for r in rows)
    mask = torch.arange(width)[None, :] < torch.tensor([r.numel() for r in rows])[:, None]
    return rids, torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]), mask


def verl_step(batch, policy, options, loss_mode, version="0.9.1"):
    """The numbers verl would compute for every recorded minibatch: advantages from the (KL-
    penalized) scores, the rollout correction over the whole batch, then each minibatch's loss."""
    keys = [(s.rollout_id, s.t) for s in batch.samples()]
    theta0 = policy.records[0][0]
    lp = lambda theta: {k: policy.base[k] + theta * policy.feature[k] for k in keys}  # noqa: E731
    old, ref = lp(theta0), lp(policy.theta_ref)
    sampled = {k: torch.tensor(batch[k[0]].turns[k[1] - 1].sample_logprobs, dtype=F64) for k in keys}
    rids, old_rows, mask = verl_rows(batch, keys, old)
    _, ref_rows, _ = verl_rows(batch, keys, ref)
    _, sampled_rows, _ = verl_rows(batch, keys, sampled)
    scores = torch.tensor([batch[r].reward for r in rids], dtype=F64)
    beta = options.get("kl_ctrl", {}).get("kl_coef", 0.001)
    if options.get("use_kl_in_reward"):
        kld = verl_kl_penalty(old_rows, ref_rows, options.get("kl_penalty", "kl")) * mask
        scores = scores - beta * kld.sum(-1)  # token_level_scores - beta * kld, summed by GRPO
        current_kl = float(((kld * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean())  # masked_mean(axis=-1), then mean
    advantages = verl_grpo_advantages(scores, [batch[r].group_id for r in rids])
    weights, keep = torch.ones_like(old_rows), mask
    rc = options.get("rollout_correction")
    if rc:
        if rc.get("rollout_is"):
            weights = verl_is_weights(old_rows - sampled_rows, mask, rc["rollout_is"], rc.get("rollout_is_threshold", 2.0), rc.get("rollout_is_batch_normalize", False))
        if rc.get("rollout_rs"):
            keep = verl_rs_mask(old_rows - sampled_rows, mask, rc["rollout_rs"], str(rc["rollout_rs_threshold"]))
    losses = []
    for theta, mb_keys, _, _ in policy.records:
        idx = [rids.index(r) for r in dict.fromkeys(k[0] for k in mb_keys)]
        _, new_rows, _ = verl_rows(batch, mb_keys, lp(theta))
        width = new_rows.shape[1]
        o, r, w, km = old_rows[idx, :width], ref_rows[idx, :width], weights[idx, :width], keep[idx, :width]
        a = advantages[idx].unsqueeze(-1).expand_as(new_rows)
        # verl v1's trainer: the seq-mean denominators are the mini-batch's row count.
        agg = {"loss_scale_factor": options.get("loss_scale_factor"), "global_batch_size": len(idx)}
        if loss_mode == "gspo":
            agg_mode = options.get("loss_agg", "seq-mean-token-mean")
            pg = verl_gspo_loss(o, new_rows, a, km, 0.2, 0.2, agg_mode, version, weights=w, **agg)
        else:
            agg_mode = options.get("loss_agg", "token-mean")
            pg = verl_agg_loss(verl_vanilla_pg_losses(o, new_rows, a, 0.2, 0.2, 3.0) * w, km, agg_mode, **agg)
        loss = pg
        if options.get("entropy_coeff"):
            _, h_rows, _ = verl_rows(batch, mb_keys, policy.h)
            loss = loss - options["entropy_coeff"] * verl_agg_loss(h_rows * math.exp(theta), km, agg_mode, **agg)
        if options.get("kl_coef", 0.002) > 0:
            loss = loss + options.get("kl_coef", 0.002) * verl_agg_loss(
                verl_kl_penalty(new_rows, r, options.get("kl_estimator", "k3")), km, agg_mode, **agg)
        # Rejection can empty a minibatch: verl's 0/0 is NaN there, the kit's loss 0 (no step).
        losses.append(float(loss) if km.any() else 0.0)
    return losses, (current_kl if options.get("use_kl_in_reward") else None), beta


GRPO_CASES = [
    {"loss_agg": "token-sum"},
    {"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 12.0},
    {"loss_agg": "seq-mean-token-mean", "kl_estimator": "k3+", "kl_coef": 0.05},
    {"use_kl_in_reward": True, "kl_coef": 0.0, "kl_ctrl": {"kl_coef": 0.2}},
    {"use_kl_in_reward": True, "kl_penalty": "low_var_kl", "kl_ctrl": {"type": "adaptive", "kl_coef": 0.3, "target_kl": 0.05, "horizon": 100}},
    {"entropy_coeff": 0.01, "loss_agg": "token-mean"},
    {"entropy_coeff": 0.01, "loss_agg": "seq-mean-token-sum"},
    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5}},
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_is_batch_normalize": True}},
    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.7_1.4"}},
    {"rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"}, "loss_agg": "seq-mean-token-mean"},
    {"rollout_correction": {"rollout_is": "token", "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k3,token_k2",
                            "rollout_rs_threshold": "0.1,0.2"}, "use_kl_in_reward": True, "entropy_coeff": 0.02, "kl_estimator": "mse"},
]


@pytest.mark.parametrize("options", GRPO_CASES, ids=lambda o: ",".join(f"{k}" for k in o))
def test_grpo_with_verls_options_gives_verls_loss_in_every_minibatch(options):
    batch = off_policy_batch()
    policy = ScalarPolicy(batch)
    with_sampler(batch, policy)
    algo = make_algorithm("grpo", {"minibatch_size": 4, "epochs": 2, **options})
    metrics = algo.update(batch, policy, torch.Generator().manual_seed(0))
    expected, current_kl, beta = verl_step(batch, policy, options, "grpo")
    assert len(policy.records) >= 4  # several minibatches, theta moving between them
    assert [r[2] for r in policy.records] == pytest.approx(expected, abs=1e-6)
    if options.get("use_kl_in_reward"):
        assert metrics["reward_kl_penalty"] == pytest.approx(current_kl, abs=1e-6)
        control = options.get("kl_ctrl", {})
        verl = VerlAdaptiveKL(beta, control.get("target_kl", 0.1), control.get("horizon", 10000))
        if control.get("type") == "adaptive":
            verl.update(current_kl, len(batch))
        assert algo.kl_ctrl_in_reward.value == pytest.approx(verl.value, rel=1e-9)
    rc = options.get("rollout_correction", {})
    if rc.get("rollout_rs"):
        assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1


GSPO_CASES = [
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0}},
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": "0.3_3.0", "rollout_is_batch_normalize": True}},
    {"rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"}},
    {"rollout_correction": {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.15}},
    {"use_kl_in_reward": True, "kl_coef": 0.0, "kl_ctrl": {"kl_coef": 0.2}, "entropy_coeff": 0.03},
    {"kl_estimator": "abs", "kl_coef": 0.1, "entropy_coeff": 0.01},
    {"loss_agg": "token-mean", "kl_coef": 0.1, "entropy_coeff": 0.01},
    {"loss_agg": "token-sum", "rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"}},
    {"loss_agg": "seq-mean-token-sum", "kl_coef": 0.05, "kl_estimator": "k1+"},
    {"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 9.0, "entropy_coeff": 0.02,
     "rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0}},
]


@pytest.mark.parametrize("options", GSPO_CASES, ids=lambda o: ",".join(f"{k}" for k in o))
def test_gspo_per_trajectory_with_verls_options_gives_verls_loss_in_every_minibatch(options):
    batch = off_policy_batch(2)
    policy = ScalarPolicy(batch, seed=2, lr=0.1)
    with_sampler(batch, policy, seed=3)
    algo = make_algorithm("gspo", {"minibatch_size": 4, "epochs": 2, "sequence": "trajectory", **options})
    algo.update(batch, policy, torch.Generator().manual_seed(0))
    expected, _, _ = verl_step(batch, policy, options, "gspo")
    assert len(policy.records) >= 4
    assert [r[2] for r in policy.records] == pytest.approx(expected, abs=1e-6)


def test_without_options_the_step_is_the_default_one():
    """The options off change nothing: the same losses as a config without them."""
    batch = off_policy_batch()
    losses = []
    for options in ({}, {"use_kl_in_reward": False, "entropy_coeff": 0.0, "rollout_correction": None}):
        policy = ScalarPolicy(batch)
        make_algorithm("grpo", {"minibatch_size": 4, **options}).update(batch, policy, torch.Generator().manual_seed(0))
        losses.append([r[2] for r in policy.records])
    assert losses[0] == losses[1]


# ------------------------------------------------------------------------------------------
# PPO, SeeUPO, the tabular policy, checkpoints
# ------------------------------------------------------------------------------------------


def test_ppo_gae_with_kl_rewards_and_rejected_tokens_equals_verls():
    batch = off_policy_batch(4)
    g = torch.Generator().manual_seed(9)
    keys = [(s.rollout_id, s.t) for s in batch.samples()]
    values = {k: torch.randn(batch[k[0]].turns[k[1] - 1].num_response_tokens, generator=g, dtype=F64) for k in keys}
    penalties = {k: -0.1 * torch.rand(v.shape, generator=g, dtype=F64) for k, v in values.items()}
    keep = {k: torch.rand(v.shape, generator=g) > 0.3 for k, v in values.items()}
    ours, returns = trajectory_gae(batch, values, 0.95, 0.9, penalties, keep)
    rids, value_rows, mask = verl_rows(batch, keys, values)
    _, penalty_rows, _ = verl_rows(batch, keys, penalties)
    _, keep_rows, _ = verl_rows(batch, keys, {k: v.double() for k, v in keep.items()})
    scores = torch.zeros_like(value_rows)
    for i, rid in enumerate(rids):
        scores[i, int(mask[i].sum()) - 1] = batch[rid].reward  # reward on the last response token
    expected, expected_returns = verl_gae(scores + penalty_rows * mask, value_rows, keep_rows > 0.5, 0.95, 0.9)
    _, ours_rows, _ = verl_rows(batch, keys, ours)
    kept = keep_rows > 0.5
    torch.testing.assert_close(ours_rows[kept], expected[kept], atol=1e-9, rtol=0)
    _, ours_returns, _ = verl_rows(batch, keys, returns)
    torch.testing.assert_close(ours_returns[kept], expected_returns[kept], atol=1e-9, rtol=0)


class Task:
    task_id, num_turns, num_options = "t0", 2, 3

    def reward(self, actions):
        return float(actions[0] == 1) + 0.5 * float(actions[-1] == 2)


def test_entropy_bonus_alone_raises_the_tabular_policys_entropy():
    from seeupo_gym.algorithms.tabular import sample_batch

    for name in ("grpo", "gspo", "seeupo", "ppo"):
        shape = TabularPolicy([Task()]).logits.shape
        policy = TabularPolicy([Task()], lr=0.5, init_logits=torch.randn(shape, generator=torch.Generator().manual_seed(1)))
        table = policy.log_probs_table()
        before = float(-(table.exp() * table.masked_fill(policy.invalid, 0)).sum(-1).mean())
        batch = sample_batch(policy, 4, torch.Generator().manual_seed(0))
        for trajectory in batch:
            trajectory.reward = 0.0  # no advantage: only the bonus moves the policy
        algo = make_algorithm(name, {"entropy_coeff": 1.0, "kl_coef": 0.0, **({"vf_coef": 0.0} if name == "ppo" else {})})
        metrics = algo.update(batch, policy, torch.Generator().manual_seed(0))
        table = policy.log_probs_table()
        after = float(-(table.exp() * table.masked_fill(policy.invalid, 0)).sum(-1).mean())
        assert after > before + 1e-3, name
        assert metrics["entropy"] > 0


def test_seeupo_with_kl_in_reward_starts_m_from_the_penalized_advantages():
    batch = off_policy_batch()
    policy = ScalarPolicy(batch)
    algo = make_algorithm("seeupo", {"use_kl_in_reward": True, "kl_coef": 0.0, "normalization": "group",
                                     "kl_ctrl": {"kl_coef": 0.5}, "minibatch_size": 64})
    algo.update(batch, policy, torch.Generator().manual_seed(0))
    keys = [(s.rollout_id, s.t) for s in batch.samples()]
    rids, old_rows, mask = verl_rows(batch, keys, {k: policy.base[k] for k in keys})
    _, ref_rows, _ = verl_rows(batch, keys, {k: policy.base[k] - 0.5 * policy.feature[k] for k in keys})
    scores = torch.tensor([batch[r].reward for r in rids], dtype=F64) - 0.5 * (verl_kl_penalty(old_rows, ref_rows, "kl") * mask).sum(-1)
    expected = dict(zip(rids, verl_grpo_advantages(scores, [batch[r].group_id for r in rids]).tolist()))
    first = algo.schedule[0]  # the first pool's weights are M_i = A_i
    assert first.weights == pytest.approx({rid: expected[rid] for rid in first.rollout_ids}, abs=1e-6)


def test_seeupo_rollout_correction_masks_and_weighs_its_pool_losses():
    batch = off_policy_batch()
    policy = ScalarPolicy(batch)
    with_sampler(batch, policy)
    plain = ScalarPolicy(batch)
    make_algorithm("seeupo", {"minibatch_size": 64}).update(batch, plain, torch.Generator().manual_seed(0))
    corrected = make_algorithm("seeupo", {"minibatch_size": 64, "rollout_correction": {
        "rollout_is": "sequence", "rollout_is_threshold": 1.2, "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.2}})
    metrics = corrected.update(batch, policy, torch.Generator().manual_seed(0))
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert [r[2] for r in policy.records] != pytest.approx([r[2] for r in plain.records], abs=1e-6)


def test_the_adaptive_coefficient_is_algorithm_state_a_checkpoint_keeps():
    algo = make_algorithm("grpo", {"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "horizon": 10}})
    algo.kl_ctrl_in_reward.update(1.0, 5)
    restored = make_algorithm("grpo", {"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "horizon": 10}})
    restored.load_state_dict(algo.state_dict())
    assert restored.kl_ctrl_in_reward.value == algo.kl_ctrl_in_reward.value == pytest.approx(0.1 * 1.1)
    assert make_algorithm("grpo").state_dict() == {}


def test_the_options_load_from_a_yaml_config_with_verls_names():
    from seeupo_gym.training.config import load_config
    from seeupo_gym.training.trainer import build_algorithm

    config = load_config(None, [
        "algorithm.name=gspo", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl+",
        "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.01, target_kl: 0.05, horizon: 1000}", "algorithm.entropy_coeff=1e-3",
        "algorithm.rollout_correction={rollout_is: sequence, rollout_is_threshold: 0.5_2.0, rollout_rs: seq_mean_k1, rollout_rs_threshold: 0.8_1.25}",
    ])
    algo = build_algorithm(config)
    assert algo.config.kl_ctrl.target_kl == 0.05 and algo.config.entropy_coeff == 1e-3
    assert algo.config.rollout_correction.is_bounds == (0.5, 2.0)
    from seeupo_gym.training.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.kl_ctrl"):
        build_algorithm(load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl={typo: 1}"]))


@pytest.mark.slow
def test_the_llm_learners_token_entropy_and_its_gradient_equal_the_full_softmaxs():
    """The learner's chunked, checkpointed entropy against the entropy of the model's full logits."""
    import copy

    from trainer_helpers import synthetic_batch

    from seeupo_gym.agents.models import load_model
    from seeupo_gym.training.learner import LLMLearner
    from accelerate import Accelerator

    model, tokenizer = load_model("tiny", seed=0)
    reference_model = copy.deepcopy(model)
    samples = synthetic_batch().samples()
    learner = LLMLearner(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=1.0), pad_token_id=tokenizer.pad_token_id,
                         reference=copy.deepcopy(model), max_grad_norm=0.0, max_tokens_per_microbatch=40, logit_chunk=3)
    captured = {}
    tokens = sum(s.turn.num_response_tokens for s in samples)

    def loss(part, new, values):
        for s, row, m in zip(part, new.entropy, new.mask):
            captured[(s.rollout_id, s.t)] = row[m].detach()
        return core.aggregate(new.entropy, new.mask, "token-sum") / tokens

    head_before = reference_model.get_output_embeddings().weight.detach().clone()
    learner.minimize(samples, loss, entropy=True)
    expected_total = 0.0
    for s in samples:
        ids = torch.tensor([list(s.turn.context_ids) + list(s.turn.response_ids)])
        logits = reference_model(input_ids=ids).logits[0, len(s.turn.context_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(captured[(s.rollout_id, s.t)], entropy.detach(), atol=1e-4, rtol=0)
        expected_total = expected_total + entropy.sum() / tokens
    expected_total.backward()
    # One SGD step of lr 1 moved the head by minus the gradient of the mean entropy.
    step = head_before - model.get_output_embeddings().weight.detach()
    grad = reference_model.get_output_embeddings().weight.grad
    torch.testing.assert_close(step, grad, atol=1e-7, rtol=0)  # float32 rounding of w - lr * g; max |g| ~ 6e-5
    assert grad.abs().max() > 1e-5


def test_checkpoints_carry_the_adaptive_coefficient(tmp_path):
    """What the trainer keeps of the algorithm: its state_dict, as JSON in trainer_state.json."""
    import json

    options = {"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "horizon": 10}}
    algo = make_algorithm("gspo", options)
    algo.kl_ctrl_in_reward.update(0.0, 5)  # 0.1 * (1 - 0.2 * 5 / 10)
    saved = json.dumps({"algorithm": algo.state_dict()})
    algo.kl_ctrl_in_reward.update(1.0, 10)
    algo.load_state_dict(json.loads(saved)["algorithm"])
    assert algo.kl_ctrl_in_reward.value == pytest.approx(0.09)


VERL_RUN = ("algorithm.name=grpo", "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0",
            "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.05, target_kl: 1e-6, horizon: 10}",
            "algorithm.entropy_coeff=0.01", "algorithm.loss_agg=token-sum",
            "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 0.5_2.0, rollout_rs: token_k2, rollout_rs_threshold: 0.5}")


@pytest.mark.slow
def test_a_resumed_run_with_verls_options_repeats_step_2_and_its_kl_coefficient(tmp_path):
    """The real trainer and LLM learner on the tiny model: the options wire through, and the adaptive
    coefficient of step 2 comes back from the step-1 checkpoint."""
    from trainer_helpers import tiny_config

    from seeupo_gym.training.checkpoint import checkpoints
    from seeupo_gym.training.trainer import Trainer

    common = (*VERL_RUN, "train.steps=2", "env.kwargs={max_turns: 1}")
    config = tiny_config(tmp_path / "a", *common, "train.save_every=1", "train.keep_checkpoints=5")
    with Trainer(config) as trainer:
        records = trainer.train()
    step1, step2 = records
    # Step 1 starts at the reference (KL 0, below target): beta *= 1 - 0.2 * n / horizon, n trajectories.
    n = config.train.tasks_per_step * config.train.group_size
    assert step1["update/reward_kl_penalty"] == 0 and step1["update/reward_kl_penalty_coeff"] == pytest.approx(0.05)
    assert step2["update/reward_kl_penalty_coeff"] == pytest.approx(0.05 * (1 - 0.2 * n / 10))
    assert step1["update/entropy"] > 0
    saved = checkpoints(tmp_path / "a" / "run" / "checkpoints")
    with Trainer(tiny_config(tmp_path / "b", *common, f"resume_from={saved[0]}")) as trainer:
        again = trainer.train()[0]
    for key in ("update/reward_kl_penalty_coeff", "update/policy_loss", "update/entropy"):
        assert again[key] == pytest.approx(step2[key], abs=1e-6), key


@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
def test_sequence_loss_under_each_loss_agg_has_verls_gspo_value_and_gradient(mode):
    values, mask = rows_and_mask(2)
    g = torch.Generator().manual_seed(8)
    old = -torch.rand(values.shape, generator=g, dtype=F64) * 3
    adv = torch.randn(values.shape[0], generator=g, dtype=F64)
    ref = old - 0.3 * torch.rand(values.shape, generator=g, dtype=F64)
    ours_new = (old + 0.2 * values).clone().requires_grad_(True)
    verl_new = ours_new.detach().clone().requires_grad_(True)
    loss, _ = core.sequence_policy_loss(TokenLogprobs(ours_new, mask), old, adv, clip_low=0.2, clip_high=0.2, ref=ref,
                                        kl_coef=0.1, loss_agg=mode, loss_scale_factor=5.0)
    a = adv.unsqueeze(-1).expand_as(old)
    expected = verl_agg_loss(verl_gspo_pg_losses(old, verl_new, a, mask, 0.2, 0.2), mask, mode, 5.0) + 0.1 * verl_agg_loss(
        verl_kl_penalty(verl_new, ref, "k3"), mask, mode, 5.0)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(ours_new.grad * mask, verl_new.grad * mask, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------
# GSPO's policy aggregation (verl 0.9.0 against 0.9.1), verl v1's seq-mean denominator, dtypes
# ------------------------------------------------------------------------------------------

GSPO_090_CASES = [
    {"loss_agg": "token-mean", "policy_loss_agg": "seq-mean-token-mean", "kl_coef": 0.1},
    {"loss_agg": "token-sum", "policy_loss_agg": "seq-mean-token-mean", "kl_coef": 0.05, "entropy_coeff": 0.01},
    {"loss_agg": "seq-mean-token-sum", "policy_loss_agg": "seq-mean-token-mean", "kl_estimator": "k1+", "kl_coef": 0.05},
]


@pytest.mark.parametrize("options", GSPO_090_CASES, ids=lambda o: o["loss_agg"])
def test_gspo_policy_per_sequence_and_kl_per_token_gives_verl_090s_loss(options):
    """verl 0.9.0's `compute_policy_loss_gspo` hard-codes `loss_agg_mode="seq-mean-token-mean"` for
    the policy term; its KL and entropy follow `loss_agg_mode`. `policy_loss_agg` expresses it."""
    batch = off_policy_batch(2)
    policy = ScalarPolicy(batch, seed=2, lr=0.1)
    with_sampler(batch, policy, seed=3)
    algo = make_algorithm("gspo", {"minibatch_size": 4, "epochs": 2, "sequence": "trajectory", **options})
    algo.update(batch, policy, torch.Generator().manual_seed(0))
    expected, _, _ = verl_step(batch, policy, options, "gspo", version="0.9.0")
    other, _, _ = verl_step(batch, policy, options, "gspo", version="0.9.1")
    assert len(policy.records) >= 4
    assert [r[2] for r in policy.records] == pytest.approx(expected, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(expected, other)) > 1e-2  # the two versions differ here


def test_gspo_config_refuses_an_unknown_policy_loss_agg():
    with pytest.raises(ValueError, match="policy_loss_agg"):
        make_algorithm("gspo", {"policy_loss_agg": "seq-mean"})


REJECTING_WHOLE_SEQUENCES = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1}


@pytest.mark.parametrize("algorithm,mode", [("grpo", "seq-mean-token-mean"), ("grpo", "seq-mean-token-sum"),
                                            ("gspo", "seq-mean-token-mean"), ("gspo", "seq-mean-token-sum-norm")])
def test_seq_mean_denominator_is_the_minibatchs_row_count_when_rejection_empties_a_sequence(algorithm, mode):
    """verl v1 passes `global_batch_size` = the mini-batch's rows to `agg_loss`, so a sequence that
    rejection empties still counts in the seq-mean denominator (agg_loss alone would drop it)."""
    options = {"loss_agg": mode, "loss_scale_factor": 7.0, "rollout_correction": REJECTING_WHOLE_SEQUENCES}
    batch = off_policy_batch(2)
    policy = ScalarPolicy(batch, seed=2, lr=0.1)
    with_sampler(batch, policy, seed=3, scale=0.6)
    extra = {"sequence": "trajectory"} if algorithm == "gspo" else {}
    algo = make_algorithm(algorithm, {"minibatch_size": 4, "epochs": 2, **extra, **options})
    metrics = algo.update(batch, policy, torch.Generator().manual_seed(0))
    assert 0.3 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 0.95
    expected, _, _ = verl_step(batch, policy, options, algorithm)
    assert [r[2] for r in policy.records] == pytest.approx(expected, abs=1e-6)
    # The control: agg_loss alone (rows that keep a token) gives other numbers on this batch.
    alone = verl_step_with_agg_alone(batch, policy, options, algorithm)
    assert max(abs(a - b) for a, b in zip(alone, expected)) > 1e-3


@pytest.mark.parametrize("algorithm,mode", [("grpo", "seq-mean-token-mean"), ("grpo", "seq-mean-token-sum"),
                                            ("gspo", "seq-mean-token-mean"), ("gspo", "seq-mean-token-sum-norm")])
def test_seq_mean_denominator_counts_a_zero_length_row_as_verl_v1_does(algorithm, mode):
    """verl v1's `global_batch_size` is the mini-batch's row count: a trajectory that sampled no token
    (one zero-length row in six) counts in the seq-mean denominator as a rejected one does."""
    options = {"loss_agg": mode, "loss_scale_factor": 7.0}
    batch = off_policy_batch(2)
    batch["r4"].turns = [Turn(context_ids=[4, 0], response_ids=[], sample_logprobs=[])]
    policy = ScalarPolicy(batch, seed=2, lr=0.1)
    with_sampler(batch, policy, seed=3, scale=0.6)
    extra = {"sequence": "trajectory"} if algorithm == "gspo" else {}
    algo = make_algorithm(algorithm, {"minibatch_size": 4, "epochs": 2, **extra, **options})
    algo.update(batch, policy, torch.Generator().manual_seed(0))
    assert any(("r4", 1) in r[1] for r in policy.records)
    expected, _, _ = verl_step(batch, policy, options, algorithm)
    assert [r[2] for r in policy.records] == pytest.approx(expected, abs=1e-6)
    # The control: counting only the rows that have a token (the kit before) gives other numbers.
    alone = verl_step_with_agg_alone(batch, policy, options, algorithm)
    assert max(abs(a - b) for a, b in zip(alone, expected)) > 1e-3


def verl_step_with_agg_alone(batch, policy, options, algorithm):
    global verl_agg_loss
    saved = verl_agg_loss
    verl_agg_loss = lambda *a, global_batch_size=None, **k: saved(*a, **k)  # noqa: E731
    try:
        return verl_step(batch, policy, options, algorithm)[0]
    finally:
        verl_agg_loss = saved


class Float64Values:
    """Stand-in learner (float64) that reports values too, for the table dtypes."""

    def __init__(self, batch):
        self.policy = ScalarPolicy(batch)

    def logprobs(self, samples, *, grad=True):
        return self.policy.logprobs(samples, grad=grad)

    def ref_logprobs(self, samples):
        return self.policy.ref_logprobs(samples)

    def values(self, samples):
        rows, _ = self.policy.rows(samples, None, self.policy.h)
        return rows / 3.0 + 1e-9


def test_a_float64_learners_tables_are_float64():
    """Frozen logprobs, values, GAE and rollout weights in the learner's dtype: a float32 table
    rounds a float64 learner's logprobs by ~1e-7 relative, far above float64 parity."""
    batch = off_policy_batch(4)
    learner = Float64Values(batch)
    with_sampler(batch, learner.policy)
    samples = batch.samples()
    old = core.frozen_logprobs(learner, samples)
    values = core.frozen_values(learner, samples)
    assert {v.dtype for v in old.values()} == {F64} and {v.dtype for v in values.values()} == {F64}
    for s in samples:  # bit for bit the learner's numbers
        key = (s.rollout_id, s.t)
        assert torch.equal(old[key], learner.policy.base[key])
        assert torch.equal(values[key], learner.policy.h[key] / 3.0 + 1e-9)
    advantages, returns = trajectory_gae(batch, values, 1.0, 0.95)
    assert {a.dtype for a in advantages.values()} == {F64} and {r.dtype for r in returns.values()} == {F64}
    correction = correct(samples, old, RolloutCorrection(rollout_is="sequence", rollout_is_threshold=5.0), "trajectory")
    assert {w.dtype for w in correction.weights.values()} == {F64}
    # Float64 parity of the weights against verl's formula, read off compute_rollout_correction_weights
    # (sequence: exp(sum log ratio) truncated at the threshold), to 1e-12 relative.
    keys = [(s.rollout_id, s.t) for s in samples]
    sampled = {k: torch.tensor(batch[k[0]].turns[k[1] - 1].sample_logprobs, dtype=F64) for k in keys}
    rids, old_rows, mask = verl_rows(batch, keys, old)
    _, sampled_rows, _ = verl_rows(batch, keys, sampled)
    expected = verl_is_weights(old_rows - sampled_rows, mask, "sequence", 5.0, False)
    for i, rid in enumerate(rids):
        ours = torch.cat([correction.weights[(rid, t)] for t in range(1, batch[rid].num_turns + 1)])
        torch.testing.assert_close(ours, expected[i, : ours.numel()], rtol=1e-12, atol=0)
