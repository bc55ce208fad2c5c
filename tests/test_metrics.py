import itertools
import random

import pytest

from seeupo_gym.training.metrics import Outcome, format_table, pass_at_k, summarize


def test_pass_at_k_with_n_equal_k_is_any_success():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 4, 4) == 1.0


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_success():
    # The unbiased estimator is the exact probability that a random k-subset of the n
    # samples holds at least one success: check against enumeration.
    outcomes = [True, False, False, True, False, False]
    n, c = len(outcomes), sum(outcomes)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_1_is_the_success_rate():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_k_rejects_too_few_samples():
    with pytest.raises(ValueError, match="at least k"):
        pass_at_k(2, 1, 3)


def test_summarize_reports_avg_and_pass_per_category_and_overall():
    outcomes = [
        Outcome("t1", 1.0, True, "base"), Outcome("t1", 0.0, False, "base"),
        Outcome("t2", 0.5, False, "base"), Outcome("t2", 0.5, False, "base"),
        Outcome("t3", 0.0, False, "miss_func"), Outcome("t3", 1.0, True, "miss_func"),
    ]
    summary = summarize(outcomes, k=2)
    assert list(summary) == ["base", "miss_func", "overall"]
    assert summary["base"] == {"tasks": 2.0, "avg@2": pytest.approx(0.5), "pass@2": pytest.approx(0.5)}
    assert summary["miss_func"] == {"tasks": 1.0, "avg@2": pytest.approx(0.5), "pass@2": pytest.approx(1.0)}
    assert summary["overall"]["avg@2"] == pytest.approx(0.5)
    assert summary["overall"]["pass@2"] == pytest.approx(2 / 3)


def test_summarize_with_more_samples_than_k_uses_the_unbiased_estimator():
    rng = random.Random(0)
    successes = [rng.random() < 0.3 for _ in range(8)]
    outcomes = [Outcome("t", float(s), s) for s in successes]
    summary = summarize(outcomes, k=3)
    assert summary["overall"]["pass@3"] == pytest.approx(pass_at_k(8, sum(successes), 3))
    assert summary["overall"]["avg@3"] == pytest.approx(sum(successes) / 8)


def test_summarize_rejects_empty_input_and_mixed_categories():
    with pytest.raises(ValueError):
        summarize([], k=1)
    with pytest.raises(ValueError, match="several categories"):
        summarize([Outcome("t", 1.0, True, "a"), Outcome("t", 0.0, False, "b")], k=1)


def test_format_table_is_markdown():
    table = format_table(summarize([Outcome("t", 1.0, True)], k=1))
    assert table.splitlines()[0] == "| category | tasks | avg@1 | pass@1 |"
    assert "| overall | 1 | 1.000 | 1.000 |" in table


def test_rollout_metrics_flag_groups_without_learning_signal_and_estimate_entropy():
    import math

    from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
    from seeupo_gym.training.collection import rollout_metrics

    def rollout(group: str, i: int, reward: float, logprobs: list[float]) -> Trajectory:
        turn = Turn(context_ids=[1, 2], response_ids=[3] * len(logprobs), sample_logprobs=logprobs)
        return Trajectory(task_id=group, group_id=group, rollout_id=f"{group}-{i}", turns=[turn],
                          reward=reward, success=reward == 1.0)

    batch = RolloutBatch([
        rollout("flat", 0, 1.0, [math.log(0.5)]), rollout("flat", 1, 1.0, [math.log(0.5)]),
        rollout("mixed", 0, 0.0, [math.log(0.25)]), rollout("mixed", 1, 1.0, [0.0]),
    ])
    metrics = rollout_metrics(batch, "rollout")
    assert metrics["rollout/flat_group_rate"] == 0.5
    assert metrics["rollout/sampled_nll_mean"] == pytest.approx((2 * math.log(2) + math.log(4)) / 4)
    assert metrics["rollout/reward_mean"] == 0.75
