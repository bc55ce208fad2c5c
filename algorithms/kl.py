"""KL between the policy and the reference: the estimators by verl's names, and KL in the reward.

Estimators of KL(pi || pi_ref) per token from samples of pi, `d = l_new - l_ref` (Schulman's
k1, k2, k3):
- `kl` = `k1`: `d` (unbiased, can be negative);
- `abs`: `|d|`;
- `mse` = `k2`: `0.5 d^2`;
- `low_var_kl` = `k3`: `exp(-d) + d - 1`, with `-d` clamped to +-LOG_RATIO_CLAMP and the
  estimate clamped to [-KL_CLAMP, KL_CLAMP] (unbiased and >= 0 until the clamp).
A `+` suffix (`k1+`, `k3+`, `low_var_kl+`, ...) is the straight-through form: the value of the
named estimator and the gradient of k2, `k2 - sg(k2) + sg(forward)`; k2's gradient `d * grad l_new`
is the unbiased gradient of KL in expectation, which k1's and k3's are not.

KL in the reward (verl's `algorithm.use_kl_in_reward`): each response token's reward becomes
`score_j - beta * kl_j`, kl_j of the step-start policy against the reference (no gradient), and
the advantage estimator runs on these rewards. An outcome estimator (GRAE) sums a trajectory's
token rewards, so its reward becomes `R_i - beta * sum_j kl_ij`; GAE (PPO) sees `-beta * kl_j`
at every response token and R_i at the last. beta comes from a controller updated once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seeupo_gym.algorithms.core import KL_CLAMP, KL_ESTIMATORS, LOG_RATIO_CLAMP

# Every name verl accepts for `kl_penalty` / `kl_loss_type`, with the `+` forms.
KL_PENALTIES = KL_ESTIMATORS


def kl_forward(logp_new: torch.Tensor, logp_ref: torch.Tensor, name: str) -> torch.Tensor:
    """The value of estimator `name` (no `+`) per token."""
    if name in ("kl", "k1"):
        return logp_new - logp_ref
    if name == "abs":
        return (logp_new - logp_ref).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logp_new - logp_ref).square()
    if name in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(logp_ref - logp_new, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator {name!r}; choose one of {KL_PENALTIES}")


def kl_penalty(logp_new: torch.Tensor, logp_ref: torch.Tensor, name: str = "k3") -> torch.Tensor:
    """Per-token KL estimate `name` (see the module doc), straight-through for a `+` name."""
    if not name.endswith("+"):
        return kl_forward(logp_new, logp_ref, name)
    forward = kl_forward(logp_new, logp_ref, name[:-1])
    k2 = 0.5 * (logp_new - logp_ref).square()
    return k2 - k2.detach() + forward.detach()


# ---------------------------------------------------------------------------------------
# KL in the reward: the coefficient's controllers
# ---------------------------------------------------------------------------------------

KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class KLControl:
    """verl's `algorithm.kl_ctrl`: the coefficient beta of the KL in the reward.

    type: `fixed` (beta = kl_coef always) | `adaptive` (Ziegler et al. 2019: after each step,
    `beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon`, kl the batch's mean per-sequence
    token-mean KL, n the trajectories of the step).
    """

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        if self.type not in KL_CONTROLLERS:
            raise ValueError(f"kl_ctrl.type must be one of {KL_CONTROLLERS}, got {self.type!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {self.kl_coef}")
        if self.type == "adaptive" and not (self.horizon > 0 and self.target_kl > 0):
            raise ValueError(f"adaptive kl_ctrl needs horizon > 0 and target_kl > 0, got {self.horizon}/{self.target_kl}")


class KLController:
    """beta of the KL in the reward, carried from step to step (and in checkpoints: `state_dict`)."""

    def __init__(self, control: KLControl) -> None:
        self.control = control
        self.value = float(control.kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.control.type == "fixed":
            return
        error = min(max(current_kl / self.control.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.control.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def token_kl_rewards(
    old: dict, ref: dict, keys: list, name: str, beta: float
) -> tuple[dict, float]:
    """The per-token reward penalties `-beta * kl_j` of the samples `keys` (tables of frozen
    logprobs keyed alike), and the batch KL the adaptive controller reads: the mean over
    trajectories of each trajectory's token-mean KL (a key is (rollout_id, turn))."""
    penalties, sums, counts = {}, {}, {}
    for key in keys:
        kl = kl_penalty(old[key], ref[key], name).detach()
        penalties[key] = -beta * kl
        rid = key[0]
        sums[rid] = sums.get(rid, 0.0) + float(kl.sum())
        counts[rid] = counts.get(rid, 0) + kl.numel()
    # A trajectory without response tokens counts as 0, as verl's masked mean of an empty row.
    means = [sums[r] / counts[r] if counts[r] else 0.0 for r in sums]
    return penalties, (sum(means) / len(means) if means else 0.0)
