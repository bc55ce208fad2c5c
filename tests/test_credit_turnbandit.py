"""TurnBandit's per-turn rewards option: J* unchanged, checked by brute force through env.step."""

from __future__ import annotations

import pytest

from seeupo_gym.algorithms.tabular import TabularPolicy, expected_batch, joint_actions
from seeupo_gym.turnbandit import LABELS, TurnBanditEnv


@pytest.mark.parametrize("variant", ["climbing", "stopping", "follow", "random"])
def test_turn_rewards_add_up_to_the_reward_and_keep_j_star_exact(variant):
    kwargs = {"turns": (2, 3), "options": 3} if variant != "follow" else {}
    env = TurnBanditEnv(variant=variant, num_tasks=3, seed=1, turn_rewards=True, **kwargs)
    plain = TurnBanditEnv(variant=variant, num_tasks=3, seed=1, **kwargs)
    for task, plain_task in zip(env.tasks, plain.tasks):
        assert task.rewards == plain_task.rewards
        best = 0.0
        for actions in joint_actions(task):
            env.reset(options={"task_id": task.task_id})
            shares, reward, done = [], 0.0, False
            for a in actions:
                assert not done
                _, reward, done, truncated, info = env.step(LABELS[a])
                shares.append(info["turn_reward"])
            assert done and not truncated
            assert reward == task.reward(actions)
            assert sum(shares) == pytest.approx(reward, abs=1e-12)
            assert shares == pytest.approx(list(task.turn_rewards(actions)), abs=1e-12)
            best = max(best, reward)
        assert best == task.optimal_value == plain_task.optimal_value


def test_turn_rewards_pay_the_uniform_continuation_increment_by_hand():
    env = TurnBanditEnv(variant="follow", num_tasks=1, seed=0, turns=(2, 2), options=3, turn_rewards=True)
    task = env.tasks[0]
    right = [a for a in joint_actions(task) if task.reward(a) == 1.0][0]
    # follow: phi(a1 right) = (1 + 1/3)/2 = 2/3; the second right choice adds 1 - 2/3.
    assert task.turn_rewards(right) == pytest.approx((2 / 3, 1 / 3))
    wrong_first = ((right[0] + 1) % 3, right[1])
    assert task.turn_rewards(wrong_first) == pytest.approx((1 / 6, 1 / 3))


def test_an_invalid_step_pays_nothing_and_the_penalty_lands_on_the_last_share():
    env = TurnBanditEnv(variant="follow", num_tasks=1, seed=0, turns=(2, 2), options=3, turn_rewards=True)
    task = env.tasks[0]
    env.reset(options={"task_id": task.task_id})
    _, _, _, _, info = env.step("no letter here at all")
    assert info["turn_reward"] == 0.0
    a = [a for a in joint_actions(task) if task.reward(a) == 1.0][0]
    shares = [env.step(LABELS[a[0]])[4]["turn_reward"]]
    _, reward, done, _, info = env.step(LABELS[a[1]])
    shares.append(info["turn_reward"])
    assert done and reward == pytest.approx(1.0 - env.invalid_penalty)
    assert sum(shares) == pytest.approx(reward)


def test_tabular_trajectories_carry_turn_rewards_and_repeating_observations():
    env = TurnBanditEnv(variant="climbing", num_tasks=1, seed=0, turns=(3, 3), options=3, turn_rewards=True)
    policy = TabularPolicy(env.tasks, observations=True)
    batch = expected_batch(policy, 27)
    observed = {}
    for trajectory in batch:
        assert sum(trajectory.info["turn_rewards"]) == pytest.approx(trajectory.reward)
        for turn, obs in zip(trajectory.turns, trajectory.info["observations"]):
            observed.setdefault(obs, set()).add(tuple(turn.context_ids))
    # Turn 3 after choice c is one observation over three different histories (c' then c).
    assert any(len(contexts) == 3 for obs, contexts in observed.items() if obs.startswith("turn 3"))
