"""The learner scores at the sampling temperature in every pass, and the recorded logprobs agree.

verl and TRL divide the logits by the rollout temperature in the old, reference and gradient
passes; the reference here is that formula written out on a plain forward of the whole sequence
(`_reference_logprobs`), not a call into the project's scoring code.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.vector import VectorAgent
from seeupo_gym.algorithms.base import TokenLogprobs
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.training.config import ConfigError, load_config
from seeupo_gym.training.learner import LLMLearner, frozen_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BFCL = "seeupo/BFCL-v4-base-v0"


def _learner(model, tokenizer, temperature: float) -> LLMLearner:
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return LLMLearner(
        Accelerator(cpu=True), model, optimizer, pad_token_id=tokenizer.pad_token_id, reference=frozen_copy(model),
        max_tokens_per_microbatch=40, logprob_temperature=temperature,
    )


def _reference_logprobs(model, samples, temperature: float) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each response token, from one unpadded forward of context + response."""
    rows = []
    for sample in samples:
        context, response = sample.turn.context_ids, sample.turn.response_ids
        ids = torch.tensor([context + response])
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        rows.append(logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
    return rows


def _rows(out: TokenLogprobs) -> list[torch.Tensor]:
    return [row[mask] for row, mask in zip(out.logprobs, out.mask)]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_every_pass_scores_log_softmax_of_logits_over_the_temperature(tiny, temperature):
    model, tokenizer = tiny
    learner = _learner(model, tokenizer, temperature)
    samples = synthetic_batch(max_turns=3).samples()
    with torch.no_grad():
        expected = _reference_logprobs(learner.model, samples, temperature)
        at_one = _reference_logprobs(learner.model, samples, 1.0)
    gradient_pass = {}

    def loss(part, new, values):
        for sample, row, mask in zip(part, new.logprobs.detach(), new.mask):
            gradient_pass[sample.rollout_id, sample.t] = row[mask]
        return (new.logprobs * new.mask).sum() * 0.0

    learner.minimize(samples, loss)  # the gradient pass, in micro-batches of 40 tokens
    passes = {
        "old (no grad)": _rows(learner.logprobs(samples, grad=False)),
        "with grad": [row.detach() for row in _rows(learner.logprobs(samples, grad=True))],
        "reference": _rows(learner.ref_logprobs(samples)),
        "gradient (minimize)": [gradient_pass[s.rollout_id, s.t] for s in samples],
    }
    for name, rows in passes.items():
        for got, want in zip(rows, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} pass")
    # The temperature matters at this size: the passes at T=1 would be off by far more.
    gap = max((a - b).abs().max().item() for a, b in zip(expected, at_one))
    assert gap > 0.05


def test_the_gradient_at_a_temperature_is_the_gradient_of_the_reference_formula(tiny):
    model, tokenizer = tiny
    learner = _learner(model, tokenizer, 0.7)
    samples = synthetic_batch(max_turns=2).samples()
    out = learner.logprobs(samples, grad=True)
    (out.logprobs * out.mask).sum().backward()
    got = {name: p.grad.clone() for name, p in learner.model.named_parameters() if p.grad is not None}
    learner.model.zero_grad(set_to_none=True)
    torch.stack([row.sum() for row in _reference_logprobs(learner.model, samples, 0.7)]).sum().backward()
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_hf_backend_recorded_logprobs_equal_the_learners_at_the_sampling_temperature(tiny, temperature):
    """The real path: BFCL episodes sampled by the HF backend at T, scored by the learner at T."""
    model, tokenizer = tiny
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature)
    with VectorAgent(
        BFCL, HFBackend(model, tokenizer), tokenizer, num_envs=2, sampling=sampling, env_kwargs={"max_turns": 2}
    ) as agent:
        batch = agent.collect(["multi_turn_base_0"], group_size=2, seed=3)
    samples = batch.samples()
    assert len(samples) > len(batch)  # multi-turn
    assert {s.turn.logprob_temperature for s in samples} == {temperature}  # recorded per turn
    recorded = [torch.tensor(s.turn.sample_logprobs) for s in samples]
    learner = _learner(model, tokenizer, temperature)
    learner.behaviour_cap = 2.0  # overlapped collection: the weights read the recorded logprobs
    scored = _rows(learner.logprobs(samples, grad=False))
    for got, want in zip(scored, recorded):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    weights = []

    def loss(part, new, values):
        weights.append(((new.logprobs.detach() - new.sampled)[new.mask]).abs().max())
        return (new.logprobs * new.mask).sum() * 0.0

    learner.minimize(samples, loss)
    assert max(weights) < 1e-4  # log importance weights of the gradient pass: 0 up to float32 rounding
    # The old learner scored at temperature 1: off by far more than the tolerance.
    at_one = _rows(_learner(model, tokenizer, 1.0).logprobs(samples, grad=False))
    assert max((a - b).abs().max().item() for a, b in zip(at_one, recorded)) > 0.05


def _batch_recorded_at(temperature: float | None) -> RolloutBatch:
    batch = synthetic_batch(max_turns=2)
    for trajectory in batch:
        for turn in trajectory.turns:
            turn.logprob_temperature = temperature
    return batch


def test_importance_weights_against_another_temperature_are_refused(tiny):
    model, tokenizer = tiny
    learner = _learner(model, tokenizer, 1.0)
    learner.behaviour_cap = 2.0
    samples = _batch_recorded_at(0.7).samples()
    with pytest.raises(ValueError, match=r"temperature \[0.7\].*logprob_temperature 1.0"):
        learner.minimize(samples, lambda part, new, values: new.logprobs.sum() * 0.0)
    with pytest.raises(ValueError, match="importance weights"):
        learner.logprobs(samples, grad=False)


def test_on_policy_scoring_at_another_temperature_is_logged_once(tiny, caplog):
    model, tokenizer = tiny
    learner = _learner(model, tokenizer, 1.0)
    samples = _batch_recorded_at(1.3).samples()
    with caplog.at_level(logging.WARNING, logger="seeupo_gym.training.learner"):
        learner.logprobs(samples, grad=False)
        learner.ref_logprobs(samples)
    warnings = [r for r in caplog.records if "sampled at temperature [1.3]" in r.getMessage()]
    assert len(warnings) == 1
    # Turns at the learner's temperature, or with none recorded (hand-built records), say nothing.
    caplog.clear()
    quiet = _learner(model, tokenizer, 1.3)
    with caplog.at_level(logging.WARNING, logger="seeupo_gym.training.learner"):
        quiet.logprobs(samples, grad=False)
        quiet.logprobs(_batch_recorded_at(None).samples(), grad=False)
    assert not caplog.records


def test_config_resolves_the_learner_temperature_and_refuses_a_mismatch_with_staleness(caplog):
    assert load_config(None, ["sampling.temperature=0.7"]).sampling.learner_temperature() == 0.7
    assert load_config(None, ["sampling.temperature=0"]).sampling.learner_temperature() == 1.0  # greedy: T=1 logprobs
    assert load_config(None, ["sampling.logprob_temperature=0.7", "sampling.temperature=0.7"]).sampling.learner_temperature() == 0.7
    with pytest.raises(ConfigError, match="sampling.logprob_temperature is 1.0 .* temperature 0.7.*max_staleness"):
        load_config(None, ["sampling.temperature=0.7", "sampling.logprob_temperature=1.0", "train.max_staleness=1"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(None, ["sampling.logprob_temperature=0"])
    with caplog.at_level(logging.WARNING, logger="seeupo_gym.training.config"):
        load_config(None, ["sampling.temperature=0.7", "sampling.logprob_temperature=1.0"])
    assert any("another distribution" in r.getMessage() for r in caplog.records)


def test_trainer_policy_builds_its_learner_at_the_sampling_temperature():
    from seeupo_gym.training.policy import build_policy

    config = load_config(None, ["model.name_or_path=tiny", "sampling.temperature=1.3"])
    policy = build_policy(config, Accelerator(cpu=True), needs_value_model=False)
    assert policy.learner.logprob_temperature == 1.3


def test_turn_records_carry_no_temperature_unless_given():
    turn = Turn([1, 2], [3], [-0.5])
    assert turn.logprob_temperature is None
    Trajectory("t", "t", "r", [turn], 0.0, False)  # records built by hand stay valid
