"""prime-rl's turn-credit shaping, transcribed from `TurnCreditAlgorithm.score_group`.

Source: PrimeIntellect-ai/prime-rl, commit 0d6024432d2d62ebfc5f7c99a6a1fea45139a91b,
src/prime_rl/orchestrator/algo/turn_credit.py, `TurnCreditAlgorithm` (`score_group`,
`_token_advantages`, `deltas`, `smear`), defaults from `TurnCreditAlgoConfig` in
packages/prime-rl-configs/src/prime_rl/configs/algorithm.py (gamma 0.9, beta 1.0). As that code
computes it, per group:
- each rollout's per-turn state scores phi_t become progress: d_t = phi_t - phi_(previous), the first
  turn's d = 0 (its starting state counts as already there);
- the level A = (R + sum d) - mean over the group of the same (GRPO's baseline over the shaped
  return; a group of one has A = 0 and trains on the shaping alone);
- each turn's progress is smeared back over it and the turns before: c_t = v_t + gamma c_(t+1) with
  v_t = d_t / (sum_{k<t} gamma^k), so each d_t is handed out once;
- every token of turn t gets A + beta (c_t - c_mean), c_mean the token-weighted mean of the credits
  of the turns with trainable tokens, so the shift is zero-sum over the rollout's tokens;
- a rollout without `info["turn_rewards"]` gets A on every token (plain GRPO), as does beta = 0.
How our records map onto its inputs: our `info["turn_rewards"]` are per-turn reward increments
summing to R (turn_credit.py), prime-rl's are scores of the state after each turn; with
`scores: cumulative` (default) phi_t = r_1 + ... + r_t, the reward collected so far, so d_t = r_t
for t > 1, and the level's shaped return R + phi_T - phi_1 = R + r_2 + ... + r_T (2R - r_1 when the
turn rewards sum to R: the reward counts as final reward and again as progress, as in the source when
an env's final reward is also its last state score); `scores: given` passes `info["turn_rewards"]` as
the state scores unchanged. A turn's trainable tokens are its response tokens.
Where ours departs: one advantage per turn (the same on all its tokens, as there; a turn without
tokens gets A + beta (c_t - c_mean) though nothing trains on it); no branches (our trajectories are
one chain of turns); no `None` scores and no `length_penalty` (off by default there); float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, turn_rewards

SCORES = ("cumulative", "given")


@dataclass
class PrimeRLTurnCreditConfig(TurnCreditConfig):
    gamma: float = 0.9
    beta: float = 1.0
    scores: str = "cumulative"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("scores", SCORES)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")


def deltas(phis: list[float]) -> list[float]:
    """Per-turn progress: each score minus the previous one; the first turn's is 0."""
    return [0.0] + [phis[i] - phis[i - 1] for i in range(1, len(phis))]


def smear(progress: list[float], gamma: float) -> list[float]:
    """c_t = v_t + gamma c_(t+1), v_t = d_t normalized by the weights gamma^0 .. gamma^(t-1)."""
    values = [d / (t if gamma == 1.0 else (1.0 - gamma**t) / (1.0 - gamma)) for t, d in enumerate(progress, start=1)]
    credits, acc = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        acc = values[t] + gamma * acc
        credits[t] = acc
    return credits


def state_scores(trajectory: Trajectory, scores: str) -> list[float] | None:
    """phi_1..phi_T from `info["turn_rewards"]`, or None when the trajectory has none."""
    if trajectory.info.get("turn_rewards") is None:
        return None
    rewards = turn_rewards(trajectory)
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"trajectory {trajectory.rollout_id!r} has a non-finite turn reward: {rewards}")
    if scores == "given":
        return rewards
    running, out = 0.0, []
    for r in rewards:
        running += r
        out.append(running)
    return out


def prime_rl_turn_credit_advantages(
    batch: RolloutBatch, *, gamma: float, beta: float, scores: str = "cumulative"
) -> dict[core.SampleKey, float]:
    out: dict[core.SampleKey, float] = {}
    for group in batch.groups().values():
        phis = [state_scores(t, scores) for t in group]
        returns = [t.reward + (sum(deltas(p)) if p is not None else 0.0) for t, p in zip(group, phis)]
        baseline = sum(returns) / len(returns)
        for trajectory, p, ret in zip(group, phis, returns):
            level = ret - baseline
            keys = [(trajectory.rollout_id, t) for t in range(1, trajectory.num_turns + 1)]
            if p is None or beta == 0.0:
                out.update({key: level for key in keys})
                continue
            credits = smear(deltas(p), gamma)
            weights = [turn.num_response_tokens for turn in trajectory.turns]
            total = sum(weights)
            center = sum(c * w for c, w in zip(credits, weights)) / total if total else 0.0
            out.update({key: level + beta * (c - center) for key, c in zip(keys, credits)})
    return out


@register_algorithm("prime_rl_turn_credit")
class PrimeRLTurnCredit(TurnAdvantageAlgorithm):
    config_class = PrimeRLTurnCreditConfig
    config: PrimeRLTurnCreditConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        cfg = self.config
        return prime_rl_turn_credit_advantages(batch, gamma=cfg.gamma, beta=cfg.beta, scores=cfg.scores)
