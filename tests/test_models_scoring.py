"""agents.scoring.response_logprobs: teacher-forced logprobs in one padded batch."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.scoring import response_logprobs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=3)


def _sequences(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (n,), generator=generator).tolist() for n in lengths]


def _unpadded(model, context, response, temperature=1.0):
    logits = model(torch.tensor([context + response])).logits[0].float() / temperature
    rows = logits[len(context) - 1 : len(context) + len(response) - 1].log_softmax(-1)
    return rows.gather(-1, torch.tensor(response)[:, None])[:, 0]


@torch.no_grad()
def test_padded_batch_equals_one_unpadded_forward_per_sequence(tiny):
    model, tokenizer = tiny
    contexts = _sequences((3, 17, 8, 1), seed=0)
    responses = _sequences((5, 1, 9, 0), seed=1)
    logprobs, mask = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id)
    assert logprobs.shape == mask.shape == (4, 9)
    assert mask.sum(-1).tolist() == [5, 1, 9, 0]
    assert torch.all(logprobs[~mask] == 0)
    scored = [(i, context, response) for i, (context, response) in enumerate(zip(contexts, responses)) if response]
    for i, context, response in scored:
        assert torch.allclose(logprobs[i, : len(response)], _unpadded(model, context, response), atol=1e-4)


@torch.no_grad()
def test_chunked_forwards_and_temperature(tiny):
    model, tokenizer = tiny
    contexts = _sequences((6, 2, 11), seed=2)
    responses = _sequences((4, 7, 2), seed=3)
    whole, mask = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id)
    # One row per forward, rows regrouped by length: same numbers in caller order.
    chunked, chunked_mask = response_logprobs(
        model, contexts, responses, pad_token_id=tokenizer.pad_token_id, max_logit_elements=1
    )
    assert torch.equal(mask, chunked_mask)
    assert torch.allclose(whole, chunked, atol=1e-5)
    hot, _ = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id, temperature=2.0)
    assert torch.allclose(hot[1, :7], _unpadded(model, contexts[1], responses[1], temperature=2.0), atol=1e-4)
    assert not torch.allclose(hot[mask], whole[mask])


def test_grad_flows_only_when_asked(tiny):
    model, tokenizer = tiny
    contexts, responses = _sequences((4, 6), seed=4), _sequences((3, 5), seed=5)
    frozen, _ = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id)
    assert not frozen.requires_grad
    model.zero_grad()
    live, mask = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id, grad=True)
    live[mask].sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_bad_input_is_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="at least one token"):
        response_logprobs(model, [[]], [[1, 2]], pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="2 contexts for 1 responses"):
        response_logprobs(model, [[1], [2]], [[3]], pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def test_per_row_forwards_equal_the_padded_batch(tiny):
    model, tokenizer = tiny
    contexts = _sequences((12, 3, 30), seed=6)
    responses = _sequences((2, 9, 5), seed=7)
    batch, mask = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id, per_row=False)
    rows, rows_mask = response_logprobs(model, contexts, responses, pad_token_id=tokenizer.pad_token_id, per_row=True)
    assert torch.equal(mask, rows_mask)
    assert torch.allclose(batch, rows, atol=1e-5)
