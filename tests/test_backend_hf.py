"""HFBackend on the tiny model: batched left-padded sampling, recorded logprobs, stops, seeds."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.agents.backends import Backend, HFBackend, SamplingParams
from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.scoring import response_logprobs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def backend(tiny):
    return HFBackend(*tiny)


def _prompts(lengths=(3, 11, 6, 1), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (n,), generator=generator).tolist() for n in lengths]


# Half the vocabulary stops: completions end at different steps, exercising the row pruning.
HALF_STOPS = tuple(range(0, 75_000))


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)


def test_recorded_logprobs_equal_teacher_forced_recomputation(tiny, backend):
    model, tokenizer = tiny
    prompts = _prompts()
    completions = backend.generate(prompts, SamplingParams(max_new_tokens=10, stop_token_ids=HALF_STOPS, seed=1))
    lengths = [len(c.token_ids) for c in completions]
    assert len(set(lengths)) > 1, "rows should finish at different steps"
    for completion in completions:
        assert len(completion.logprobs) == len(completion.token_ids)
        stopped = completion.token_ids[-1] in HALF_STOPS
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert all(t not in HALF_STOPS for t in completion.token_ids[:-1])
    recomputed, mask = response_logprobs(
        model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id
    )
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, : lengths[i]], torch.tensor(completion.logprobs), atol=1e-4)


def test_same_seed_same_completions_and_the_global_rng_is_untouched(backend):
    prompts = _prompts()
    sampling = SamplingParams(max_new_tokens=6, seed=7)
    state = torch.random.get_rng_state()
    first = backend.generate(prompts, sampling)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = backend.generate(prompts, sampling)
    other = backend.generate(prompts, SamplingParams(max_new_tokens=6, seed=8))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_greedy_picks_the_argmax_and_tiny_top_p_is_greedy(tiny, backend):
    model, _ = tiny
    prompt = _prompts((5,))[0]
    greedy = backend.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert greedy.token_ids[0] == int(logits.argmax())
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 4
    nucleus = backend.generate([prompt], SamplingParams(top_p=1e-6, max_new_tokens=4, seed=3))[0]
    assert nucleus.token_ids == greedy.token_ids


def test_temperature_logprobs_are_the_tempered_policy(tiny, backend):
    model, tokenizer = tiny
    prompts = _prompts((4, 7))
    completions = backend.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=5, seed=2))
    recomputed, _ = response_logprobs(
        model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id, temperature=0.7
    )
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, :5], torch.tensor(completion.logprobs), atol=1e-4)


def test_stop_strings_end_the_completion_at_the_token_that_completes_them(tiny, backend):
    _, tokenizer = tiny
    completions = backend.generate(_prompts(), SamplingParams(max_new_tokens=40, stop_strings=("e",), seed=5))
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    for completion in stopped:
        assert "e" in tokenizer.decode(completion.token_ids)
        assert "e" not in tokenizer.decode(completion.token_ids[:-1])


def test_update_weights_from_a_state_dict_changes_the_policy():
    model, tokenizer = load_model("tiny", seed=0)
    other, _ = load_model("tiny", seed=1)
    backend = HFBackend(model, tokenizer)
    prompts = _prompts((4,))
    sampling = SamplingParams(max_new_tokens=5, seed=4)
    reference = HFBackend(other, tokenizer).generate(prompts, sampling)[0]
    before = backend.generate(prompts, sampling)[0]
    backend.update_weights(model)  # the learner's own module: nothing to do
    assert backend.generate(prompts, sampling)[0] == before
    backend.update_weights(other.state_dict())
    after = backend.generate(prompts, sampling)[0]
    assert after.token_ids == reference.token_ids and after.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)


def test_sampling_in_eval_mode_and_restoring_train_mode(tiny):
    model, tokenizer = load_model("tiny", seed=0, lora={"r": 4, "alpha": 8, "dropout": 0.5})
    model.train()
    backend = HFBackend(model, tokenizer)
    prompts = _prompts((3, 5))
    completions = backend.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    assert model.training
    model.eval()
    recomputed, _ = response_logprobs(model, prompts, [c.token_ids for c in completions], pad_token_id=tokenizer.pad_token_id)
    for i, completion in enumerate(completions):
        assert torch.allclose(recomputed[i, :4], torch.tensor(completion.logprobs), atol=1e-4)


def test_bad_requests_are_refused(backend):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[1, 2], []], SamplingParams())
    assert backend.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_per_row_prefill_matches_the_padded_batch_prefill(tiny):
    model, tokenizer = tiny
    prompts = _prompts((30, 4, 17))
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=HALF_STOPS, seed=9)
    per_row = HFBackend(model, tokenizer, prefill_per_row=True).generate(prompts, sampling)
    padded = HFBackend(model, tokenizer, prefill_per_row=False).generate(prompts, sampling)
    for a, b in zip(per_row, padded):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
