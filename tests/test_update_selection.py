"""What an update learns from: never-started episodes, truncated ones, flat groups, groups of one,
and minibatches without a gradient."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch, tiny_config

from seeupo_gym.agents.models import load_model
from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.tabular import TabularPolicy
from seeupo_gym.training.learner import LLMLearner, frozen_copy


@dataclass
class TurnTask:
    """One turn of two options; option 0 is rewarded."""

    task_id: str
    num_turns: int = 1
    num_options: int = 2

    def reward(self, actions) -> float:
        return float(actions[0] == 0)


def episode(rid: str, group: str, reward: float, *, turns: int = 1, truncated: bool = False) -> Trajectory:
    return Trajectory(group, group, rid, [Turn([1, 2], [3], [0.0]) for _ in range(turns)], reward, False, truncated)


def test_an_episode_that_never_started_leaves_its_groups_statistics():
    played = [episode("a", "g", 1.0), episode("b", "g", 0.5), episode("c", "g", 0.0)]
    never_started = episode("d", "g", 0.0, turns=0)  # first context over budget: no turn
    selected, counts = core.select_for_update(RolloutBatch([*played, never_started]))
    assert selected.rollout_ids == ["a", "b", "c"] and counts["never_started"] == 1.0
    for normalization in core.NORMALIZATIONS:
        assert core.trajectory_advantages(selected, normalization) == core.trajectory_advantages(
            RolloutBatch(played), normalization
        )


def test_truncated_score_keeps_truncated_episodes_and_mask_leaves_them_out():
    batch = RolloutBatch([episode("a", "g", 1.0), episode("b", "g", 0.0, truncated=True), episode("c", "g", 0.5)])
    scored, counts = core.select_for_update(batch, truncated="score")
    assert scored.rollout_ids == ["a", "b", "c"] and "truncated_masked" not in counts
    masked, counts = core.select_for_update(batch, truncated="mask")
    assert masked.rollout_ids == ["a", "c"] and counts["truncated_masked"] == 1.0
    # b's reward 0 is no longer a baseline for a and c.
    assert core.trajectory_advantages(masked, "none") == {"a": 0.25, "c": -0.25}
    with pytest.raises(ValueError, match="truncated"):
        core.select_for_update(batch, truncated="drop")


def test_flat_groups_are_dropped_only_when_asked_and_counted():
    batch = RolloutBatch([
        episode("a", "flat", 0.0), episode("b", "flat", 0.0),
        episode("c", "spread", 1.0), episode("d", "spread", 0.0),
        episode("e", "alone", 0.7),
    ])
    kept, counts = core.select_for_update(batch)
    assert len(kept) == 5 and "flat_groups_dropped" not in counts
    kept, counts = core.select_for_update(batch, drop_flat_groups=True)
    # verl's DAPO filter keeps a prompt when `std > 0 or len(group) == 1`: a group of one stays.
    assert kept.rollout_ids == ["c", "d", "e"] and counts["flat_groups_dropped"] == 1.0


def verl_grpo_outcome_advantage(scores: list[float], index: list[str], norm_adv_by_std: bool, epsilon=1e-6):
    """verl 0.9 `compute_grpo_outcome_advantage`, transcribed: a group of one has mean 0 and std 1."""
    groups: dict[str, list[float]] = {}
    for score, idx in zip(scores, index):
        groups.setdefault(idx, []).append(score)
    mean, std = {}, {}
    for idx, values in groups.items():
        if len(values) == 1:
            mean[idx], std[idx] = 0.0, 1.0
        else:
            mean[idx] = sum(values) / len(values)
            std[idx] = (sum((v - mean[idx]) ** 2 for v in values) / (len(values) - 1)) ** 0.5  # torch.std
    return [(s - mean[i]) / (std[i] + epsilon) if norm_adv_by_std else s - mean[i] for s, i in zip(scores, index)]


@pytest.mark.parametrize("normalization", ["none", "group"])
def test_a_group_of_one_gets_its_reward_as_advantage_as_in_verl(normalization):
    rewards, groups = [0.7, 1.0, 0.0, 0.25, 0.5, 0.5], ["alone", "pair", "pair", "solo", "flat", "flat"]
    batch = RolloutBatch([episode(f"r{k}", g, r) for k, (g, r) in enumerate(zip(groups, rewards))])
    ours = core.trajectory_advantages(batch, normalization)
    theirs = verl_grpo_outcome_advantage(rewards, groups, norm_adv_by_std=normalization == "group")
    assert [ours[f"r{k}"] for k in range(len(rewards))] == pytest.approx(theirs, abs=1e-9)
    assert ours["r0"] == pytest.approx(0.7, rel=1e-5) and ours["r3"] == pytest.approx(0.25, rel=1e-5)


def test_group_size_one_trains_on_the_reward_instead_of_nothing():
    # train.group_size: 1: every group is a singleton; the update has a gradient (verl: A = R).
    policy = TabularPolicy([TurnTask("t0"), TurnTask("t1")], lr=0.5)
    batch = RolloutBatch([
        Trajectory("t0", "t0", "a", [Turn([0], [0], [math.log(0.5)])], 1.0, True),
        Trajectory("t1", "t1", "b", [Turn([1], [1], [math.log(0.5)])], 0.0, False),
    ])
    metrics = make_algorithm("grpo", {"kl_coef": 0.0}).update(batch, policy, torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0
    # Only a's rewarded choice moved: its probability rose from 0.5.
    assert float(policy.probs(0, [])[0]) > 0.5 and float(policy.probs(1, [])[1]) == pytest.approx(0.5)


def test_skipped_steps_add_up_and_other_metrics_average():
    merged = core.mean_metrics([{"grad_norm": 0.0, "skipped_no_gradient": 1.0}, {"grad_norm": 2.0},
                                {"grad_norm": 0.0, "skipped_no_gradient": 1.0}])
    assert merged == {"grad_norm": pytest.approx(2 / 3), "skipped_no_gradient": 2.0, "optimizer_steps": 3.0}


def test_a_minibatch_without_gradient_takes_no_optimizer_step():
    model, tokenizer = load_model("tiny", seed=0)
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    learner = LLMLearner(Accelerator(cpu=True), model, optimizer, pad_token_id=tokenizer.pad_token_id,
                         reference=frozen_copy(model), max_tokens_per_microbatch=64)
    samples = synthetic_batch().samples()

    def signal(part, new, values):
        return -(new.logprobs * new.mask).sum() / 100

    def no_signal(part, new, values):  # e.g. every advantage 0 and no KL
        return (new.logprobs * new.mask).sum() * 0.0

    assert "skipped_no_gradient" not in learner.minimize(samples, signal)  # AdamW now has momentum
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.minimize(samples, no_signal)
    assert metrics["grad_norm"] == 0.0 and metrics["skipped_no_gradient"] == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_trainer_leaves_never_started_episodes_out_and_skips_an_empty_update(tmp_path):
    from seeupo_gym.training.trainer import Trainer

    # A budget below any first context: every episode ends at reset, before its first turn.
    config = tiny_config(tmp_path, "train.steps=1", "env.max_context_tokens=8", "env.kwargs={max_turns: 1}")
    with Trainer(config) as trainer:
        record = trainer.train_step()
    assert record["rollout/trajectories"] == 2.0
    assert record["update/never_started"] == 2.0
    assert record["update/skipped_empty_batch"] == 1.0


def test_trainer_drops_flat_groups_when_asked(tmp_path):
    from seeupo_gym.training.trainer import Trainer

    # The plain BFCL env: the tiny model scores 0 on every rollout, so the one group is flat.
    config = tiny_config(tmp_path, "train.steps=1", "env.id=seeupo/BFCL-v4-v0", "env.kwargs={max_turns: 1}",
                         "train.drop_flat_groups=true")
    with Trainer(config) as trainer:
        record = trainer.train_step()
    assert record["rollout/flat_group_rate"] == 1.0
    assert record["update/flat_groups_dropped"] == 1.0 and record["update/skipped_empty_batch"] == 1.0


@pytest.mark.parametrize("name", ["grpo", "gspo", "seeupo", "ppo"])
def test_a_direct_update_leaves_never_started_and_masked_truncated_episodes_out(name):
    from seeupo_gym.algorithms.base import UpdateSelection

    def played(rid, reward, truncated=False):
        return Trajectory("t0", "g", rid, [Turn([0], [int(reward < 1)], [math.log(0.5)])], reward, reward == 1, truncated)

    batch = RolloutBatch([played("a", 1.0), played("b", 0.5), played("c", 0.0), played("e", 0.0, truncated=True),
                          Trajectory("t0", "g", "d", [], 0.0, False)])  # d never started
    algorithm = make_algorithm(name, {"kl_coef": 0.0})
    algorithm.selection = UpdateSelection(truncated="mask")
    metrics = algorithm.update(batch, TabularPolicy([TurnTask("t0")], lr=0.1), torch.Generator().manual_seed(0))
    assert metrics["never_started"] == 1.0 and metrics["truncated_masked"] == 1.0
    assert set(algorithm.schedule[0].rollout_ids) == {"a", "b", "c"}
    if name in ("grpo", "gspo"):  # GRAE over the three played rollouts only (verl's formula)
        expected = verl_grpo_outcome_advantage([1.0, 0.5, 0.0], ["g"] * 3, norm_adv_by_std=True)
        assert [algorithm.schedule[0].weights[r] for r in "abc"] == pytest.approx(expected, abs=1e-9)


def test_a_direct_update_of_nothing_to_learn_from_touches_no_parameter():
    policy = TabularPolicy([TurnTask("t0")], lr=0.1)
    before = policy.logits.detach().clone()
    metrics = make_algorithm("grpo").update(RolloutBatch([Trajectory("t0", "g", "d", [], 0.0, False)]), policy,
                                            torch.Generator().manual_seed(0))
    assert metrics == {"never_started": 1.0, "skipped_empty_batch": 1.0}
    assert torch.equal(policy.logits.detach(), before) and policy.optimizer_steps == 0
