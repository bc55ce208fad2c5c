"""The learner at scale: packed trajectories, micro-batches under a token budget, bounded logits.

Exactness is the specification: packing, the budget and the chunked LM head change how the
work is cut, never the numbers (logprobs to 1e-5, a whole update to 1e-6).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch

import seeupo_gym  # noqa: F401  (registers the env ids)
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.scoring import linear_logprobs, pack_sequences, response_logprobs
from seeupo_gym.agents.vector import VectorAgent
from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import load_plugin, make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.training.learner import LLMLearner, ValueModel, frozen_copy, lm_backbone, plan_microbatches

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def learner_for(model, tokenizer, budget: int, pack_limit: int | None = None, value: bool = False, lr: float = 0.1):
    # SGD: the update is the gradient itself (Adam would blow up float noise of near-zero gradients).
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    value_model = value_optimizer = None
    if value:
        critic = copy.deepcopy(model)
        value_model = ValueModel(lm_backbone(critic), critic.config.hidden_size)
        torch.nn.init.normal_(value_model.head.weight, std=0.1, generator=torch.Generator().manual_seed(0))
        value_optimizer = torch.optim.SGD(value_model.parameters(), lr=lr)
    learner = LLMLearner(
        Accelerator(cpu=True), model, optimizer, pad_token_id=tokenizer.pad_token_id, reference=frozen_copy(model),
        value_model=value_model, value_optimizer=value_optimizer, max_tokens_per_microbatch=budget, pack_limit=pack_limit,
    )
    return learner, model, value_model


def per_turn(model, samples, pad_token_id: int) -> torch.Tensor:
    """The definition: every turn scored alone on its own context, full logits."""
    logprobs, _ = response_logprobs(
        model, [s.turn.context_ids for s in samples], [s.turn.response_ids for s in samples], pad_token_id=pad_token_id
    )
    return logprobs


# --------------------------------------------------------------------------- packing


@pytest.fixture(scope="module")
def bfcl_batches(tiny):
    """Real BFCL rollouts of the tiny model: token-in/token-out, and with contexts rebuilt (keep_think=False)."""
    model, tokenizer = tiny
    batches = {}
    for keep_think in (True, False):
        with VectorAgent(
            "seeupo/BFCL-v4-base-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
            sampling=SamplingParams(max_new_tokens=8), env_kwargs={"max_turns": 3, "keep_think": keep_think},
        ) as agent:
            batches[keep_think] = agent.collect(["multi_turn_base_0"], group_size=2, seed=5)
    return batches


@pytest.mark.parametrize("keep_think", [True, False])
def test_packed_logprobs_equal_per_turn_scoring_on_real_bfcl_rollouts(tiny, bfcl_batches, keep_think):
    model, tokenizer = tiny
    batch = bfcl_batches[keep_think]
    samples = batch.samples()
    assert len(samples) > len(batch)  # multi-turn
    learner, policy, _ = learner_for(model, tokenizer, budget=4096)
    packed = learner.logprobs(samples, grad=False)
    expected = per_turn(policy, samples, tokenizer.pad_token_id)
    torch.testing.assert_close(packed.logprobs, expected, atol=1e-5, rtol=0)


def test_token_in_token_out_turns_pack_into_one_sequence_per_trajectory(bfcl_batches):
    batch = bfcl_batches[True]
    samples = batch.samples()
    sequences = pack_sequences([s.rollout_id for s in samples], [s.turn.context_ids for s in samples],
                               [s.turn.response_ids for s in samples])
    assert len(sequences) == len(batch)
    last_turns = [t.turns[-1] for t in batch]
    assert sorted(len(s.tokens) for s in sequences) == sorted(len(t.context_ids) + len(t.response_ids) for t in last_turns)


def test_rebuilt_contexts_fall_back_to_one_sequence_per_turn(tiny):
    model, tokenizer = tiny
    # Turn 2's context drops turn 1's response (as keep_think=False does to a <think> block).
    turns = [Turn([5, 6, 7], [8, 9], [0.0, 0.0]), Turn([5, 6, 7, 11, 12], [13, 14, 15], [0.0] * 3),
             Turn([5, 6, 7, 11, 12, 13, 14, 15, 16], [17], [0.0])]
    batch = RolloutBatch([Trajectory("t", "g", "r", turns, 1.0, True)])
    samples = batch.samples()
    sequences = pack_sequences(["r"] * 3, [t.context_ids for t in turns], [t.response_ids for t in turns])
    assert [len(s.spans) for s in sequences] == [1, 2]  # turn 1 alone; turns 2 and 3 still share one
    learner, policy, _ = learner_for(model, tokenizer, budget=64)
    torch.testing.assert_close(learner.logprobs(samples, grad=False).logprobs,
                               per_turn(policy, samples, tokenizer.pad_token_id), atol=1e-5, rtol=0)


def test_several_trajectories_in_one_packed_row_do_not_see_each_other(tiny):
    model, tokenizer = tiny
    samples = synthetic_batch(num_tasks=3, group_size=2, max_turns=3, seed=2).samples()
    learner, policy, _ = learner_for(model, tokenizer, budget=10_000, pack_limit=10_000)
    torch.testing.assert_close(learner.logprobs(samples, grad=False).logprobs,
                               per_turn(policy, samples, tokenizer.pad_token_id), atol=1e-5, rtol=0)
    assert learner.tokens_fed["policy"] == sum(len(t.turns[-1].context_ids) + len(t.turns[-1].response_ids)
                                                for t in synthetic_batch(num_tasks=3, group_size=2, max_turns=3, seed=2))


def test_chunked_lm_head_logprobs_and_gradients_equal_the_full_log_softmax():
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).double()
    hidden = torch.randn(7, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=generator)
    weights = torch.randn(7, dtype=torch.float64, generator=generator)
    chunked = linear_logprobs(hidden, head, targets, chunk=3)
    (chunked.double() * weights).sum().backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    full = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    (full * weights).sum().backward()
    torch.testing.assert_close(chunked.double(), full.detach(), atol=1e-6, rtol=0)
    for got, want in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- micro-batches


def test_plan_gives_every_process_the_same_number_of_microbatches_under_the_budget():
    lengths = [900, 40, 300, 300, 120, 80, 2000, 10, 10, 650]
    plan = plan_microbatches(lengths, budget=1000, processes=3)
    assert len({len(p) for p in plan}) == 1
    assert sorted(i for p in plan for micro in p for i in micro) == list(range(len(lengths)))
    for process in plan:
        for micro in process:
            assert sum(lengths[i] for i in micro) <= 1000 or len(micro) == 1
    loads = [sum(lengths[i] for micro in p for i in micro) for p in plan]
    assert max(loads) == 2000  # the longest sequence alone outweighs any balance


PLUGIN = str(ROOT / "docs" / "examples" / "rloo.py")


@pytest.mark.parametrize(
    "name,options",
    [
        ("grpo", {"kl_coef": 0.1}),
        ("grpo", {"loss_agg": "seq-mean-token-mean"}),
        ("gspo", {"kl_coef": 0.1}),
        ("ppo", {"kl_coef": 0.1}),
        ("seeupo", {"kl_coef": 0.1}),
        ("rloo", {}),
    ],
)
def test_a_microbatched_update_equals_the_whole_minibatch_update(tiny, name, options):
    load_plugin(PLUGIN)
    model, tokenizer = tiny
    batch = synthetic_batch(num_tasks=2, group_size=2, max_turns=3, seed=3)
    needs_value = make_algorithm(name).needs_value_model
    results = []
    for budget, pack_limit in ((100_000, 100_000), (12, None)):
        learner, policy, critic = learner_for(model, tokenizer, budget, pack_limit, value=needs_value)
        algorithm = make_algorithm(name, {"minibatch_size": 4, "epochs": 2, **options})
        metrics = algorithm.update(batch, learner, torch.Generator().manual_seed(0))
        results.append((metrics, policy, critic))
    (whole, policy_a, critic_a), (micro, policy_b, critic_b) = results
    assert whole["optimizer_steps"] == micro["optimizer_steps"] >= 2
    for key, value in whole.items():
        # Norms of summed float32 gradients (~20) differ in their last bits with the summation order.
        assert micro[key] == pytest.approx(value, abs=1e-6, rel=1e-6 if key.endswith("grad_norm") else 0), key
    for (label, a), b in zip(policy_a.named_parameters(), policy_b.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=label)
    if needs_value:
        for a, b in zip(critic_a.parameters(), critic_b.parameters()):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_grpo_feeds_each_trajectory_once_per_pass(tiny):
    model, tokenizer = tiny
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=3, seed=3)
    learner, _, _ = learner_for(model, tokenizer, budget=64)
    make_algorithm("grpo", {"kl_coef": 0.1, "minibatch_size": 4}).update(batch, learner, torch.Generator().manual_seed(0))
    packed = sum(len(t.turns[-1].context_ids) + len(t.turns[-1].response_ids) for t in batch)
    assert learner.tokens_fed["policy"] == 2 * packed  # the old pass and the gradient pass
    assert learner.tokens_fed["reference"] == packed


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_a_one_step_update_skips_the_old_pass_and_changes_nothing_else(tiny, monkeypatch, name):
    model, tokenizer = tiny
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=3, seed=3)
    packed = sum(len(t.turns[-1].context_ids) + len(t.turns[-1].response_ids) for t in batch)
    options = {"kl_coef": 0.1, "minibatch_size": 64}
    skipped, skipped_policy, _ = learner_for(model, tokenizer, budget=64)
    skipped_metrics = make_algorithm(name, options).update(batch, skipped, torch.Generator().manual_seed(0))
    assert skipped.tokens_fed["policy"] == packed  # the gradient pass alone

    recomputing = lambda learner, samples, *_: core.frozen_logprobs(learner, samples)  # noqa: E731
    monkeypatch.setattr(core, "old_logprobs", recomputing)
    full, full_policy, _ = learner_for(model, tokenizer, budget=64)
    full_metrics = make_algorithm(name, options).update(batch, full, torch.Generator().manual_seed(0))
    assert full.tokens_fed["policy"] == 2 * packed
    for key, value in full_metrics.items():
        assert skipped_metrics[key] == pytest.approx(value, abs=1e-6), key
    for (label, a), b in zip(full_policy.named_parameters(), skipped_policy.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=label)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), skipped_policy.parameters()))
    assert moved > 1e-4  # the update did something to compare
