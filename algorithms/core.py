"""Shared parts of every algorithm, each defined once.

The first half are pure functions, tensors in and tensors out: advantages, ratios, the
clipped objective (with PPO's dual clip), the KL estimators, loss aggregation, GAE and the
value loss. The second half is
the small amount of glue the algorithm modules share: per-trajectory advantages of a batch,
logprobs recomputed at the start of a step keyed by sample, minibatching, and the two policy
losses (token-level and sequence-level) assembled from the pure parts.

Losses are written as shares: given the minibatch-wide counts (`Totals`), the loss of any
part of a minibatch is that part's sum divided by the minibatch's count, so the shares of the
micro-batches a learner cuts add up to the minibatch loss exactly (token-mean over the whole
minibatch, not a mean of micro-batch means). Without `totals` a tensor is its own minibatch.

Shapes: `[n, L]` tensors are per-token, right-padded, with a boolean `mask` of real tokens.

Sequences in a multi-turn batch. A row is one turn's response; a "sequence" (the unit of the
`seq-mean-*` aggregations and of GSPO's ratio) is either that turn (`turn`, the SeeUPO paper's
per-turn sequences) or the whole trajectory, all turns' response tokens together (`trajectory`,
verl's: one row per trajectory, observation tokens masked). `token-mean` is the same either way.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

import torch

from seeupo_gym.algorithms.base import Learner, MicroLoss, TokenLogprobs, loss_share
from seeupo_gym.algorithms.rollout import RolloutBatch, TurnSample

NORMALIZATIONS = ("none", "group", "batch")
LOSS_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SEQUENCES = ("turn", "trajectory")
# verl's names (`kl_penalty`, `kl_loss_type`): k1 = kl, k2 = mse, k3 = low_var_kl, abs, and the
# straight-through `name+` forms (algorithms/kl.py).
_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATORS = _KL_NAMES + tuple(name + "+" for name in _KL_NAMES)
EPS = 1e-6
# Token log-ratios are clamped before exp (as verl): beyond e^20 every ratio is clipped anyway,
# and exp of a larger one overflows float32 into inf * 0 = nan gradients.
LOG_RATIO_CLAMP = 20.0
# GSPO's mean log-ratio is clamped above at 10 before exp (verl's `compute_policy_loss_gspo`): past it
# the ratio is e^10 and has no gradient. Below there is no clamp: exp underflows to 0, harmlessly.
SEQUENCE_LOG_RATIO_CLAMP = 10.0
# The k3 estimate is clamped to [-KL_CLAMP, KL_CLAMP] (verl's low_var_kl): one token far from the
# reference gives e^|log-ratio|, which would otherwise swamp the loss and its gradient.
KL_CLAMP = 10.0

# ---------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------


def _std(x: torch.Tensor) -> torch.Tensor:
    # Unbiased (Bessel) like verl's GRPO; a single element has no spread, so std 0.
    return x.std() if x.numel() > 1 else x.new_zeros(())


def _group_baseline(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (mean, std) of one group. A group of one has no baseline: mean 0 and std 1, so its advantage
    # is its reward, as verl's GRPO (`compute_grpo_outcome_advantage`), not 0.
    if rewards.numel() == 1:
        return rewards.new_zeros(()), rewards.new_ones(())
    return rewards.mean(), _std(rewards)


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, normalization: str = "group", eps: float = EPS
) -> torch.Tensor:
    """GRAE, one advantage per trajectory: `A_i = R_i - mean_{j in group(i)} R_j`, then normalized.

    normalization: `none`; `group`: `A_i / (std_group(i)(R) + eps)`; `batch`:
    `(A_i - mean(A)) / (std(A) + eps)` over the N trajectories given (never padded turn samples).
    A group of one (`train.group_size: 1`, or a group thinned by `select_for_update`) has mean 0 and
    std 1, as in verl: `A_i = R_i` (`group`: `R_i / (1 + eps)`).
    rewards [N] float, group_index [N] long.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown normalization {normalization!r}; choose one of {NORMALIZATIONS}")
    rewards = rewards.to(torch.float64)
    advantages = torch.empty_like(rewards)
    group_std = torch.empty_like(rewards)
    for g in torch.unique(group_index):
        members = group_index == g
        mean, std = _group_baseline(rewards[members])
        advantages[members] = rewards[members] - mean
        group_std[members] = std
    if normalization == "group":
        advantages = advantages / (group_std + eps)
    elif normalization == "batch":
        advantages = (advantages - advantages.mean()) / (_std(advantages) + eps)
    return advantages


def token_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`rho = exp(l_new - l_old)` per token, the log-ratio clamped to +-LOG_RATIO_CLAMP; 1 at padding."""
    log_ratio = torch.clamp(logp_new - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(torch.where(mask, log_ratio, torch.zeros_like(logp_new)))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over real tokens (of each row when dim=-1); 0 where a row has none."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def sequence_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalized sequence ratio `s(y) = exp(min(mean_tokens(l_new - l_old), 10))`, [n].

    The clamp is verl's: it writes the ratio per token as `sg(log s) + l_new - sg(l_new)` and clamps
    that at 10, which has the value and the gradient of clamping the mean itself.
    """
    return torch.exp(masked_mean(logp_new - logp_old, mask, dim=-1).clamp(max=SEQUENCE_LOG_RATIO_CLAMP))


def clipped_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> torch.Tensor:
    """`clip_obj(r, A) = min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, elementwise (to be maximized).

    clip_ratio_c: dual clip (Ye et al. 2020, verl's `clip_ratio_c`): where A < 0 the objective is
    at least `c*A`, so a token whose probability grew far (r > c) adds a bounded loss and no gradient.
    """
    objective = torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages)
    if clip_ratio_c is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, clip_ratio_c * advantages), objective)
    return objective


def clip_fraction(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Elementwise 1.0 where the clipped branch is the active (gradient-free) one."""
    clipped = ((ratio < 1.0 - clip_low) & (advantages < 0)) | ((ratio > 1.0 + clip_high) & (advantages > 0))
    return clipped.to(ratio.dtype)


def kl_estimate(logp_new: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, by verl's names (`kl.kl_penalty`):
    k1 = kl: `l_new - l_ref`; abs: `|l_new - l_ref|`; k2 = mse: `0.5 (l_new - l_ref)^2`;
    k3 = low_var_kl: `exp(d) - d - 1`, `d = l_ref - l_new` clamped to +-LOG_RATIO_CLAMP, the estimate
    clamped to [-KL_CLAMP, KL_CLAMP]; `name+`: the value of `name` with the gradient of k2.
    """
    from seeupo_gym.algorithms.kl import kl_penalty  # kl.py builds on this module

    return kl_penalty(logp_new, logp_ref, estimator)


def behaviour_weights(
    logp_old: torch.Tensor,
    logp_sampled: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    *,
    level: str = "token",
    totals: Totals | None = None,
) -> torch.Tensor:
    """Truncated importance weight of the learner's step-start policy over the sampling policy (TIS).

    token: `min(exp(l_old - l_sampled), cap)` per token, [n, L] (1 at padding), as verl's token-level
    rollout importance sampling (`rollout_is: token`) and TRL's `token_truncate`;
    sequence: `min(exp(mean_tokens(l_old - l_sampled)), cap)` per sequence, [k]: a row, or with
    trajectory totals all of a trajectory's response tokens (`sequence_means`), one weight per
    trajectory. Length-normalized like GSPO's `s(y)`: verl's `rollout_is: sequence` takes the product
    `min(exp(sum_tokens(..)), cap)` instead, which over a multi-turn trajectory of thousands of tokens
    is almost always 0 or the cap once the weights are a step old (a mean drift of 0.01 nats per token
    over 2,000 tokens is e^20). Detached: it reweights the samples, it is not optimized. 1 wherever the
    sampler's weights are the learner's (up to floating point).
    """
    log_ratio = (logp_old - logp_sampled).detach()
    if level == "sequence":
        return torch.exp(sequence_means(log_ratio, mask, totals)[0]).clamp(max=cap)
    if level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return torch.exp(torch.where(mask, log_ratio, torch.zeros_like(log_ratio))).clamp(max=cap)


@dataclass(frozen=True)
class Totals:
    """Counts over a whole minibatch: the denominators of its token- and sequence-means.

    With sequences = trajectories (`of(samples, "trajectory")`) a trajectory's turns may be scored
    in different parts, so a part's rows must be told their trajectory: pass `totals.part(part)`.
    """

    # Sequences of the minibatch: turns, or trajectories, zero-length ones included (the minibatch's
    # row count, verl v1's `global_batch_size`; `options.totals` keeps rows that rejection emptied).
    samples: int
    tokens: int
    # Response tokens of each trajectory of the minibatch, by rollout_id (sequences = trajectories).
    trajectory_tokens: Mapping[str, int] | None = None
    # Set by `part`: each row's rollout_id, and the token count of the sequence it belongs to.
    row_ids: tuple[str, ...] | None = None
    row_sequence_tokens: tuple[int, ...] | None = None
    # Sequences with a response token: the denominator of per-sequence diagnostics (ratio, clip
    # fraction), which a zero-length row has none of; None: `samples`.
    with_tokens: int | None = None

    @classmethod
    def of(cls, samples: Sequence[TurnSample], sequence: str = "turn") -> "Totals":
        tokens = sum(s.turn.num_response_tokens for s in samples)
        if sequence == "turn":
            return cls(len(samples), tokens, with_tokens=sum(1 for s in samples if s.turn.num_response_tokens))
        if sequence != "trajectory":
            raise ValueError(f"unknown sequence {sequence!r}; choose one of {SEQUENCES}")
        per_trajectory: dict[str, int] = defaultdict(int)
        for s in samples:
            per_trajectory[s.rollout_id] += s.turn.num_response_tokens
        # verl v1 counts every row of a mini-batch, a zero-length one too (`ppo_mini_batch_size * n`).
        return cls(len(per_trajectory), tokens, dict(per_trajectory),
                   with_tokens=sum(1 for n in per_trajectory.values() if n))

    @classmethod
    def of_mask(cls, mask: torch.Tensor) -> "Totals":
        return cls(int(mask.any(dim=-1).sum()), int(mask.sum()))

    def part(self, part: Sequence[TurnSample]) -> "Totals":
        """These totals for the rows `part` (needed when sequences are trajectories)."""
        if self.trajectory_tokens is None:
            return self
        ids = tuple(s.rollout_id for s in part)
        return replace(self, row_ids=ids, row_sequence_tokens=tuple(self.trajectory_tokens[i] for i in ids))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    totals: Totals | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [n, L] to a scalar: these rows' share of the minibatch's aggregate
    (verl's `agg_loss`).

    token-mean: every real token of the minibatch weighs the same;
    token-sum: the sum over the minibatch's tokens (no normalization);
    seq-mean-token-mean: mean over sequences of each sequence's token mean;
    seq-mean-token-sum: mean over sequences of each sequence's token sum;
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (verl's default factor is the
    padded response length; here it must be given, so that the loss does not depend on padding).
    A sequence is a row, or with trajectory totals (`Totals.of(.., "trajectory").part(rows)`) the
    trajectory the row belongs to.
    """
    totals = totals or Totals.of_mask(mask)
    real = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * real).sum() / max(totals.tokens, 1)
    if mode == "token-sum":
        return (values * real).sum()
    if mode == "seq-mean-token-mean":
        if totals.trajectory_tokens is None:
            return masked_mean(values, mask, dim=-1).sum() / max(totals.samples, 1)
        if totals.row_sequence_tokens is None:
            raise ValueError("trajectory totals need the part's rows: pass totals.part(part)")
        lengths = torch.tensor(totals.row_sequence_tokens, dtype=values.dtype, device=values.device).clamp(min=1)
        return ((values * real).sum(-1) / lengths).sum() / max(totals.samples, 1)
    if mode == "seq-mean-token-sum":
        return (values * real).sum() / max(totals.samples, 1)
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not loss_scale_factor > 0:
            raise ValueError(f"seq-mean-token-sum-norm needs loss_scale_factor > 0, got {loss_scale_factor!r}")
        return (values * real).sum() / max(totals.samples, 1) / loss_scale_factor
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation along each row's real tokens; returns (advantages, returns).

    Rows are whole trajectories: the response tokens of all turns in order, left-aligned (observation
    tokens are not timesteps). The step after a row's last real token is terminal (value 0).
    `delta_j = r_j + gamma V_{j+1} - V_j`, `A_j = delta_j + gamma lam A_{j+1}`, `returns = A + V`.
    """
    n, length = values.shape
    real = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(n)
    next_advantage = values.new_zeros(n)
    for j in reversed(range(length)):
        delta = token_rewards[:, j] + gamma * next_value - values[:, j]
        advantages[:, j] = (delta + gamma * lam * next_advantage) * real[:, j]
        # Padding passes the terminal zeros through to the last real token.
        next_value = torch.where(mask[:, j], values[:, j], next_value)
        next_advantage = torch.where(mask[:, j], advantages[:, j], next_advantage)
    returns = (advantages + values) * real
    return advantages, returns


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    totals: Totals | None = None,
) -> torch.Tensor:
    """PPO's clipped value loss, token-mean: `0.5 max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)`."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * aggregate(losses, mask, "token-mean", totals)


WHITEN_EPS = 1e-8


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + eps)` over real tokens (unbiased var, verl's convention); 0 at padding."""
    real = values[mask]
    var = real.var() if real.numel() > 1 else real.new_zeros(())
    return torch.where(mask, (values - real.mean()) * torch.rsqrt(var + eps), torch.zeros_like(values))


# ---------------------------------------------------------------------------------------
# Glue shared by the algorithm modules
# ---------------------------------------------------------------------------------------

SampleKey = tuple[str, int]  # (rollout_id, turn)


def sample_key(sample: TurnSample) -> SampleKey:
    return (sample.rollout_id, sample.t)


TRUNCATED_MODES = ("score", "mask")


def select_for_update(
    batch: RolloutBatch, *, truncated: str = "score", drop_flat_groups: bool = False
) -> tuple[RolloutBatch, dict[str, float]]:
    """The trajectories an update learns from, and counts of those left out.

    - An episode that never started (no turn: e.g. its first context was over the token budget)
      is not an outcome of the policy: it is always left out, so it moves no group-mate's advantage.
    - truncated: `score` trains on a truncated episode with the reward the env gave it; `mask`
      leaves it out of the update and of its group's statistics (DAPO's overlong filtering).
    - drop_flat_groups: leave out groups of two or more rollouts that all got one reward (DAPO's
      dynamic sampling): their group-relative advantage is 0, yet `batch` normalization would shift
      it. A group of one is kept, as verl's DAPO does: it has no baseline, so its advantage is its
      reward (`group_advantages`).
    Every built-in `Algorithm.update` applies this itself (`Algorithm.selection`); the trainer only
    sets the options from `train.truncated` and `train.drop_flat_groups`.
    """
    if truncated not in TRUNCATED_MODES:
        raise ValueError(f"unknown truncated mode {truncated!r}; choose one of {TRUNCATED_MODES}")
    kept = [t for t in batch if t.turns]
    counts = {"never_started": float(len(batch) - len(kept))}
    if truncated == "mask":
        counts["truncated_masked"] = float(sum(t.truncated for t in kept))
        kept = [t for t in kept if not t.truncated]
    if drop_flat_groups:
        rewards: dict[str, list[float]] = defaultdict(list)
        for t in kept:
            rewards[t.group_id].append(t.reward)
        flat = {g for g, r in rewards.items() if len(r) > 1 and len(set(r)) == 1}
        counts["flat_groups_dropped"] = float(len(flat))
        kept = [t for t in kept if t.group_id not in flat]
    return RolloutBatch(kept), counts


def trajectory_advantages(
    batch: RolloutBatch, normalization: str, rewards: Mapping[str, float] | None = None
) -> dict[str, float]:
    """GRAE advantage of every trajectory of the batch, keyed by rollout_id (groups = group_id);
    `rewards` replace the trajectories' own (e.g. with a KL penalty, `options.prepare_step`)."""
    ids = batch.rollout_ids
    group_names = {name: k for k, name in enumerate(batch.groups())}
    reward_of = rewards if rewards is not None else {rid: batch[rid].reward for rid in ids}
    rewards = torch.tensor([reward_of[rid] for rid in ids], dtype=torch.float64)
    groups = torch.tensor([group_names[batch[rid].group_id] for rid in ids])
    advantages = group_advantages(rewards, groups, normalization)
    return dict(zip(ids, advantages.tolist()))


def pad_rows(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Stack 1-D tensors right-padded with zeros to `length`."""
    if not rows:
        return torch.zeros(0, length)
    out = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    if out.shape[1] < length:
        out = torch.nn.functional.pad(out, (0, length - out.shape[1]))
    return out


def table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a step's tables (frozen logprobs, values, GAE, rollout weights) are kept in: the
    learner's, at least float32 (a float64 learner keeps float64 tables; bf16/fp16 are widened)."""
    return torch.promote_types(dtype, torch.float32)


def _split(tokens: TokenLogprobs) -> list[torch.Tensor]:
    # Kept on the CPU: a step's frozen logprobs are small and outlive the minibatch.
    flat = tokens.logprobs.detach()[tokens.mask]
    flat = flat.to(table_dtype(flat.dtype)).cpu()
    return list(torch.split(flat, tokens.mask.sum(dim=1).tolist()))


def frozen_logprobs(
    learner: Learner, samples: Sequence[TurnSample], *, reference: bool = False
) -> dict[SampleKey, torch.Tensor]:
    """Logprobs of every sample under the current (or, with reference=True, the reference) policy,
    without autograd, keyed by (rollout_id, turn) so that any later reordering of the samples finds
    its own row. The learner cuts the pass into micro-batches itself."""
    with torch.no_grad():
        tokens = learner.ref_logprobs(samples) if reference else learner.logprobs(samples, grad=False)
    return {sample_key(s): row for s, row in zip(samples, _split(tokens))}


def old_logprobs(
    learner: Learner, samples: Sequence[TurnSample], minibatch_size: int, epochs: int
) -> dict[SampleKey, torch.Tensor] | None:
    """`frozen_logprobs`, or None when the update is one optimizer step over all of `samples`.

    Then the weights being optimized are the weights the old logprobs would come from, so the
    gradient pass's own logprobs, detached, are the old ones (`old_or_detached`): the same loss
    and gradient without a second forward over every token.
    """
    if epochs == 1 and len(samples) <= minibatch_size:
        return None
    return frozen_logprobs(learner, samples)


def old_or_detached(
    old: dict[SampleKey, torch.Tensor] | None, samples: Sequence[TurnSample], new: torch.Tensor
) -> torch.Tensor:
    """The old logprobs of `samples` shaped like `new`: gathered from `old`, or `new` detached."""
    return new.detach() if old is None else gather(old, samples, new)


def frozen_values(learner: Learner, samples: Sequence[TurnSample]) -> dict[SampleKey, torch.Tensor]:
    """Value estimates of every sample's response tokens, without autograd, keyed like `frozen_logprobs`."""
    with torch.no_grad():
        values = learner.values(samples).detach()
        values = values.to(table_dtype(values.dtype)).cpu()
    return {sample_key(s): row[: s.turn.num_response_tokens] for s, row in zip(samples, values)}


def gather(table: dict[SampleKey, torch.Tensor], samples: Sequence[TurnSample], like: torch.Tensor) -> torch.Tensor:
    """The rows of `table` for `samples`, in their order, padded to `like`'s length, on its device and dtype."""
    return pad_rows([table[sample_key(s)] for s in samples], like.shape[1]).to(device=like.device, dtype=like.dtype)


def per_sample(weights: dict[str, float], samples: Sequence[TurnSample], like: torch.Tensor) -> torch.Tensor:
    """Each sample's trajectory weight (advantage, M) looked up by rollout_id, [n] on `like`'s device."""
    return torch.tensor([weights[s.rollout_id] for s in samples], dtype=like.dtype, device=like.device)


def frozen_sequence_ratios(
    new: dict[SampleKey, torch.Tensor], old: dict[SampleKey, torch.Tensor], samples: Sequence[TurnSample]
) -> torch.Tensor:
    """`s(y)` of each sample from two tables of frozen logprobs, [n] (no autograd)."""
    rows_new = [new[sample_key(s)] for s in samples]
    lengths = torch.tensor([r.numel() for r in rows_new], dtype=torch.long)
    length = int(lengths.max()) if len(rows_new) else 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return sequence_ratio(pad_rows(rows_new, length), pad_rows([old[sample_key(s)] for s in samples], length), mask)


def packing_with(samples: Sequence[TurnSample], others: Sequence[TurnSample]) -> list[TurnSample]:
    """The `samples` that one packed sequence scores together with their trajectory's sample in
    `others` (the earlier turn's context + response is a prefix of the later turn's context), so a
    learner feeding `others` scores them at little or no extra cost and in the same micro-batch."""
    by_trajectory = {s.rollout_id: s for s in others}
    out = []
    for sample in samples:
        other = by_trajectory.get(sample.rollout_id)
        if other is None or other.t == sample.t:
            continue
        early, late = sorted((sample, other), key=lambda s: s.t)
        scored = list(early.turn.context_ids) + list(early.turn.response_ids)
        if list(late.turn.context_ids[: len(scored)]) == scored:
            out.append(sample)
    return out


def select_rows(tokens: TokenLogprobs, rows: Sequence[int]) -> TokenLogprobs:
    """The rows `rows` of `tokens` (autograd kept), with their sampling logprobs when present."""
    index = torch.tensor(list(rows), dtype=torch.long, device=tokens.mask.device)
    sampled = tokens.sampled[index] if tokens.sampled is not None else None
    entropy = tokens.entropy[index] if tokens.entropy is not None else None
    return TokenLogprobs(tokens.logprobs[index], tokens.mask[index], sampled=sampled, sampled_cap=tokens.sampled_cap,
                         entropy=entropy)


def part_sequence_ratios(
    part: Sequence[TurnSample], new: TokenLogprobs, old: dict[SampleKey, torch.Tensor], which
) -> dict[str, float]:
    """`s(y)` of the rows of `part` that `which(sample)` picks, from `new` detached, by rollout_id."""
    rows = [j for j, s in enumerate(part) if which(s)]
    if not rows:
        return {}
    picked = select_rows(new, rows)
    samples = [part[j] for j in rows]
    ratios = sequence_ratio(picked.logprobs.detach(), gather(old, samples, picked.logprobs), picked.mask)
    return dict(zip([s.rollout_id for s in samples], ratios.tolist()))


# Ratios measured inside a gradient pass travel back through `minimize`'s summed diagnostics (each
# is reported by the one part, on the one process, that scored it), so every process sees them all.
_RATIO_PREFIX = "ratio_after/"


def measuring_alongside(turn: int, extra: Sequence[TurnSample], old: dict[SampleKey, torch.Tensor], loss) -> MicroLoss:
    """A `MicroLoss` for a minibatch of turn `turn` samples scored together with `extra` samples of
    other turns (`packing_with`, so each lands in its trajectory's part): the extra rows are not
    trained on; their `s(y)` against `old` (detached, by rollout_id) goes to
    `loss(part, new, ratios)` for the turn's rows, and comes back out of `minimize` through
    `pop_ratio_diagnostics`."""
    waiting = {s.rollout_id for s in extra}

    def share(part, new, values):
        ratios = part_sequence_ratios(part, new, old, lambda s: s.t != turn)
        rows = [j for j, s in enumerate(part) if s.t == turn]
        missing = {part[j].rollout_id for j in rows} & waiting - ratios.keys()
        if missing:
            raise RuntimeError(f"the learner scored turn {turn} of {sorted(missing)} apart from the turn measured with it")
        result, stats = loss_share(loss([part[j] for j in rows], select_rows(new, rows), ratios))
        return result, {**stats, **{_RATIO_PREFIX + rid: ratio for rid, ratio in ratios.items()}}

    share.scored_alongside = tuple(extra)  # measured, not trained on (`budget.CountingLearner`)
    return share


def pop_ratio_diagnostics(metrics: dict[str, float]) -> dict[str, float]:
    """Take the ratios `measuring_alongside` measured out of `minimize`'s metrics."""
    keys = [k for k in metrics if k.startswith(_RATIO_PREFIX)]
    return {k[len(_RATIO_PREFIX) :]: metrics.pop(k) for k in keys}


def minibatches(
    samples: Sequence[TurnSample], size: int, epochs: int, generator: torch.Generator
) -> Iterator[list[TurnSample]]:
    """`epochs` passes over `samples`, each in a fresh random order, cut into minibatches of about
    `size` samples made of whole trajectories.

    A trajectory's turns stay together so that one packed forward of the trajectory scores all of
    them; a minibatch closes once it holds `size` samples or more. With one sample per trajectory
    (a SeeUPO turn pool) this is a plain shuffle cut every `size` samples.
    """
    by_trajectory: dict[str, list[TurnSample]] = defaultdict(list)
    for sample in samples:
        by_trajectory[sample.rollout_id].append(sample)
    trajectories = list(by_trajectory.values())
    for _ in range(epochs):
        current: list[TurnSample] = []
        for k in torch.randperm(len(trajectories), generator=generator).tolist():
            current += trajectories[k]
            if len(current) >= size:
                yield current
                current = []
        if current:
            yield current


@dataclass
class LossStats:
    """Detached diagnostics of a loss, as shares of the minibatch like the loss itself.

    Only `policy_loss` is required; a loss without a KL term, ratios or clipping leaves those None.
    """

    policy_loss: float
    kl: float | None = None
    clipfrac: float | None = None
    ratio_mean: float | None = None
    # With rollouts from older weights (`TokenLogprobs.sampled`): the mean truncated importance
    # weight, and the share of weights at the cap.
    is_weight_mean: float | None = None
    is_weight_capped: float | None = None
    # With entropy_coeff > 0: the aggregated token entropy of the policy (the bonus is coeff x this).
    entropy: float | None = None


def token_policy_loss(
    new: TokenLogprobs,
    old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token-mean",
    totals: Totals | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Token-level clipped surrogate (GRPO, PPO): `-agg_tokens clip_obj(rho, A)` + `kl_coef * agg KL`
    `- entropy_coeff * agg H` (verl's order and names; every term aggregated with `loss_agg`).

    No dual clip unless `clip_ratio_c` is given (verl's `compute_policy_loss_vanilla` always applies
    its `clip_ratio_c`, default 3; the `grpo` and `ppo` configs pass 3).

    advantages: per token [n, L] (a trajectory's A broadcast over its tokens for GRPO, GAE for PPO).
    totals: the minibatch's, for this part (`Totals.part`) when sequences are trajectories.
    rollout_is_weights [n, L]: the algorithm's rollout correction (`rollout_correction.py`), which
    then replaces the learner's truncated weight. entropy_coeff > 0 needs `new.entropy`.
    """
    mask = new.mask
    totals = totals or Totals.of_mask(mask)
    ratio = token_ratio(new.logprobs, old, mask)
    objective = clipped_objective(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    weights = None
    if rollout_is_weights is not None:
        objective = objective * rollout_is_weights
    elif new.sampled is not None:  # rollouts from older weights: reweight each token (TIS)
        weights = behaviour_weights(old, new.sampled, mask, new.sampled_cap)
        objective = objective * weights
    loss = -aggregate(objective, mask, loss_agg, totals, loss_scale_factor)
    kl = None
    if ref is not None and kl_coef > 0:
        kl = aggregate(kl_estimate(new.logprobs, ref, kl_estimator), mask, loss_agg, totals, loss_scale_factor)
        loss = loss + kl_coef * kl
    entropy = None
    if entropy_coeff:
        entropy = aggregate(token_entropy(new), mask, loss_agg, totals, loss_scale_factor)
        loss = loss - entropy_coeff * entropy
    stats = LossStats(
        policy_loss=float(-aggregate(objective.detach(), mask, loss_agg, totals, loss_scale_factor)),
        kl=None if kl is None else float(kl.detach()),
        clipfrac=float(aggregate(clip_fraction(ratio.detach(), advantages, clip_low, clip_high), mask, "token-mean", totals)),
        ratio_mean=float(aggregate(ratio.detach(), mask, "token-mean", totals)),
        entropy=None if entropy is None else float(entropy.detach()),
    )
    if weights is not None:
        stats.is_weight_mean = float(aggregate(weights, mask, "token-mean", totals))
        stats.is_weight_capped = float(aggregate((weights >= new.sampled_cap).to(weights.dtype), mask, "token-mean", totals))
    return loss, stats


def sequence_policy_loss(
    new: TokenLogprobs,
    old: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    totals: Totals | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    policy_loss_agg: str | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Sequence-level clipped surrogate (GSPO, SeeUPO): `-mean_sequences clip_obj(s(y), w)` + KL
    `- entropy_coeff * agg H`.

    loss_agg aggregates the KL and entropy terms, and the policy term unless `policy_loss_agg` is
    given. Every token of a sequence carries its sequence's objective (verl's per-token GSPO), so
    `seq-mean-token-mean` (the default, GSPO's paper) is the mean over sequences; the other modes
    weigh sequence i by its token count n_i: token-mean `n_i / tokens`, token-sum `n_i`,
    seq-mean-token-sum `n_i / sequences` (and `/ loss_scale_factor` for -norm). That is verl
    0.9.1's `compute_policy_loss_gspo` (`agg_loss(pg_losses, loss_agg_mode)`).
    policy_loss_agg: the policy term's own mode; `seq-mean-token-mean` is verl 0.9.0's (and earlier)
    GSPO, which aggregates the policy term per sequence whatever `loss_agg_mode` says, while KL and
    entropy follow `loss_agg_mode` (so verl 0.9.0's default: per-sequence policy, per-token KL).

    weights [n]: the per-row advantage (GSPO: A_i; SeeUPO: M_i). A sequence is a row (one turn's
    response), or with trajectory totals (`Totals.part`) all of a trajectory's rows together, which
    must then be in this part (one ratio over all its response tokens, as verl's GSPO). A row without
    response tokens is no sequence: it adds nothing and is not counted. `log s` is clamped above at
    SEQUENCE_LOG_RATIO_CLAMP, as verl. With the sampler's logprobs (`new.sampled`), each sequence's
    objective is weighted once by its truncated importance weight (`behaviour_weights`, level
    `sequence`). rollout_is_weights [n]: the algorithm's rollout correction per row, one value per
    sequence (0 for a sequence rejected whole), which then replaces the learner's truncated weight.
    """
    mask = new.mask
    totals = totals or Totals.of_mask(mask)
    samples = max(totals.samples if totals.with_tokens is None else totals.with_tokens, 1)  # diagnostics only
    log_ratio, tokens, first = sequence_means(new.logprobs - old, mask, totals)
    ratio = torch.exp(log_ratio.clamp(max=SEQUENCE_LOG_RATIO_CLAMP))
    weights = weights[first]
    real = (tokens > 0).to(ratio.dtype)
    objective = clipped_objective(ratio, weights, clip_low, clip_high) * real
    behaviour = None
    if rollout_is_weights is not None:  # the algorithm's rollout correction: one weight per sequence
        objective = objective * rollout_is_weights[first]
    elif new.sampled is not None:  # rollouts from older weights: reweight each sequence (TIS)
        behaviour = behaviour_weights(old, new.sampled, mask, new.sampled_cap, level="sequence", totals=totals) * real
        objective = objective * behaviour
    share = _sequence_shares(tokens, totals, policy_loss_agg or loss_agg, loss_scale_factor)
    loss = -(objective * share).sum()
    kl = None
    if ref is not None and kl_coef > 0:
        kl = aggregate(kl_estimate(new.logprobs, ref, kl_estimator), mask, loss_agg, totals, loss_scale_factor)
        loss = loss + kl_coef * kl
    entropy = None
    if entropy_coeff:
        entropy = aggregate(token_entropy(new), mask, loss_agg, totals, loss_scale_factor)
        loss = loss - entropy_coeff * entropy
    stats = LossStats(
        policy_loss=float(-(objective.detach() * share).sum()),
        kl=None if kl is None else float(kl.detach()),
        entropy=None if entropy is None else float(entropy.detach()),
        clipfrac=float((clip_fraction(ratio.detach(), weights, clip_low, clip_high) * real).sum() / samples),
        ratio_mean=float((ratio.detach() * real).sum() / samples),
    )
    if behaviour is not None:
        stats.is_weight_mean = float(behaviour.sum() / samples)
        stats.is_weight_capped = float((behaviour >= new.sampled_cap).to(behaviour.dtype).sum() / samples)
    return loss, stats


def _sequence_shares(tokens: torch.Tensor, totals: Totals, loss_agg: str, loss_scale_factor: float | None) -> torch.Tensor:
    """Each sequence's weight in a sequence-level loss under `loss_agg` (see `sequence_policy_loss`),
    [k] from the sequences' token counts `tokens` [k]."""
    if loss_agg == "seq-mean-token-mean":
        return torch.full_like(tokens, 1.0 / max(totals.samples, 1))
    if loss_agg == "token-mean":
        return tokens / max(totals.tokens, 1)
    if loss_agg == "token-sum":
        return tokens
    if loss_agg == "seq-mean-token-sum":
        return tokens / max(totals.samples, 1)
    if loss_agg == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not loss_scale_factor > 0:
            raise ValueError(f"seq-mean-token-sum-norm needs loss_scale_factor > 0, got {loss_scale_factor!r}")
        return tokens / max(totals.samples, 1) / loss_scale_factor
    raise ValueError(f"unknown loss aggregation {loss_agg!r}; choose one of {LOSS_AGGREGATIONS}")


def token_entropy(new: TokenLogprobs) -> torch.Tensor:
    """The policy's entropy at every response token, [n, L] with autograd, as the learner gave it."""
    if new.entropy is None:
        raise ValueError(
            "entropy_coeff > 0 needs the policy's token entropy, and this learner gave none "
            "(its minimize must accept entropy=True and fill TokenLogprobs.entropy)"
        )
    return new.entropy


def sequence_means(
    values: torch.Tensor, mask: torch.Tensor, totals: Totals | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token mean of `values` [n, L] over each sequence of these rows, its token count, and the row
    each sequence starts at; [k], [k], k. A sequence is a row, or with trajectory totals
    (`Totals.part`) all the rows of one trajectory, which must all be in this part."""
    real = mask.to(values.dtype)
    row_sums, row_tokens = (values * real).sum(-1), real.sum(-1)
    if totals is None or totals.trajectory_tokens is None:
        return row_sums / row_tokens.clamp(min=1), row_tokens, list(range(mask.shape[0]))
    if totals.row_ids is None:
        raise ValueError("trajectory totals need the part's rows: pass totals.part(part)")
    ids = list(dict.fromkeys(totals.row_ids))
    index = torch.tensor([ids.index(i) for i in totals.row_ids], dtype=torch.long, device=mask.device)
    sums = row_sums.new_zeros(len(ids)).index_add(0, index, row_sums)
    tokens = row_tokens.new_zeros(len(ids)).index_add(0, index, row_tokens)
    expected = torch.tensor([totals.trajectory_tokens[i] for i in ids], dtype=tokens.dtype, device=tokens.device)
    if not torch.equal(tokens, expected):
        raise ValueError(
            "a trajectory's turns were scored in different micro-batches, so its one sequence ratio cannot be "
            "formed; raise model.max_tokens_per_microbatch or use sequence: turn"
        )
    return sums / tokens.clamp(min=1), tokens, [totals.row_ids.index(i) for i in ids]


def mean_metrics(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average the metrics of a step's optimizer steps (each key over the steps that report it);
    `skipped_*` keys are counts of skipped optimizer steps and add up instead."""
    out: dict[str, float] = {}
    for key in sorted({k for m in steps for k in m}):
        values = [m[key] for m in steps if key in m]
        out[key] = sum(values) if key.startswith("skipped_") else sum(values) / len(values)
    out["optimizer_steps"] = float(len(steps))
    return out
