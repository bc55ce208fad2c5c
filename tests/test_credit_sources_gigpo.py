"""`gigpo` against a transcription of langfengQ/verl-agent 29e3e8b3e3412aff53b1e4a461dac77a8eec19bd
gigpo/core_gigpo.py (`to_hashable`, `compute_step_discounted_returns`, `episode_norm_reward`,
`build_step_group`, `step_norm_reward`, `compute_gigpo_outcome_advantage`), written from the source in
plain numpy with its names and control flow; our code is not called to compute it."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn


def to_hashable(x):
    if isinstance(x, (int, float, str, bool)):
        return x
    elif isinstance(x, (np.integer, np.floating)):
        return x.item()
    elif isinstance(x, np.ndarray):
        return tuple(x.flatten())
    elif isinstance(x, (list, tuple)):
        return tuple(to_hashable(e) for e in x)
    elif isinstance(x, dict):
        return tuple(sorted((k, to_hashable(v)) for k, v in x.items()))
    else:
        raise TypeError(f"Unsupported type: {type(x)}")


def compute_step_discounted_returns(rewards, traj_uids, gamma):
    returns_by_traj = {}
    for uid in np.unique(traj_uids):
        traj_indices = np.where(traj_uids == uid)[0]
        traj_rewards = rewards[traj_indices]
        traj_returns = np.zeros_like(traj_rewards)
        running_return = 0
        for t in reversed(range(len(traj_rewards))):
            running_return = traj_rewards[t] + gamma * running_return
            traj_returns[t] = running_return
        returns_by_traj[uid] = traj_returns
    all_returns = np.zeros_like(rewards)
    for i, uid in enumerate(traj_uids):
        traj_indices = np.where(traj_uids == uid)[0]
        idx_in_traj = np.where(traj_indices == i)[0][0]
        all_returns[i] = returns_by_traj[uid][idx_in_traj]
    return all_returns


def episode_norm_reward(scores, index, traj_index, epsilon, remove_std, compute_mean_std_cross_steps=True):
    scores = scores.copy()
    id2score, id2mean, id2std, seen_pairs = defaultdict(list), {}, {}, set()
    bsz = scores.shape[0]
    for i in range(bsz):
        if (index[i], traj_index[i]) in seen_pairs:
            continue
        id2score[index[i]].append(scores[i])
        if not compute_mean_std_cross_steps:
            seen_pairs.add((index[i], traj_index[i]))
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = 0.0, 1.0
        else:
            id2mean[idx] = np.mean(id2score[idx])
            id2std[idx] = np.std(id2score[idx], ddof=1)  # torch.std: unbiased
    for i in range(bsz):
        if remove_std:
            scores[i] = scores[i] - id2mean[index[i]]
        else:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def build_step_group(anchor_obs, index):
    step_group_uids = np.empty(len(anchor_obs), dtype=object)
    uid_counter = itertools.count()  # the source draws uuid4s; any distinct labels do
    for idx in np.unique(index):
        indices = np.where(index == idx)[0]
        obs_group = anchor_obs[indices]
        clusters = defaultdict(list)
        for i, obs in enumerate(obs_group):
            clusters[to_hashable(obs)].append(indices[i])
        for obs, original_indices in clusters.items():
            uid = str(next(uid_counter))
            for original_idx in original_indices:
                step_group_uids[original_idx] = uid
    return step_group_uids


def step_norm_reward(step_rewards_, index, epsilon, remove_std):
    scores = step_rewards_.copy()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = np.mean(id2score[idx]), 1.0
        else:
            id2mean[idx] = np.mean(id2score[idx])
            id2std[idx] = np.std(id2score[idx], ddof=1)
    for i in range(bsz):
        if remove_std:
            scores[i] = scores[i] - id2mean[index[i]]
        else:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def compute_gigpo_outcome_advantage(scores, step_rewards_, anchor_obs, index, traj_index, epsilon, step_advantage_w, mode):
    remove_std = {"mean_std_norm": False, "mean_norm": True}[mode]
    episode_advantages = episode_norm_reward(scores, index, traj_index, epsilon, remove_std)
    step_group_uids = build_step_group(anchor_obs, index)
    step_advantages = step_norm_reward(step_rewards_, step_group_uids, epsilon, remove_std)
    return episode_advantages + step_advantage_w * step_advantages


def verl_agent(batch, gamma, step_advantage_w, mode, epsilon):
    """One row per turn sample; the episode reward on each row as verl-agent's step rows carry it."""
    samples = batch.samples()
    index = np.array([s.group_id for s in samples], dtype=object)
    traj_index = np.array([s.rollout_id for s in samples], dtype=object)
    rewards = np.array([step_rewards(s.trajectory)[s.t - 1] for s in samples], dtype=np.float64)
    scores = np.array([s.trajectory.reward for s in samples], dtype=np.float64)
    anchor_obs = np.empty(len(samples), dtype=object)
    for i, s in enumerate(samples):
        observations = s.trajectory.info.get("observations")
        # Without observations ours anchors on the whole context (a mapping of ours, not the source's).
        anchor_obs[i] = observations[s.t - 1] if observations is not None else ("context", list(s.turn.context_ids))
    step_rewards_ = compute_step_discounted_returns(rewards, traj_index, gamma)
    advantages = compute_gigpo_outcome_advantage(
        scores, step_rewards_, anchor_obs, index, traj_index, epsilon, step_advantage_w, mode
    )
    return {(s.rollout_id, s.t): float(a) for s, a in zip(samples, advantages)}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("observations", [True, False])
def test_gigpo_equals_verl_agent_compute_gigpo_outcome_advantage(seed, mode, observations):
    batch = random_batch(seed, observations=observations, dense=seed % 3 == 2)
    options = {"gamma": 0.9, "step_advantage_w": 0.7, "mode": mode, "epsilon": 1e-6}
    ours = make_algorithm("gigpo", options).turn_advantages(batch, learner=None)
    assert max_abs_difference(ours, verl_agent(batch, 0.9, 0.7, mode, 1e-6)) < 1e-9


def test_gigpo_anchors_compare_values_not_their_text():
    # Turn 1 observations: a and b show the int 1, c the float 1.0 (equal to 1), d the string "1".
    turns = [Turn([0], [1], [0.0])]
    batch = RolloutBatch([
        Trajectory("t", "g", rid, turns, reward, False, info={"observations": [obs], "turn_rewards": [reward]})
        for rid, obs, reward in [("a", 1, 1.0), ("b", 1, 0.0), ("c", 1.0, 0.5), ("d", "1", 1.0)]
    ])
    adv = make_algorithm("gigpo", {"gamma": 1.0}).turn_advantages(batch, learner=None)
    episode_mean = 2.5 / 4
    # Step group {a, b, c}: mean 0.5; "1" alone: step term 0.
    assert adv[("a", 1)] == pytest.approx(1.0 - episode_mean + 0.5)
    assert adv[("d", 1)] == pytest.approx(1.0 - episode_mean)
    assert adv == pytest.approx(verl_agent(batch, 1.0, 1.0, "mean_norm", 1e-6))


def test_gigpo_refuses_an_observation_verl_agent_cannot_hash():
    batch = RolloutBatch([Trajectory("t", "g", "a", [Turn([0], [1], [0.0])], 1.0, True, info={"observations": [object()]})])
    with pytest.raises(TypeError, match="anchor observations"):
        make_algorithm("gigpo", {}).turn_advantages(batch, learner=None)
