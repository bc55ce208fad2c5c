"""`mt_grpo` and `mt_grpo_atropos` against transcriptions of their source functions, written from the
sources (plain numpy, the sources' control flow and names; our code is not called to compute them):
- SiliangZeng/Multi-Turn-RL-Agent 127dda5f8c20be62d7d483ccbd65841b65956162
  verifiers/trainers/mt_grpo_env_trainer.py `_find_result_positions`, `_assign_advantages`, and
  verifiers/trainers/grpo_env_trainer.py `_compute_normalized_advantages`;
- NousResearch/atropos environments/tool_use_turnlevel_advantage_server.py
  `_compute_mt_grpo_advantages` at 60188d07d398b510db4bd0968fca84019ec8bb36 and at
  6e2bdd2a39f16f74f5e938ccd6e31416353439a5.
"""

from __future__ import annotations

import numpy as np
import pytest

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm

ENV_REPLY_TOKENS = 2  # the `<result>` message's tokens between two replies (mask 0)


# ---- Multi-Turn-RL-Agent, transcribed ----

def _compute_normalized_advantages(rewards, num_generations):
    rewards = np.asarray(rewards, dtype=np.float64)
    mean_grouped_rewards = rewards.reshape(-1, num_generations).mean(axis=1)
    if num_generations > 1:
        std_grouped_rewards = rewards.reshape(-1, num_generations).std(axis=1, ddof=1)
    else:  # ours: std 0 for a group of one (torch gives NaN; TRL never forms one)
        std_grouped_rewards = np.zeros(len(rewards))
    mean_grouped_rewards = np.repeat(mean_grouped_rewards, num_generations)
    std_grouped_rewards = np.repeat(std_grouped_rewards, num_generations)
    advantages = (rewards - mean_grouped_rewards) / (std_grouped_rewards + 1e-4)
    return mean_grouped_rewards, std_grouped_rewards, advantages


def _find_result_positions(completion_messages):
    result_segment_indices = []
    for messages in completion_messages:
        result_segment = -1
        for j, msg in enumerate(messages):
            if msg.get("role") == "assistant":
                if j + 1 < len(messages) and messages[j + 1].get("role") == "user":
                    if "<result>" in messages[j + 1].get("content", ""):
                        result_segment = j + 1
                        break
        result_segment_indices.append(result_segment)
    return result_segment_indices


def _assign_advantages(completion_mask, turn_advantages, outcome_advantages, combined_advantages,
                       result_segment_indices, turn_advantage_coef):
    batch_size, seq_len = completion_mask.shape
    assigned_advantages = np.zeros(completion_mask.shape)

    def get_segment_boundaries(mask_row):
        boundaries = [0]
        for j in range(1, seq_len):
            if mask_row[j] != mask_row[j - 1]:
                boundaries.append(j)
        boundaries.append(seq_len)
        return boundaries

    for i in range(batch_size):
        result_segment = result_segment_indices[i]
        mask_row = completion_mask[i]
        outcome_adv_expanded = outcome_advantages[i] * np.ones(seq_len)
        turn_adv_expanded = turn_advantages[i] * np.ones(seq_len)
        combined_adv_expanded = combined_advantages[i] * np.ones(seq_len)
        if result_segment > 0:
            segment_boundaries = get_segment_boundaries(mask_row)
            if result_segment < len(segment_boundaries):
                split_point = segment_boundaries[result_segment]
                before_result_mask = (np.arange(seq_len) < split_point).astype(float) * mask_row
                assigned_advantages[i] = outcome_adv_expanded + turn_advantage_coef * turn_adv_expanded * before_result_mask
            else:
                raise ValueError(f"Not enough segments found in completion {i}")
        else:
            assigned_advantages[i] = combined_adv_expanded
    return assigned_advantages


def multi_turn_rl_agent(batch, turn_advantage_coef):
    """Per (rollout_id, t): the source's advantage on every token of turn t (all must agree)."""
    out = {}
    for group in batch.groups().values():
        # Mapping: the turn reward is r_1, the outcome reward the rewards after it (combined = R).
        turn_rewards = np.array([step_rewards(t)[0] for t in group])
        outcome_rewards = np.array([t.reward for t in group]) - turn_rewards
        combined_rewards = turn_rewards + outcome_rewards
        n = len(group)
        _, _, turn_advantages = _compute_normalized_advantages(turn_rewards, n)
        _, _, outcome_advantages = _compute_normalized_advantages(outcome_rewards, n)
        _, _, combined_advantages = _compute_normalized_advantages(combined_rewards, n)
        rows, spans, completion_messages = [], [], []
        for trajectory in group:
            row, span, messages = [], [], []
            for t, turn in enumerate(trajectory.turns):
                if t:
                    row += [0] * ENV_REPLY_TOKENS
                    messages.append({"role": "user", "content": "<result>\nobservation\n</result>"})
                span.append((len(row), len(row) + turn.num_response_tokens))
                row += [1] * turn.num_response_tokens
                messages.append({"role": "assistant", "content": "reply"})
            rows.append(row)
            spans.append(span)
            completion_messages.append(messages)
        seq_len = max(len(r) for r in rows) + 1
        completion_mask = np.array([r + [0] * (seq_len - len(r)) for r in rows], dtype=float)
        assigned = _assign_advantages(completion_mask, turn_advantages, outcome_advantages, combined_advantages,
                                      _find_result_positions(completion_messages), turn_advantage_coef)
        for i, trajectory in enumerate(group):
            for t, (start, end) in enumerate(spans[i], start=1):
                values = assigned[i, start:end]
                assert np.all(values == values[0])
                out[(trajectory.rollout_id, t)] = float(values[0])
    return out


# ---- atropos, transcribed ----

def _compute_mt_grpo_advantages(turn_rewards_batch, outcome_rewards_batch, lam, final_turn_outcome_only):
    if not turn_rewards_batch:
        return []
    max_turns = max(len(rewards) for rewards in turn_rewards_batch)
    turn_advantages_by_turn = []
    for turn_idx in range(max_turns):
        turn_rewards = [rewards[turn_idx] if turn_idx < len(rewards) else 0.0 for rewards in turn_rewards_batch]
        mean_turn = np.mean(turn_rewards)
        std_turn = np.std(turn_rewards) or 1.0
        turn_advantages_by_turn.append((np.array(turn_rewards) - mean_turn) / std_turn)
    mean_outcome = np.mean(outcome_rewards_batch)
    std_outcome = np.std(outcome_rewards_batch) or 1.0
    outcome_advantages = (np.array(outcome_rewards_batch) - mean_outcome) / std_outcome
    mt_grpo_advantages = []
    for rollout_idx in range(len(turn_rewards_batch)):
        rollout_advantages = []
        actual_num_turns = len(turn_rewards_batch[rollout_idx])
        for turn_idx in range(actual_num_turns):
            if final_turn_outcome_only and turn_idx == actual_num_turns - 1:  # 60188d07: A_O only
                adv = outcome_advantages[rollout_idx]
            else:
                adv = turn_advantages_by_turn[turn_idx][rollout_idx] + lam * outcome_advantages[rollout_idx]
            rollout_advantages.append(float(adv))
        mt_grpo_advantages.append(rollout_advantages)
    return mt_grpo_advantages


def atropos(batch, lam, final_turn_outcome_only):
    out = {}
    for group in batch.groups().values():
        advantages = _compute_mt_grpo_advantages([step_rewards(t) for t in group], [t.reward for t in group],
                                                 lam, final_turn_outcome_only)
        for trajectory, per_turn in zip(group, advantages):
            out.update({(trajectory.rollout_id, t): a for t, a in enumerate(per_turn, start=1)})
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_mt_grpo_equals_the_paper_repository_assign_advantages(seed, coef):
    batch = random_batch(seed, dense=seed % 2 == 1)
    ours = make_algorithm("mt_grpo", {"turn_advantage_coef": coef}).turn_advantages(batch, learner=None)
    assert max_abs_difference(ours, multi_turn_rl_agent(batch, coef)) < 1e-9


def test_mt_grpo_defaults_are_the_source_defaults():
    assert make_algorithm("mt_grpo", {}).config.turn_advantage_coef == 1.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("final_turn_outcome_only", [True, False])
def test_mt_grpo_atropos_equals_atropos_compute_mt_grpo_advantages(seed, final_turn_outcome_only):
    batch = random_batch(seed, dense=seed % 2 == 1)
    options = {"turn_level_advantage_lambda": 0.7, "last_turn_outcome_only": final_turn_outcome_only}
    ours = make_algorithm("mt_grpo_atropos", options).turn_advantages(batch, learner=None)
    assert max_abs_difference(ours, atropos(batch, 0.7, final_turn_outcome_only)) < 1e-9


def test_mt_grpo_and_its_atropos_variant_differ_on_multi_turn_batches():
    batch = random_batch(3, dense=True)
    ours = make_algorithm("mt_grpo", {}).turn_advantages(batch, learner=None)
    variant = make_algorithm("mt_grpo_atropos", {}).turn_advantages(batch, learner=None)
    assert max_abs_difference(ours, variant) > 0.1
