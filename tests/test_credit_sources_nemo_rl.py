"""`nemo_rl_turn_grpo` against a transcription of NVIDIA-NeMo/RL 0ebab92d289ae4c8fe211b263edb9ca636dc4056:
research/turn_level_credit/turn_level_credit/advantage.py `TurnLevelGRPOAdvantageEstimator.
compute_advantage`, its trace.py (`compute_environment_credit`, `scatter_turn_credit`), and
nemo_rl/algorithms/advantage_estimator.py `GRPOAdvantageEstimator` over nemo_rl/algorithms/utils.py
`calculate_baseline_and_std_per_prompt`; written from the source in plain numpy with its names and
control flow (token rows, turn spans); our code is not called to compute it."""

from __future__ import annotations

import numpy as np
import pytest

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

ENV_TOKENS = 2


def calculate_baseline_and_std_per_prompt(prompts, rewards, valid_mask, leave_one_out_baseline=True):
    unique_prompts = np.unique(prompts, axis=0)
    baseline = np.zeros_like(rewards)
    std = np.zeros_like(rewards)
    for i in range(len(unique_prompts)):
        is_matching_prompt = (prompts == unique_prompts[i]).all(1)
        prompt_idx = np.arange(len(prompts))[is_matching_prompt]
        if leave_one_out_baseline:
            baseline_mask_matrix = 1 - np.eye(len(prompt_idx))
        else:
            baseline_mask_matrix = np.ones((len(prompt_idx), len(prompt_idx)))
        if valid_mask[prompt_idx].sum() <= 1:
            baseline[prompt_idx] = rewards[prompt_idx]
        else:
            num_valid = valid_mask[prompt_idx].sum() - int(leave_one_out_baseline)
            prompt_baseline = baseline_mask_matrix @ (rewards[prompt_idx] * valid_mask[prompt_idx]) / num_valid
            std_prompt_baseline = prompt_baseline
            std_prompt_baseline_square = baseline_mask_matrix @ (rewards[prompt_idx] ** 2 * valid_mask[prompt_idx]) / num_valid
            baseline[prompt_idx] = prompt_baseline
            with np.errstate(divide="ignore", invalid="ignore"):
                std[prompt_idx] = np.nan_to_num(
                    np.sqrt((std_prompt_baseline_square - std_prompt_baseline**2) * (num_valid / (num_valid - 1))), nan=0.0
                )
    return baseline, std


def grpo_compute_advantage(prompt_ids, rewards, mask, normalize_rewards, use_leave_one_out_baseline):
    baseline, std = calculate_baseline_and_std_per_prompt(
        prompt_ids, rewards, np.ones_like(rewards), leave_one_out_baseline=use_leave_one_out_baseline
    )
    advantages = (rewards - baseline)[:, None].copy()
    if normalize_rewards:
        epsilon = 1e-6
        non_zero_std_mask = std > 0
        advantages[non_zero_std_mask] = advantages[non_zero_std_mask] / (std[:, None][non_zero_std_mask] + epsilon)
    return np.broadcast_to(advantages, mask.shape)


def compute_environment_credit(turn_rewards, turn_mask, mode, discount):
    if mode == "immediate":
        return turn_rewards * turn_mask
    credit = np.zeros_like(turn_rewards)
    for row in range(turn_rewards.shape[0]):
        running_return = 0.0
        for turn_index in range(turn_rewards.shape[1] - 1, -1, -1):
            if not turn_mask[row, turn_index]:
                continue
            running_return = turn_rewards[row, turn_index] + discount * running_return
            credit[row, turn_index] = running_return
    return credit


def scatter_turn_credit(credit, trainable_mask, assistant_spans, token_mask):
    scattered = np.zeros(token_mask.shape)
    for row in range(credit.shape[0]):
        for turn_index in range(credit.shape[1]):
            if not trainable_mask[row, turn_index]:
                continue
            start, end = assistant_spans[row, turn_index]
            scattered[row, start:end] = credit[row, turn_index]
    return scattered * token_mask


def turn_level_compute_advantage(prompt_ids, rewards, mask, turn_batch, cfg):
    macro_advantage = grpo_compute_advantage(prompt_ids, rewards, mask, cfg["normalize_rewards"],
                                             cfg["use_leave_one_out_baseline"])
    advantage_mask = mask.astype(bool)
    if cfg["turn_weight"] == 0.0 and cfg["macro_weight"] == 1.0:
        return macro_advantage
    credit = compute_environment_credit(turn_batch["rewards"], turn_batch["mask"], cfg["environment_mode"], cfg["discount"])
    auxiliary_advantage = scatter_turn_credit(credit, turn_batch["trainable_mask"], turn_batch["assistant_spans"], advantage_mask)
    advantages = cfg["macro_weight"] * macro_advantage + cfg["turn_weight"] * auxiliary_advantage
    return advantages * advantage_mask


def nemo_rl(batch, cfg):
    trajectories = list(batch)
    group_number = {g: i for i, g in enumerate(batch.groups())}
    prompt_ids = np.array([[group_number[t.group_id]] for t in trajectories])
    rewards = np.array([t.reward for t in trajectories], dtype=np.float64)
    max_turns = batch.max_turns
    shape = (len(trajectories), max_turns)
    turn_batch = {"rewards": np.zeros(shape), "mask": np.zeros(shape, bool), "trainable_mask": np.zeros(shape, bool),
                  "assistant_spans": np.zeros((*shape, 2), int)}
    rows = []
    for row, trajectory in enumerate(trajectories):
        tokens = []
        for turn_index, (turn, r) in enumerate(zip(trajectory.turns, step_rewards(trajectory))):
            tokens += [0] * ENV_TOKENS
            start, end = len(tokens), len(tokens) + turn.num_response_tokens
            tokens += [1] * turn.num_response_tokens
            turn_batch["rewards"][row, turn_index] = r
            turn_batch["mask"][row, turn_index] = True
            turn_batch["trainable_mask"][row, turn_index] = end > start
            turn_batch["assistant_spans"][row, turn_index] = (start, end)
        rows.append(tokens)
    seq_len = max(len(r) for r in rows) + 1
    mask = np.array([r + [0] * (seq_len - len(r)) for r in rows], dtype=float)
    advantages = turn_level_compute_advantage(prompt_ids, rewards, mask, turn_batch, cfg)
    out = {}
    for row, trajectory in enumerate(trajectories):
        for turn_index in range(trajectory.num_turns):
            start, end = turn_batch["assistant_spans"][row, turn_index]
            if start == end:
                continue
            values = advantages[row, start:end]
            assert np.all(values == values[0])
            out[(trajectory.rollout_id, turn_index + 1)] = float(values[0])
    return out


CONFIGS = [
    {},
    {"turn_weight": 0.0},
    {"environment_mode": "return_to_go", "discount": 0.8, "macro_weight": 0.5, "turn_weight": 1.0},
    {"use_leave_one_out_baseline": False, "turn_weight": 0.3},
    {"normalize_rewards": False, "environment_mode": "return_to_go"},
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("options", CONFIGS)
def test_nemo_rl_turn_grpo_equals_turn_level_grpo_advantage_estimator(seed, options):
    batch = random_batch(seed, empty_turns=seed % 2 == 0, dense=seed % 3 == 1)
    algorithm = make_algorithm("nemo_rl_turn_grpo", options)
    ours = algorithm.turn_advantages(batch, learner=None)
    ours = {k: v for k, v in ours.items() if batch[k[0]].turns[k[1] - 1].num_response_tokens}
    assert max_abs_difference(ours, nemo_rl(batch, vars(algorithm.config))) < 1e-9


def test_nemo_rl_turn_grpo_stops_when_turn_rewards_do_not_sum_to_the_reward():
    turns = [Turn([0], [1], [0.0]), Turn([0, 1], [2], [0.0])]
    batch = RolloutBatch([Trajectory("t", "g", "a", turns, 1.0, True, info={"turn_rewards": [0.2, 0.2]})])
    with pytest.raises(ValueError, match="turn rewards sum to 0.4"):
        make_algorithm("nemo_rl_turn_grpo", {}).turn_advantages(batch, learner=None)
