"""Continuous batching for `HFBackend`: requests join and leave the decode batch at any step.

One worker thread runs the decode loop. Each iteration it admits the requests that arrived
(each prefilled alone past its cached prefix, as `HFBackend` does on CPU, then joined with the
running rows' KV, left-padded), samples one token for every row, hands finished rows to their
futures (and their KV to the prefix cache), and feeds the rest one step further. A request
never waits for another to finish: a short response returns while a long one still decodes,
and the next turn of its episode joins the batch a step later.

Each request samples from its own generator seeded with `sampling.seed`, so what it samples
does not depend on which other requests share its steps. Rows may differ in every sampling
parameter (max_new_tokens, stop tokens and strings, temperature, top_p).

A model whose KV cache cannot be cut into rows and joined (sliding-window or linear-attention
layers) is served one request at a time instead, with the same samples; a warning says so once.

Not thread-safe against `HFBackend.generate` on the same backend: use one or the other at a
time (the module, its prefix cache and its training mode are shared).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from seeupo_gym.agents.backends.base import FINISH_LENGTH, FINISH_STOP, Completion, SamplingParams, check_prompts
from seeupo_gym.agents.backends.engine import EngineThread
from seeupo_gym.agents.backends.kv_rows import (
    KV_COPIES,
    cache_from_layers,
    forward,
    join_rows,
    plain_layers,
    row_layers,
    select_rows,
)

if TYPE_CHECKING:
    from seeupo_gym.agents.backends.hf import HFBackend

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator
    future: "Future[Completion]" = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Batch:
    """The running rows: logits of each row's next token, their KV cache and attention mask."""

    rows: list[_Request]
    logits: torch.Tensor
    cache: Any
    attention_mask: torch.Tensor


class _NotJoinable(Exception):
    """The model's KV cache has layers other than plain full-attention ones."""


class HFEngine(EngineThread):
    """The decode loop of one `HFBackend` as a service: `submit` a prompt, get a future.

    max_batch_size: rows decoded together (default the backend's `max_batch_size`; None: all).
    """

    thread_name = "hf-engine"

    def __init__(self, backend: "HFBackend", *, max_batch_size: int | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.max_batch_size = max_batch_size or backend.max_batch_size
        self._pending: deque[_Request] = deque()
        # Figures for benchmarks: batched decode forwards, and the most rows decoded together.
        self.decode_steps = 0
        self.peak_rows = 0
        self._was_training = False  # the module's mode before the current burst of requests
        self._one_at_a_time = False  # set when the model's KV cache cannot be joined row-wise
        if backend._device.type == "cuda":
            _warn_slow_on_cuda()

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        check_prompts([prompt])
        device = self.backend._device
        generator = torch.Generator(device=device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        request = _Request(
            prompt=list(prompt),
            sampling=sampling,
            stop_ids=set(sampling.stop_token_ids or self.backend.default_stop_token_ids),
            generator=generator,
        )
        self._enqueue(lambda: self._pending.append(request))
        return request.future

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        batch: _Batch | None = None
        while True:
            with self._wake:
                while not self._pending and batch is None and not self._closed:
                    self._wake.wait()
                if batch is None and not self._pending:
                    return  # closed and idle
                room = len(self._pending)
                if self.max_batch_size is not None:
                    room = min(room, self.max_batch_size - (len(batch.rows) if batch else 0))
                admitted = [self._pending.popleft() for _ in range(max(room, 0))]
            admitted = [r for r in admitted if r.future.set_running_or_notify_cancel()]
            model = self.backend.model
            if batch is None and admitted:
                # Idle -> busy: the weights may have changed since the last burst; dropout off.
                self.backend._forget_stale_prefixes()
                self._was_training = model.training
                model.eval()
            try:
                with torch.no_grad():
                    if self._one_at_a_time:
                        self._serve_alone(admitted)
                    else:
                        batch = self._iterate(batch, admitted)
            except _NotJoinable:
                logger.warning("this model's KV cache cannot be joined row-wise (sliding-window or linear-attention "
                               "layers): serving requests one at a time, without continuous batching")
                self._one_at_a_time = True
                with torch.no_grad():
                    self._serve_alone(admitted)
            except BaseException as error:  # handed to every caller in flight; the loop goes on
                logger.exception("continuous batching step failed")
                model.train(self._was_training)
                for request in (batch.rows if batch else []) + admitted:
                    if not request.future.done():
                        request.future.set_exception(error)
                batch = None

    def _iterate(self, batch: _Batch | None, admitted: list[_Request]) -> _Batch | None:
        if admitted:
            batch = self._admit(batch, admitted)
        if batch is None:
            return None
        self.peak_rows = max(self.peak_rows, len(batch.rows))
        token, token_logprob = self._sample(batch)
        # One host transfer per step, not one per row (each is a device sync on a GPU).
        token_ids, token_logprobs = token.tolist(), token_logprob.tolist()
        keep, done = [], []
        for row, request in enumerate(batch.rows):
            token_id = token_ids[row]
            request.tokens.append(token_id)
            request.logprobs.append(token_logprobs[row])
            sampling = request.sampling
            if token_id in request.stop_ids or self.backend._hit_stop_string(
                request.tokens, sampling.stop_strings, max((len(s) for s in sampling.stop_strings), default=0) + 4
            ):
                finish = FINISH_STOP
            elif len(request.tokens) >= sampling.max_new_tokens:
                finish = FINISH_LENGTH
            else:
                keep.append(row)
                continue
            if self.backend.prefix_cache is not None:
                # The cache holds the prompt and every sampled token but the last (never fed).
                self.backend._remember(
                    request.prompt + request.tokens[:-1], row_layers(batch.cache, row, batch.attention_mask)
                )
            done.append((request, Completion(list(request.tokens), list(request.logprobs), finish)))
        if not keep:
            # Idle: give the module back in its own mode before any caller resumes (and trains it).
            self.backend.model.train(self._was_training)
        for request, completion in done:
            request.future.set_result(completion)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            index = torch.tensor(keep, device=batch.attention_mask.device)
            select_rows(batch.cache, index)
            batch.attention_mask = batch.attention_mask[index]
            batch.rows = [batch.rows[row] for row in keep]
            token = token[index]
        device = batch.attention_mask.device
        batch.attention_mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones((len(keep), 1))], dim=1)
        positions = torch.tensor([[len(r.prompt) + len(r.tokens) - 1] for r in batch.rows], device=device)
        logits, batch.cache = forward(
            self.backend.model,
            batch.cache,
            input_ids=token.unsqueeze(-1).to(device),
            attention_mask=batch.attention_mask,
            position_ids=positions,
        )
        self.decode_steps += 1
        batch.logits = logits[:, -1, :]
        return batch

    def _admit(self, batch: _Batch | None, admitted: list[_Request]) -> _Batch:
        """Prefill the new requests (past their cached prefixes) and join them to the running rows."""
        backend = self.backend
        device = backend._device
        logits, rows = [], []
        for request in admitted:
            cached, past = backend._cached_prefix(request.prompt)
            out_logits, out_cache = forward(
                backend.model,
                cache_from_layers(past) if past is not None else None,
                input_ids=torch.tensor([request.prompt[cached:]], device=device),
                position_ids=torch.arange(cached, len(request.prompt), device=device).unsqueeze(0),
                logits_to_keep=1,
            )
            if not plain_layers(out_cache):
                if batch is not None or rows:
                    raise RuntimeError("a model's KV cache changed kind between requests")
                raise _NotJoinable
            layers = [(layer.keys, layer.values) for layer in out_cache.layers]
            backend._remember(request.prompt, layers)  # the group's next rollout starts here
            logits.append(out_logits[:, -1, :])
            rows.append(layers)
        cache, attention_mask = join_rows(rows)
        if batch is None:
            return _Batch(admitted, torch.cat(logits, dim=0), cache, attention_mask)
        cache, attention_mask = _stack(batch.cache, batch.attention_mask, cache, attention_mask)
        return _Batch(batch.rows + admitted, torch.cat([batch.logits] + logits, dim=0), cache, attention_mask)

    def _serve_alone(self, admitted: list[_Request]) -> None:
        """Each request decoded on its own (`HFBackend`'s own loop, same generator, same samples)."""
        model = self.backend.model
        for request in admitted:
            model.eval()
            try:
                (completion,) = self.backend._generate_batch([request.prompt], request.sampling, request.generator)
            except BaseException as error:
                model.train(self._was_training)
                request.future.set_exception(error)
            else:
                model.train(self._was_training)  # before the caller resumes (and maybe trains it)
                request.future.set_result(completion)

    def _sample(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, each row from its own generator (rows grouped by temperature, top_p)."""
        from seeupo_gym.agents.backends.hf import sample_with_uniform

        n = len(batch.rows)
        device = batch.logits.device
        token = torch.empty(n, dtype=torch.long, device=device)
        token_logprob = torch.empty(n, dtype=torch.float32, device=device)
        groups: dict[tuple[float, float], list[int]] = {}
        for row, request in enumerate(batch.rows):
            groups.setdefault((request.sampling.temperature, request.sampling.top_p), []).append(row)
        if len(groups) == 1:  # the usual case: no gather and scatter of the logits
            sampling = batch.rows[0].sampling
            return sample_with_uniform(batch.logits, sampling, _uniforms(batch.rows, sampling, device))
        for rows in groups.values():
            sampling = batch.rows[rows[0]].sampling
            index = torch.tensor(rows, device=device)
            uniform = _uniforms([batch.rows[row] for row in rows], sampling, device)
            picked, picked_logprob = sample_with_uniform(batch.logits[index], sampling, uniform)
            token[index] = picked
            token_logprob[index] = picked_logprob.float()
        return token, token_logprob


@functools.cache
def _warn_slow_on_cuda() -> None:
    # Measured on an H200 (docs/performance.md, "Generation on CPU"): a fixed cost of seconds per round
    # not found yet. Said once per process, with the settings that avoid it.
    logger.warning("HF continuous batching on CUDA ran at 0.04-0.19x plain `generate` on an H200 (cause not "
                   "found yet, docs/performance.md): for GPU rollouts use generation.backend=vllm, or "
                   "env.schedule=lockstep (HFBackend.generate, 1.03x plain generate there)")


def _uniforms(rows: list[_Request], sampling: SamplingParams, device: torch.device) -> torch.Tensor | None:
    """One uniform per row, each from its request's own generator ([n, 1] float64; None when greedy)."""
    if sampling.temperature == 0:
        return None
    return torch.cat([
        torch.rand((1, 1), generator=request.generator, device=device, dtype=torch.float64) for request in rows
    ])


def _stack(cache: Any, mask: torch.Tensor, new_cache: Any, new_mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Two left-padded batch caches as one: the running rows above the new ones.

    Columns no running row attends to any more (left by finished rows) are dropped first; the
    narrower side is then padded on the left. One copy of the running KV, none per row.
    """
    first = int(mask.any(dim=0).nonzero()[0]) if mask.shape[1] else 0
    mask = mask[:, first:]
    width = max(mask.shape[1], new_mask.shape[1])
    pad = torch.nn.functional.pad
    layers = []
    for old_layer, new_layer in zip(cache.layers, new_cache.layers):
        keys = [pad(old_layer.keys[:, :, first:], (0, 0, width - mask.shape[1], 0)), pad(new_layer.keys, (0, 0, width - new_mask.shape[1], 0))]
        values = [pad(old_layer.values[:, :, first:], (0, 0, width - mask.shape[1], 0)), pad(new_layer.values, (0, 0, width - new_mask.shape[1], 0))]
        layers.append((torch.cat(keys, dim=0), torch.cat(values, dim=0)))
    KV_COPIES.add(layers)
    joined_mask = torch.cat([pad(mask, (width - mask.shape[1], 0)), pad(new_mask, (width - new_mask.shape[1], 0))], dim=0)
    return cache_from_layers(layers), joined_mask
