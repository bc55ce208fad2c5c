import pytest

from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn


def make_turn(n_tokens: int = 2, offset: int = 0) -> Turn:
    return Turn(
        context_ids=[1, 2, 3 + offset],
        response_ids=[10 + offset + i for i in range(n_tokens)],
        sample_logprobs=[-0.5] * n_tokens,
    )


def make_trajectory(rollout_id: str, group_id: str, num_turns: int, reward: float) -> Trajectory:
    return Trajectory(
        task_id=f"task-{group_id}",
        group_id=group_id,
        rollout_id=rollout_id,
        turns=[make_turn(offset=t) for t in range(num_turns)],
        reward=reward,
        success=reward == 1.0,
    )


@pytest.fixture
def batch() -> RolloutBatch:
    return RolloutBatch(
        [
            make_trajectory("a0", "a", 3, 1.0),
            make_trajectory("b0", "b", 1, 0.0),
            make_trajectory("a1", "a", 2, 0.0),
            make_trajectory("b1", "b", 3, 0.5),
        ]
    )


def test_turn_rejects_logprobs_of_the_wrong_length():
    with pytest.raises(ValueError, match="sample_logprobs"):
        Turn(context_ids=[1], response_ids=[2, 3], sample_logprobs=[-1.0])


def test_batch_rejects_duplicate_rollout_ids():
    with pytest.raises(ValueError, match="appears twice"):
        RolloutBatch([make_trajectory("x", "g", 1, 0.0), make_trajectory("x", "g", 2, 1.0)])


def test_groups_collect_the_rollouts_of_each_task_in_batch_order(batch):
    groups = batch.groups()
    assert list(groups) == ["a", "b"]
    assert [t.rollout_id for t in groups["a"]] == ["a0", "a1"]
    assert [t.rollout_id for t in groups["b"]] == ["b0", "b1"]


def test_turn_pool_holds_turn_t_of_exactly_the_trajectories_that_have_it(batch):
    assert batch.max_turns == 3
    assert [s.rollout_id for s in batch.turn_pool(1)] == ["a0", "b0", "a1", "b1"]
    assert [s.rollout_id for s in batch.turn_pool(2)] == ["a0", "a1", "b1"]
    assert [s.rollout_id for s in batch.turn_pool(3)] == ["a0", "b1"]
    assert batch.turn_pool(4) == []
    for sample in batch.turn_pool(2):
        assert sample.t == 2
        assert sample.turn is batch[sample.rollout_id].turns[1]


def test_turns_are_one_based(batch):
    assert batch["b0"].turn(1) is batch["b0"].turns[0]
    assert batch["b0"].turn(2) is None
    with pytest.raises(ValueError):
        batch["b0"].turn(0)


def test_samples_flatten_every_turn_once(batch):
    samples = batch.samples()
    assert len(samples) == 3 + 1 + 2 + 3
    assert {(s.rollout_id, s.t) for s in samples} == {
        ("a0", 1), ("a0", 2), ("a0", 3), ("b0", 1), ("a1", 1), ("a1", 2), ("b1", 1), ("b1", 2), ("b1", 3)
    }
    assert batch.num_response_tokens() == 2 * len(samples)


def test_rewards_are_keyed_by_rollout_id(batch):
    assert batch.rewards() == {"a0": 1.0, "b0": 0.0, "a1": 0.0, "b1": 0.5}
