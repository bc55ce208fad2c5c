"""Rollout correction, as verl's `algorithm.rollout_correction`: importance weights and rejection
of the samples whose sampler (`Turn.sample_logprobs`) differs from the step-start policy.

Computed once per step over the whole batch from `log_ratio = l_old - l_sampled` per response
token (l_old: the learner's step-start logprobs), then applied in every minibatch:

- rollout_is (importance weights, detached; they change the measure, not the objective):
  `token`: `w_j = exp(clamp(log_ratio_j, +-20))`; `sequence`: `w = exp(clamp(sum_j log_ratio_j, +-20))`
  for every token of the sequence (the product of the token ratios, not its geometric mean).
  rollout_is_threshold: a number `u` truncates, `min(w, u)` (TIS); a string `"l_u"` zeroes every
  weight outside [l, u] (IcePop's two-sided mask).
  rollout_is_batch_normalize: divide by the batch mean of the weights (over tokens for `token`, over
  sequences for `sequence`) when it is > 1e-8, so they average 1.
- rollout_rs (rejection): a comma-separated list of criteria, all of which must hold; a rejected
  token leaves every loss term and every denominator. With `k1 = -log_ratio`,
  `k2 = 0.5 log_ratio^2`, `k3 = exp(log_ratio) - 1 - log_ratio` (log_ratio clamped to +-20):
  `token_k*` per token; `seq_sum_k*`, `seq_mean_k*`, `seq_max_k{2,3}` over a sequence (all its
  tokens kept or none). rollout_rs_threshold: one value for all criteria or one per criterion; a
  k1 criterion keeps `log(l) <= k1 <= log(u)` for `"l_u"` (a single `u` means `"1/u_u"`), the others
  keep `k <= u`. verl's older names: `token` = token_k1, `sequence` = seq_sum_k1, `geometric` =
  seq_mean_k1 (the geometric mean of the token ratios within [1/u, 1/l]).

A sequence is the algorithm's: a trajectory (all its turns' response tokens, verl's row) or a turn.
With a rollout correction configured the losses use these weights instead of the learner's
default truncated weight (`train.importance_cap`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from seeupo_gym.algorithms.core import sample_key
from seeupo_gym.algorithms.rollout import TurnSample

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
_OLD_RS_NAMES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def _bounds(spec: float | str, what: str) -> tuple[float | None, float]:
    """(lower or None, upper) of a threshold given as a number `u` or a string `"l_u"`."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{what} must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    low_text, sep, high_text = text.partition("_")
    try:
        low, high = (float(low_text), float(high_text)) if sep else (None, float(text))
    except ValueError:
        raise ValueError(f"{what} {spec!r} is not a number or a 'lower_upper' pair of numbers") from None
    if not (math.isfinite(high) and high > 0) or (low is not None and not (math.isfinite(low) and 0 < low <= high)):
        raise ValueError(f"{what} {spec!r}: bounds must be finite with 0 < lower <= upper")
    return low, high


@dataclass
class RolloutCorrection:
    """verl's `algorithm.rollout_correction` options (see the module doc)."""

    # null (no weights) | token | sequence
    rollout_is: str | None = None
    # A number u (truncate at u) or "l_u" (IcePop: zero outside [l, u]).
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    # null (no rejection) or comma-separated criteria, e.g. "token_k1,seq_max_k2".
    rollout_rs: str | None = None
    # One threshold for every criterion, or one per criterion, comma-separated.
    rollout_rs_threshold: float | str | None = None

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_correction.rollout_is must be null or one of {IS_LEVELS}, got {self.rollout_is!r}")
        self.is_bounds = _bounds(self.rollout_is_threshold, "rollout_correction.rollout_is_threshold")
        self.rs_bounds = self._rejection_bounds()
        if self.rollout_is is None and self.rs_bounds is None:
            raise ValueError("rollout_correction sets neither rollout_is nor rollout_rs; leave it null to use none")

    def _rejection_bounds(self) -> dict[str, tuple[float | None, float]] | None:
        if self.rollout_rs is None:
            return None
        options = list(dict.fromkeys(_OLD_RS_NAMES.get(o.strip(), o.strip()) for o in self.rollout_rs.split(",") if o.strip()))
        unknown = [o for o in options if o not in RS_OPTIONS]
        if not options or unknown:
            raise ValueError(f"rollout_correction.rollout_rs {self.rollout_rs!r}: unknown criteria {unknown}; choose from {RS_OPTIONS}")
        if self.rollout_rs_threshold is None:
            raise ValueError("rollout_correction.rollout_rs needs rollout_rs_threshold")
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        if len(specs) == 1:
            specs *= len(options)
        if len(specs) != len(options):
            raise ValueError(f"rollout_rs_threshold has {len(specs)} values for {len(options)} criteria; give one or one each")
        bounds = {}
        for option, spec in zip(options, specs):
            low, high = _bounds(spec, f"rollout_rs_threshold for {option}")
            if option.endswith("k1"):
                bounds[option] = (1.0 / high if low is None else low, high)
            elif low is not None:
                raise ValueError(f"rollout_rs_threshold for {option} takes one upper bound, got {spec!r}")
            else:
                bounds[option] = (None, high)
        return bounds


def _masked_mean_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    real = mask.to(values.dtype)
    return (values * real).sum(-1) / real.sum(-1).clamp(min=1)


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrection) -> torch.Tensor:
    """`rollout_is` weights per token [n, L] (0 at padding), before batch normalization."""
    if correction.rollout_is == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        total = (log_ratio * mask.to(log_ratio.dtype)).sum(-1, keepdim=True)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask.to(raw.dtype)
    low, high = correction.is_bounds
    if low is None:
        return raw.clamp(max=high)
    return torch.where((raw >= low) & (raw <= high), raw, torch.zeros_like(raw))


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrection) -> torch.Tensor:
    """Tokens every `rollout_rs` criterion keeps, [n, L] bool (False at padding)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    real = mask.to(safe.dtype)
    keep = mask.clone()
    for option, (low, high) in (correction.rs_bounds or {}).items():
        kind, estimator = option.rsplit("_", 1)
        value = stats[estimator]
        if kind == "seq_sum":
            value = (value * real).sum(-1, keepdim=True)
        elif kind == "seq_mean":
            value = _masked_mean_rows(value, mask).unsqueeze(-1)
        elif kind == "seq_max":
            top = value.masked_fill(~mask, float("-inf")).max(-1, keepdim=True).values
            value = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        if estimator == "k1":
            passed = (value >= math.log(low)) & (value <= math.log(high))
        else:
            passed = value <= high
        keep = keep & passed.expand_as(mask)
    return keep


@dataclass
class Correction:
    """One step's correction, by sample key (rollout_id, turn): token weights and kept tokens."""

    weights: dict | None  # key -> [tokens] float, or None without rollout_is
    keep: dict  # key -> [tokens] bool
    metrics: dict[str, float]


def sequences_of(samples: Sequence[TurnSample], sequence: str) -> list[list[int]]:
    """Indices of `samples` grouped into sequences: one per turn, or one per trajectory."""
    if sequence == "turn":
        return [[i] for i in range(len(samples))]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.rollout_id].append(i)
    return list(groups.values())


def correct(
    samples: Sequence[TurnSample], old: dict, correction: RolloutCorrection, sequence: str
) -> Correction:
    """The rollout correction of a step's `samples` (`old`: their step-start logprobs by key)."""
    groups = sequences_of(samples, sequence)
    rows = []
    for group in groups:
        rows.append((
            torch.cat([old[sample_key(samples[i])].double() for i in group]),
            torch.cat([torch.tensor(samples[i].turn.sample_logprobs, dtype=torch.float64) for i in group]),
        ))
    length = max((r[0].numel() for r in rows), default=0)
    log_ratio = torch.zeros(len(rows), length, dtype=torch.float64)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for k, (l_old, l_sampled) in enumerate(rows):
        log_ratio[k, : l_old.numel()] = l_old - l_sampled
        mask[k, : l_old.numel()] = True
    metrics: dict[str, float] = {}
    weights = None
    if correction.rollout_is is not None:
        weights = importance_weights(log_ratio, mask, correction)
        if correction.rollout_is_batch_normalize:
            if correction.rollout_is == "token":
                mean = weights[mask].mean() if mask.any() else weights.new_zeros(())
            else:
                has = mask.any(-1)
                mean = _masked_mean_rows(weights, mask)[has].mean() if has.any() else weights.new_zeros(())
            if mean > 1e-8:
                weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
        metrics["rollout_is_mean"] = float(weights[mask].mean()) if mask.any() else 0.0
    keep = rejection_keep(log_ratio, mask, correction) if correction.rs_bounds else mask
    if correction.rs_bounds:
        metrics["rollout_rs_masked_fraction"] = float(1.0 - keep[mask].double().mean()) if mask.any() else 0.0
    weight_table, keep_table = ({} if weights is not None else None), {}
    # The weights are kept in the dtype of the logprobs they came from (float64 learner: float64).
    dtypes = [old[sample_key(s)].dtype for s in samples]
    for k, group in enumerate(groups):
        start = 0
        for i in group:
            n = samples[i].turn.num_response_tokens
            key = sample_key(samples[i])
            keep_table[key] = keep[k, start : start + n].clone()
            if weight_table is not None:
                weight_table[key] = weights[k, start : start + n].to(dtypes[i]).clone()
            start += n
    return Correction(weight_table, keep_table, metrics)
