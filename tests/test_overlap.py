"""Collection overlapping the update: bounded staleness, recorded versions, truncated importance weights."""

from __future__ import annotations

import json

import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import TokenLogprobs
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.training.overlap import OverlappedCollection, drop_stale, staleness_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trajectory(rollout_id: str, versions: list[int]) -> Trajectory:
    turns = [Turn([1, 2], [3], [-0.5], policy_version=v) for v in versions]
    return Trajectory("t", "g", rollout_id, turns, reward=0.0, success=False)


def test_behaviour_weights_are_one_for_equal_policies_and_capped_otherwise():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert torch.equal(core.behaviour_weights(old, old.clone(), mask, 2.0), torch.ones(2, 3))
    assert torch.equal(core.behaviour_weights(old, old.clone(), mask, 2.0, level="sequence"), torch.ones(2))
    sampled = old - torch.tensor([[0.1, 3.0, 0.0], [-0.2, 0.0, 0.0]])  # the learner likes token (0, 1) e^3 more
    token = core.behaviour_weights(old, sampled, mask, 2.0)
    assert token[0, 0] == pytest.approx(torch.exp(torch.tensor(0.1)).item())
    assert token[0, 1] == 2.0 and token[0, 2] == 1.0  # capped; padding 1
    assert token[1, 0] == pytest.approx(torch.exp(torch.tensor(-0.2)).item())
    sequence = core.behaviour_weights(old, sampled, mask, 10.0, level="sequence")
    assert sequence[0] == pytest.approx(torch.exp(torch.tensor(1.55)).item())  # mean of 0.1 and 3.0


@pytest.mark.parametrize("loss", ["token", "sequence"])
def test_the_losses_are_unchanged_when_the_sampler_is_the_learner(loss):
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = (logprobs.detach() + 0.05 * torch.randn(3, 4)).clamp(max=0)
    advantages = torch.tensor([1.0, -0.5, 0.3])
    plain = TokenLogprobs(logprobs, mask)
    corrected = TokenLogprobs(logprobs, mask, sampled=old.clone(), sampled_cap=2.0)
    if loss == "token":
        run = lambda new: core.token_policy_loss(new, old, advantages[:, None].expand(3, 4), clip_low=0.2, clip_high=0.2)
    else:
        run = lambda new: core.sequence_policy_loss(new, old, advantages, clip_low=0.2, clip_high=0.2)
    (a, stats_a), (b, stats_b) = run(plain), run(corrected)
    assert torch.equal(a, b)
    assert stats_a.is_weight_mean is None and stats_b.is_weight_mean == pytest.approx(1.0)


def test_a_stale_rollout_past_the_bound_is_never_used():
    batch = RolloutBatch([trajectory("fresh", [2, 3]), trajectory("bound", [2]), trajectory("stale", [1, 3])])
    kept, dropped = drop_stale(batch, learner_version=3, max_staleness=1)
    assert [t.rollout_id for t in kept] == ["fresh", "bound"] and dropped == 1
    assert staleness_metrics(batch, 3, "rollout") == {"rollout/staleness_mean": 0.8, "rollout/staleness_max": 2.0}


def test_the_collector_samples_step_j_with_version_j_minus_1_minus_s_and_loads_weights_between_collections():
    loaded, collected = [], []

    def collect(step, version):
        collected.append((step, version))
        return f"batch {step}"

    overlap = OverlappedCollection(collect, loaded.append, max_staleness=1, first_step=1, last_step=4, start_version=0)
    overlap.publish(0, "w0")
    for step in range(1, 5):
        batch, version = overlap.take(step)
        assert batch == f"batch {step}" and version == max(step - 2, 0) and step - 1 - version <= 1
        overlap.publish(step, f"w{step}")  # the update of `step` is done
    overlap.close()
    assert collected == [(1, 0), (2, 0), (3, 1), (4, 2)]
    assert loaded == ["w1", "w2"]  # version 0 was already in the sampler


@pytest.fixture(scope="module")
def overlapped_run(tmp_path_factory):
    from seeupo_gym.training.cli import train_main

    out = tmp_path_factory.mktemp("overlap")
    code = train_main([
        "--config", "tiny-turnbandit", "train.max_staleness=1", "train.steps=3", "train.save_every=0",
        f"log.output_dir={out}", "log.progress_bars=false",
    ])
    return code, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_seeupo_train_tiny_turnbandit_runs_with_max_staleness_1(overlapped_run):
    code, records = overlapped_run
    assert code == 0 and [r["step"] for r in records] == [1, 2, 3]
    # Step 1 samples with the starting weights, later steps with the weights one update back.
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["rollout/stale_dropped"] == 0.0 for r in records)


def test_importance_weights_are_one_when_the_sampler_holds_the_learners_weights(overlapped_run):
    _, records = overlapped_run
    first = records[0]  # sampled with version 0, updated from version 0
    assert first["update/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["update/is_weight_capped"] == 0.0
    assert all("update/is_weight_mean" in r for r in records)


@pytest.mark.slow
def test_an_overlapped_per_episode_run_repeats_exactly(tmp_path):
    from seeupo_gym.training.cli import train_main

    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert train_main([
            "--config", "tiny-turnbandit", "train.max_staleness=1", "env.schedule=per_episode", "train.steps=3",
            "train.save_every=0", f"log.output_dir={out}", "log.progress_bars=false",
        ]) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.startswith("time/")} for r in records])
    assert runs[0] == runs[1] and len(runs[0]) == 3
