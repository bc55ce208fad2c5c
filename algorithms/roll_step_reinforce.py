"""ROLL's step-wise REINFORCE, transcribed from its agentic pipeline's `step_reinforce` estimator.

Source: alibaba/ROLL, commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a, roll/pipeline/agentic/utils.py,
`compute_discounted_returns` and the `step_reinforce` branch of `compute_response_level_rewards`
(with `agentic_reward_norm`); defaults from roll/pipeline/agentic/agentic_config.py
(`step_reward_gamma` 0.95; `RewardNormalizationConfig`: grouping "batch", method "identity", so
neither mean nor std) and roll/configs/base_config.py (`reward_clip` None). As that code computes it,
per step (one turn of one trajectory is one sample there):
- the step reward is the discounted return of the trajectory's step scores, G_t = s_t + gamma G_(t+1);
- it is normalized over its grouping (the whole batch, or the rows sharing a key such as
  `traj_group_id`): minus the batch's or the grouping's mean (`norm_mean_type`), divided by the
  batch's or the grouping's unbiased std + 1e-6 (`norm_std_type`); where a std is used and the grouping
  holds one row or |std| <= 1e-6, every row of that grouping gets 0;
- clipped to [-reward_clip, reward_clip] when `reward_clip` is set.
That value is the step's response-level reward; the pipeline then puts it on the step's last token,
and with base_config's `gamma` 1 and `whiten_advantages` false (`compute_reinforce_return`) every
token of the step gets it. Its example examples/qwen3_agentic_gem/gem_game_guess_the_number.yaml sets
`step_reward_gamma: 1.0`, grouping "batch", method "mean_std" (= norm_mean_type and norm_std_type
"batch"); of the seven example configs with `adv_estimator: "step_reinforce"` there, six set
`step_reward_gamma: 1.0` and only gem_rg_letter_counting.yaml keeps the class default 0.95.
How our records map onto its inputs: the step scores are `turn_credit.turn_rewards` (0 ... 0, R
without `info["turn_rewards"]`); `grouping: group` is our group (ROLL's `traj_group_id`).
Where ours departs: the advantage is the response-level reward itself, one per turn (the later token-
level return and optional whitening of `agentic_compute_advantage` are not applied); the deprecated
`method` is not read (set `norm_mean_type` / `norm_std_type`); float64 (the source is float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Learner, register_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, TurnCreditConfig, discounted_returns, turn_rewards

GROUPINGS = ("batch", "group")
NORM_TYPES = (None, "batch", "group")


@dataclass
class ROLLStepReinforceConfig(TurnCreditConfig):
    step_reward_gamma: float = 0.95
    grouping: str = "batch"
    norm_mean_type: str | None = None
    norm_std_type: str | None = None
    reward_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("grouping", GROUPINGS)
        self.require_choice("norm_mean_type", NORM_TYPES)
        self.require_choice("norm_std_type", NORM_TYPES)
        if not 0 <= self.step_reward_gamma <= 1:
            raise ValueError(f"step_reward_gamma must lie in [0, 1], got {self.step_reward_gamma}")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"reward_clip must be > 0 or null (off), got {self.reward_clip}")


def _std(x: np.ndarray) -> float:
    return float(x.std(ddof=1)) if len(x) > 1 else float("nan")  # torch's unbiased std of one row is NaN


def roll_step_reinforce_advantages(batch: RolloutBatch, cfg: ROLLStepReinforceConfig) -> dict[core.SampleKey, float]:
    samples = batch.samples()
    returns = {t.rollout_id: discounted_returns(turn_rewards(t), cfg.step_reward_gamma) for t in batch}
    scores = np.array([returns[s.rollout_id][s.t - 1] for s in samples], dtype=np.float64)
    keys = [s.group_id if cfg.grouping == "group" else "batch" for s in samples]
    normalized = np.zeros_like(scores)
    for key in dict.fromkeys(keys):
        rows = np.array([k == key for k in keys])
        group_scores = scores[rows]
        mean = {"batch": scores.mean(), "group": group_scores.mean(), None: 0.0}[cfg.norm_mean_type]
        std = {"batch": _std(scores), "group": _std(group_scores), None: None}[cfg.norm_std_type]
        if std is None:
            normalized[rows] = group_scores - mean
        elif len(group_scores) > 1 and abs(std) > 1e-6:
            normalized[rows] = (group_scores - mean) / (std + 1e-6)
        else:
            normalized[rows] = 0.0
    if cfg.reward_clip is not None:
        normalized = np.clip(normalized, -cfg.reward_clip, cfg.reward_clip)
    return {core.sample_key(s): float(v) for s, v in zip(samples, normalized)}


@register_algorithm("roll_step_reinforce")
class ROLLStepReinforce(TurnAdvantageAlgorithm):
    config_class = ROLLStepReinforceConfig
    config: ROLLStepReinforceConfig

    def turn_advantages(self, batch: RolloutBatch, learner: Learner) -> dict[core.SampleKey, float]:
        return roll_step_reinforce_advantages(batch, self.config)
