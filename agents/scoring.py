"""Teacher-forced per-token logprobs of responses given their contexts.

The learner uses this for old / new / reference logprobs, and the token-in/token-out test
compares it with what the backend recorded at sampling time, so it is the one definition of
"the policy's logprob of a response token" in the project.

Layout of one padded batch (so every response starts at the same column and only the
response positions go through the LM head):

    row i = [pad] * (C - len(context_i)) + context_i + response_i + [pad] * (L - len(response_i))

C is the longest context, L the longest response. Position ids count real tokens only, so
left padding does not shift positions. The logits for response token j come from column
C - 1 + j; the forward keeps just the last L + 1 columns (`logits_to_keep`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Upper bound on logits materialized per forward (rows x L x vocab floats): ~1 GiB in fp32.
DEFAULT_MAX_LOGIT_ELEMENTS = 1 << 28
# On CPU, sequences at least this long are scored one per forward (see `per_row`).
PER_ROW_MIN_TOKENS = 256


def pad_batch(
    contexts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-padded contexts + right-padded responses: (input_ids, attention_mask, position_ids, L)."""
    if len(contexts) != len(responses):
        raise ValueError(f"{len(contexts)} contexts for {len(responses)} responses")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context needs at least one token (the response is predicted from it)")
    n = len(contexts)
    max_context = max(len(c) for c in contexts)
    max_response = max(len(r) for r in responses)
    width = max_context + max_response
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, (context, response) in enumerate(zip(contexts, responses)):
        start = max_context - len(context)
        end = max_context + len(response)
        input_ids[i, start:end] = torch.tensor(list(context) + list(response), dtype=torch.long)
        attention_mask[i, start:end] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, max_response


def response_logprobs(
    model: torch.nn.Module,
    contexts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    grad: bool = False,
    temperature: float = 1.0,
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS,
    per_row: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each response given its context.

    Returns `(logprobs, mask)`, both `[n, L]` with L the longest response, right-padded;
    `mask` is True on real response tokens, and `logprobs` is 0 elsewhere. logprobs are
    float32 `log_softmax(logits / temperature)` on the model's device. With `grad=True`
    the result carries the autograd graph (for the learner's loss).

    Rows are split into several forwards only when one would materialize more than
    `max_logit_elements` logits; with grad each chunk's graph stays alive until backward.
    per_row: one unpadded forward per row instead of one padded batch. On CPU a padded batch
    of long sequences costs several times the sum of unpadded forwards (the padding mask
    leaves sdpa's causal fast path), so None means: per row on CPU once a sequence reaches
    `PER_ROW_MIN_TOKENS`, one padded batch otherwise (and always on GPU).
    """
    n = len(contexts)
    if len(responses) != n:
        raise ValueError(f"{n} contexts for {len(responses)} responses")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context needs at least one token (the response is predicted from it)")
    if n == 0:
        return torch.zeros((0, 0)), torch.zeros((0, 0), dtype=torch.bool)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    max_response = max(len(r) for r in responses)
    if max_response == 0:
        return torch.zeros((n, 0), device=device), torch.zeros((n, 0), dtype=torch.bool, device=device)

    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else 1
    rows_per_forward = max(1, max_logit_elements // max(1, (max_response + 1) * vocab))
    longest = max(len(c) + len(r) for c, r in zip(contexts, responses))
    if per_row is None:
        per_row = device.type == "cpu" and longest >= PER_ROW_MIN_TOKENS
    if per_row:
        rows_per_forward = 1
    if rows_per_forward >= n:
        chunks = [list(range(n))]
    else:
        # Group rows of similar total length so padding stays small across chunks.
        order = sorted(range(n), key=lambda i: len(contexts[i]) + len(responses[i]))
        chunks = [order[k : k + rows_per_forward] for k in range(0, n, rows_per_forward)]

    logprobs = torch.zeros((n, max_response), dtype=torch.float32, device=device)
    mask = torch.zeros((n, max_response), dtype=torch.bool, device=device)
    pieces = []
    with torch.set_grad_enabled(grad):
        for rows in chunks:
            chunk_lp, chunk_mask = _forward_chunk(
                model,
                [contexts[i] for i in rows],
                [responses[i] for i in rows],
                pad_token_id,
                temperature,
                device,
            )
            pieces.append((rows, chunk_lp, chunk_mask))
    if len(pieces) == 1:
        _, chunk_lp, chunk_mask = pieces[0]
        return _pad_to(chunk_lp, max_response), _pad_to(chunk_mask, max_response)
    # Scatter back to caller order; index_put keeps the autograd graph.
    for rows, chunk_lp, chunk_mask in pieces:
        index = torch.tensor(rows, device=device)
        logprobs = logprobs.index_put((index,), _pad_to(chunk_lp, max_response))
        mask[index] = _pad_to(chunk_mask, max_response)
    return logprobs, mask


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _forward_chunk(
    model: torch.nn.Module,
    contexts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    temperature: float,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, attention_mask, position_ids, max_response = pad_batch(contexts, responses, pad_token_id)
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device)
    position_ids = position_ids.to(device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=max_response + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -max_response:]
    token_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = token_logits - torch.logsumexp(logits, dim=-1)
    mask = attention_mask[:, -max_response:].bool()
    return logprobs.masked_fill(~mask, 0.0), mask
