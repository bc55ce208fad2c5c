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

The learner scores at scale with the packed form below: `pack_sequences` merges the turns of a
trajectory whose contexts extend each other into one token sequence (one forward scores all of
its responses), and `packed_logprobs` runs several such sequences as one row, told apart by
position ids that restart at 0 (transformers then masks attention block-diagonally, so no
sequence sees another), with the LM head applied only at response positions, a chunk at a time
(`linear_logprobs`): no full-vocabulary logits for a whole micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch
import torch.utils.checkpoint

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


# --------------------------------------------------------------------------- packed scoring

# Response positions whose logits are materialized at once by `linear_logprobs` (x vocab floats).
LOGIT_CHUNK = 256


class _LinearLogprobs(torch.autograd.Function):
    """`log_softmax((h W^T + b) / T)[target]` per row of h, a chunk of rows at a time in both passes.

    Saves only h, W and the log-normalizers; the backward recomputes each chunk's softmax.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            logits = _scaled(torch.nn.functional.linear(hidden[start : start + chunk], weight, bias), temperature)
            lse[start : start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets[start : start + chunk, None]).squeeze(-1)
            out[start : start + chunk] = picked - lse[start : start + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk]
            logits = _scaled(torch.nn.functional.linear(h, weight, bias), ctx.temperature)
            # d logp[target] / d raw logits = (onehot(target) - softmax) / T
            grad_logits = -torch.exp(logits - lse[start : start + ctx.chunk, None])
            grad_logits.scatter_add_(-1, targets[start : start + ctx.chunk, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits *= grad_out[start : start + ctx.chunk, None] / ctx.temperature
            if need_h:
                grad_h[start : start + ctx.chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += grad_logits.T @ h.float()
            if need_b:
                grad_b += grad_logits.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # float32 first, then the division: the order the backends use for their recorded logprobs.
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def linear_logprobs(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int = LOGIT_CHUNK, temperature: float = 1.0
) -> torch.Tensor:
    """float32 log-probabilities of `targets` [K] under the LM head applied to `hidden` [K, H], with the
    logits divided by `temperature` (the sampling temperature, as the backends record logprobs)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    bias = getattr(head, "bias", None)
    return _LinearLogprobs.apply(hidden, head.weight, bias, targets, chunk, float(temperature))


def linear_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, chunk: int = LOGIT_CHUNK, temperature: float = 1.0
) -> torch.Tensor:
    """float32 entropy of the LM head's distribution (logits / temperature, as verl) at each row of
    `hidden` [K, H], `chunk` rows at a time; with autograd each chunk is recomputed in the backward
    (activation checkpointing), so no more than one chunk's logits exist at once in either pass."""
    bias = getattr(head, "bias", None)

    def entropy(h: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(_scaled(torch.nn.functional.linear(h, head.weight, bias), temperature), dim=-1)
        return -(logp.exp() * logp).sum(-1)

    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        pieces.append(torch.utils.checkpoint.checkpoint(entropy, h, use_reentrant=False) if torch.is_grad_enabled() else entropy(h))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


@dataclass
class PackedSequence:
    """Token ids scored in one piece, and where each of its samples' responses lies in them."""

    tokens: list[int]
    # (index of the sample in the caller's list, start of its response in `tokens`, its length)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    # The key its samples were packed under (the learner's: their trajectory).
    key: Hashable = None


def pack_sequences(
    keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> list[PackedSequence]:
    """Merge the samples of one key (a trajectory), in the given order, into as few sequences as the
    tokens allow: a sample joins the current sequence when that sequence is a prefix of its
    context (token-in/token-out turns), else it starts a new one (e.g. a context rebuilt without
    the earlier reasoning). Samples of different keys never share a sequence."""
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context needs at least one token (the response is predicted from it)")
    open_sequence: dict[Hashable, PackedSequence] = {}
    sequences: list[PackedSequence] = []
    for i, (key, context, response) in enumerate(zip(keys, contexts, responses)):
        current = open_sequence.get(key)
        n = len(current.tokens) if current is not None else 0
        if current is None or len(context) < n or list(context[:n]) != current.tokens:
            current = PackedSequence([], key=key)
            open_sequence[key] = current
            sequences.append(current)
            n = 0
        current.tokens += list(context[n:]) + list(response)
        current.spans.append((i, len(context), len(response)))
    return sequences


def packed_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[PackedSequence],
    *,
    head: torch.nn.Module | None = None,
    chunk: int = LOGIT_CHUNK,
    entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response-token logprobs of `sequences` run as one packed row through `model` (any wrapper
    whose forward reaches the LM head, e.g. DDP / FSDP / peft). Returns the flat float32 logprobs
    `log_softmax(logits / temperature)` of every span, sequence by sequence, span by span, with
    autograd if it is enabled; with entropy=True also the policy's entropy at the same positions
    and temperature (`linear_entropy`).

    The LM head (`head`, default the model's output embeddings) is applied inside the model's
    forward by a pre-hook, only at response positions and `chunk` positions at a time; the
    model's own logits come out empty.
    """
    input_ids, position_ids, index, targets = packed_row(sequences)
    device = next(model.parameters()).device
    if head is None:
        inner = model.module if hasattr(model, "module") else model
        head = inner.get_output_embeddings()
    targets = targets.to(device)
    result: dict[str, torch.Tensor] = {}

    def score_then_skip(module: torch.nn.Module, args: tuple) -> tuple:
        result["logprobs"] = linear_logprobs(args[0][0], module, targets, chunk, temperature)
        if entropy:
            result["entropy"] = linear_entropy(args[0][0], module, chunk, temperature)
        return (args[0][:, :0],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(score_then_skip)
    try:
        model(input_ids=input_ids.to(device), position_ids=position_ids.to(device), logits_to_keep=index.to(device),
              use_cache=False)
    finally:
        handle.remove()
    return (result["logprobs"], result["entropy"]) if entropy else result["logprobs"]


def packed_row(sequences: Sequence[PackedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, R], position_ids [1, R] restarting at 0 per sequence, the positions that predict
    response tokens [K], those tokens [K]) for sequences laid end to end in one row."""
    ids: list[int] = []
    positions: list[int] = []
    index: list[int] = []
    targets: list[int] = []
    for sequence in sequences:
        offset = len(ids)
        ids += sequence.tokens
        positions += range(len(sequence.tokens))
        for _, start, length in sequence.spans:
            index += range(offset + start - 1, offset + start - 1 + length)
            targets += sequence.tokens[start : start + length]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_long(ids)[None], as_long(positions)[None], as_long(index), as_long(targets)
