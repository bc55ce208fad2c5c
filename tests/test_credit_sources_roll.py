"""`roll_step_reinforce` against a transcription of alibaba/ROLL 8eb27cc2dc34c4d1310b169d9b86d339004d811a
roll/pipeline/agentic/utils.py (`compute_discounted_returns`, `agentic_reward_norm`, the
`step_reinforce` branch of `compute_response_level_rewards` and its reward clip), written from the
source in plain numpy with its names and control flow (one row per step); our code is not called."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm


def group_by(rows, key):
    grouped = defaultdict(list)
    for i in rows:
        grouped[key[i]].append(i)
    return grouped


def compute_discounted_returns(non_tensor_batch, gamma):
    step_rewards_out = np.zeros(len(non_tensor_batch["traj_id"]))
    for traj_id, traj_rows in group_by(range(len(step_rewards_out)), non_tensor_batch["traj_id"]).items():
        order = np.argsort(np.array([non_tensor_batch["step"][i] for i in traj_rows]))
        traj_rows = [traj_rows[k] for k in order]
        rewards = np.array([non_tensor_batch["step_scores"][i] for i in traj_rows], dtype=np.float64)
        discounts = np.empty_like(rewards)
        running_return = 0.0
        for t in reversed(range(len(rewards))):
            running_return = rewards[t] + gamma * running_return
            discounts[t] = running_return
        step_rewards_out[traj_rows] = discounts
    return step_rewards_out


def torch_std(x):
    return np.std(x, ddof=1) if len(x) > 1 else float("nan")


def agentic_reward_norm(all_scores, non_tensor_batch, grouping, norm_mean_type, norm_std_type):
    batch_mean = all_scores.mean() if norm_mean_type == "batch" else None
    batch_std = torch_std(all_scores) if norm_std_type == "batch" else None
    batch_grouped = {"default": list(range(len(all_scores)))}
    if grouping != "batch":
        batch_grouped = group_by(range(len(all_scores)), non_tensor_batch[grouping])
    grouped_rewards = np.zeros_like(all_scores)
    for group_name, rows in batch_grouped.items():
        scores_float = all_scores[rows]
        if norm_mean_type == "batch":
            reward_mean = batch_mean
        elif norm_mean_type == "group":
            reward_mean = scores_float.mean()
        else:
            reward_mean = 0.0
        if norm_std_type == "batch":
            reward_std = batch_std
        elif norm_std_type == "group":
            reward_std = torch_std(scores_float)
        else:
            reward_std = None
        if reward_std is not None:
            if scores_float.size > 1 and abs(reward_std) > 1e-6:
                normalized_scores = (scores_float - reward_mean) / (reward_std + 1e-6)
            else:
                normalized_scores = np.zeros_like(scores_float)
        else:
            normalized_scores = scores_float - reward_mean
        grouped_rewards[rows] = normalized_scores
    return grouped_rewards


def compute_response_level_rewards(step_rewards_, non_tensor_batch, cfg):
    response_level_rewards = agentic_reward_norm(step_rewards_, non_tensor_batch, cfg["grouping"],
                                                 cfg["norm_mean_type"], cfg["norm_std_type"])
    if cfg["reward_clip"]:
        response_level_rewards = np.clip(response_level_rewards, -cfg["reward_clip"], cfg["reward_clip"])
    return response_level_rewards


def roll(batch, cfg):
    samples = batch.samples()[::-1]  # rows in any order: the source regroups by traj_id and step
    non_tensor_batch = {
        "traj_id": [s.rollout_id for s in samples],
        "step": [s.t - 1 for s in samples],
        "traj_group_id": [s.group_id for s in samples],
        "step_scores": [step_rewards(s.trajectory)[s.t - 1] for s in samples],
    }
    grouping = {"batch": "batch", "group": "traj_group_id"}[cfg["grouping"]]
    step_rewards_ = compute_discounted_returns(non_tensor_batch, cfg["step_reward_gamma"])
    rewards = compute_response_level_rewards(step_rewards_, non_tensor_batch, {**cfg, "grouping": grouping})
    return {(s.rollout_id, s.t): float(r) for s, r in zip(samples, rewards)}


CONFIGS = [
    {},
    {"step_reward_gamma": 1.0, "norm_mean_type": "batch", "norm_std_type": "batch"},
    {"grouping": "group", "norm_mean_type": "group", "norm_std_type": "group"},
    {"grouping": "group", "norm_mean_type": "batch", "norm_std_type": "group", "reward_clip": 0.8},
    {"grouping": "group", "norm_mean_type": "group", "norm_std_type": "batch", "step_reward_gamma": 0.5},
    {"grouping": "group", "norm_mean_type": "group"},
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("options", CONFIGS)
def test_roll_step_reinforce_equals_roll_step_reinforce_response_level_rewards(seed, options):
    batch = random_batch(seed, dense=seed % 3 == 1)
    algorithm = make_algorithm("roll_step_reinforce", options)
    ours = algorithm.turn_advantages(batch, learner=None)
    assert max_abs_difference(ours, roll(batch, vars(algorithm.config))) < 1e-9


def test_roll_step_reinforce_defaults_are_the_source_defaults():
    config = make_algorithm("roll_step_reinforce", {}).config
    assert (config.step_reward_gamma, config.grouping, config.norm_mean_type, config.norm_std_type, config.reward_clip) == (
        0.95, "batch", None, None, None
    )
