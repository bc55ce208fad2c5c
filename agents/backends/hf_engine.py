"""Continuous batching for `HFBackend`: requests join and leave the decode batch at any step.

The process's one generation thread (`engine.process_thread`) runs the decode loop of every
engine with work, for the life of the process. Each step it admits the requests that arrived
(each prefilled alone past its cached prefix, as `HFBackend` does on CPU), samples one token
for every row, hands finished rows to their futures (and their KV to the prefix cache), and
feeds the rest one step further. A request never waits for another to finish: a short response
returns while a long one still decodes, and the next turn of its episode joins a step later.

The running rows' KV lives in preallocated buffers (`kv_rows.BufferLayer`): every row's
positions end at one shared column, a step writes the next column in place, and a 4D mask
leaves out padding. The buffers' width grows by whole blocks and, on CUDA, their rows are a
power of two and each prefill is padded to a block, so the attention kernels see a bounded set
of shapes (on CUDA, a new shape can cost hundreds of ms of kernel planning, docs/performance.md);
on CPU the rows are exact (a padded row costs as much as a real one there). Results do not depend
on the padding: masked columns and padded rows never reach a real row.

Each request samples from its own generator seeded with `sampling.seed` (on the CPU, one uniform
per row and step; every row's uniforms go to the device in one copy), so what it samples does not
depend on which other requests share its steps. Rows may differ in every sampling parameter
(max_new_tokens, stop tokens and strings, temperature, top_p).

A model whose KV cache cannot be cut into rows and joined (sliding-window or linear-attention
layers), or whose attention is neither sdpa nor eager (the 4D mask), is served one request at a
time instead, with the same samples; a warning says so once.

Not thread-safe against `HFBackend.generate` on the same backend: use one or the other at a
time (the module, its prefix cache and its training mode are shared).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from seeupo_gym.agents.backends.base import FINISH_LENGTH, FINISH_STOP, Completion, SamplingParams, check_prompts
from seeupo_gym.agents.backends.engine import GenerationThread, process_thread
from seeupo_gym.agents.backends.kv_rows import (
    KV_COPIES,
    attention_backends,
    buffer_cache,
    cache_from_layers,
    forward,
    plain_layers,
)

if TYPE_CHECKING:
    from seeupo_gym.agents.backends.hf import HFBackend

logger = logging.getLogger(__name__)

# KV buffer widths are multiples of this many positions.
WIDTH_BLOCK = 64
# On CUDA each prefill feeds a multiple of this many tokens (and reuses a cached prefix cut to one).
PREFILL_BLOCK = 64
WORKERS = ("process", "own", "caller")


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator
    future: "Future[Completion]" = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    start: int = 0  # the buffer column of this row's first position


@dataclass
class _Batch:
    """The running rows: one slot per buffer row (None: free), their next-token logits, KV
    buffers [slots, kv_heads, width, head_dim] per layer, mask [slots, width] and the next column."""

    rows: list[_Request | None]
    logits: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    cursor: int

    @property
    def active(self) -> list[int]:
        return [slot for slot, request in enumerate(self.rows) if request is not None]


class _NotJoinable(Exception):
    """The model's KV cache has layers other than plain full-attention ones."""


class HFEngine:
    """The decode loop of one `HFBackend` as a service: `submit` a prompt, get a future.

    max_batch_size: rows decoded together (default the backend's `max_batch_size`; None: all).
    worker: "process" (the process's one generation thread, the default), "own" (a thread of this
    engine's own, ended by `close`: a diagnosis of per-thread costs) or "caller" (no thread: the
    caller runs `step()` until its futures are done). padded_shapes: rows to a power of two and
    prefills to whole blocks (None: on CUDA). width_block: KV buffer widths are multiples of it
    (1: a new width at every step, as a growing cache has; a diagnosis setting).
    """

    thread_name = "hf-engine"

    def __init__(self, backend: "HFBackend", *, max_batch_size: int | None = None, worker: str = "process",
                 padded_shapes: bool | None = None, width_block: int = WIDTH_BLOCK) -> None:
        if worker not in WORKERS:
            raise ValueError(f"worker must be one of {', '.join(WORKERS)}, got {worker!r}")
        self.backend = backend
        self.max_batch_size = max_batch_size or backend.max_batch_size
        self.worker_kind = worker
        self._worker: GenerationThread | None = {"process": process_thread, "own": GenerationThread}.get(
            worker, lambda: None)()
        self._wake = self._worker.wake if self._worker is not None else threading.Condition()
        self._pending: deque[_Request] = deque()
        self._batch: _Batch | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self.torch_threads = torch.get_num_threads()
        # Figures for benchmarks: batched decode forwards, and the most rows decoded together.
        self.decode_steps = 0
        self.peak_rows = 0
        self._was_training = False  # the module's mode before the current burst of requests
        self._one_at_a_time = False  # set when the model's KV cache cannot be joined row-wise
        cuda = backend._device.type == "cuda"
        self.padded_shapes = cuda if padded_shapes is None else padded_shapes
        if width_block < 1:
            raise ValueError(f"width_block must be >= 1, got {width_block}")
        self.width_block = width_block
        if cuda:
            _warn_unmeasured_on_cuda()

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        check_prompts([prompt])
        generator = torch.Generator()  # on the CPU: a row's draws go to the device with the others'
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
        with self._wake:
            if self._closed:
                raise RuntimeError(f"this {self.thread_name} is closed")
            self._pending.append(request)
            self._idle.clear()
            if self._worker is not None:
                self._worker.schedule(self)
        return request.future

    def close(self, timeout: float | None = None) -> None:
        """Finish the requests in flight (waiting at most `timeout` s); later submits are refused."""
        with self._wake:
            self._closed = True
        if self._worker is None:
            while self.step():
                pass
        elif self.worker_kind == "own":
            self._worker.stop(timeout)
        else:
            self._idle.wait(timeout)

    def has_queued(self) -> bool:
        return bool(self._pending)

    def _went_idle(self) -> None:
        self._idle.set()

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit what arrived, sample one token per row, feed the rows on. False when idle."""
        with self._wake:
            room = len(self._pending)
            running = len(self._batch.active) if self._batch is not None else 0
            if self.max_batch_size is not None:
                room = min(room, self.max_batch_size - running)
            admitted = [self._pending.popleft() for _ in range(max(room, 0))]
        admitted = [r for r in admitted if r.future.set_running_or_notify_cancel()]
        if self._batch is None and not admitted:
            return bool(self._pending)
        model = self.backend.model
        if self._batch is None:
            # Idle -> busy: the weights may have changed since the last burst; dropout off.
            self.backend._forget_stale_prefixes()
            self._was_training = model.training
            model.eval()
        try:
            with torch.no_grad(), attention_backends(self.backend._device, self.backend.cudnn_attention):
                if self._one_at_a_time:
                    self._serve_alone(admitted)
                else:
                    self._iterate(admitted)
        except _NotJoinable as why:
            logger.warning("%s: serving requests one at a time, without continuous batching", why)
            self._one_at_a_time = True
            with torch.no_grad(), attention_backends(self.backend._device, self.backend.cudnn_attention):
                self._serve_alone(admitted)
        except BaseException as error:  # handed to every caller in flight; the engine goes on
            logger.exception("continuous batching step failed")
            model.train(self._was_training)
            running = [r for r in self._batch.rows if r is not None] if self._batch is not None else []
            for request in running + admitted:
                if not request.future.done():
                    request.future.set_exception(error)
            self._batch = None
        return self._batch is not None or bool(self._pending)

    def _iterate(self, admitted: list[_Request]) -> None:
        if admitted:
            self._admit(admitted)
        batch = self._batch
        if batch is None:
            return
        active = batch.active
        self.peak_rows = max(self.peak_rows, len(active))
        token, token_logprob = self._sample(batch, active)
        # One host transfer per step, not one per row (each is a device sync on a GPU).
        token_ids, token_logprobs = token.tolist(), token_logprob.tolist()
        done = []
        for i, slot in enumerate(active):
            request = batch.rows[slot]
            assert request is not None
            token_id = token_ids[i]
            request.tokens.append(token_id)
            request.logprobs.append(token_logprobs[i])
            sampling = request.sampling
            if token_id in request.stop_ids or self.backend._hit_stop_string(
                request.tokens, sampling.stop_strings, max((len(s) for s in sampling.stop_strings), default=0) + 4
            ):
                finish = FINISH_STOP
            elif len(request.tokens) >= sampling.max_new_tokens:
                finish = FINISH_LENGTH
            else:
                continue
            if self.backend.prefix_cache is not None:
                # The cache holds the prompt and every sampled token but the last (never fed).
                layers = [(k[slot : slot + 1, :, request.start : batch.cursor],
                           v[slot : slot + 1, :, request.start : batch.cursor]) for k, v in batch.layers]
                KV_COPIES.add(layers)  # the cache keeps copies of these views
                self.backend._remember(request.prompt + request.tokens[:-1], layers)
            batch.rows[slot] = None
            done.append((request, Completion(list(request.tokens), list(request.logprobs), finish)))
        running = batch.active
        if not running:
            # Idle: give the module back in its own mode before any caller resumes (and trains it).
            self._batch = None
            self.backend.model.train(self._was_training)
        for request, completion in done:
            request.future.set_result(completion)
        if not running:
            return
        if done:
            batch.mask[[slot for slot, row in enumerate(batch.rows) if row is None]] = False
            if self._slots(len(running)) < len(batch.rows):
                batch = self._relayout(batch, running, self._slots(len(running)), batch.cursor - self._first(batch))
        if batch.cursor == batch.mask.shape[1]:
            batch = self._relayout(batch, batch.active, len(batch.rows), batch.cursor - self._first(batch))
        self._feed(batch)

    def _feed(self, batch: _Batch) -> None:
        """One decode forward: each running row's last token at column `cursor`."""
        device = batch.mask.device
        pad = self.backend.pad_token_id
        ids = [r.tokens[-1] if r is not None else pad for r in batch.rows]
        positions = [len(r.prompt) + len(r.tokens) - 1 if r is not None else 0 for r in batch.rows]
        # Free slots attend to their own column only (a row with no column unmasked gives NaN).
        batch.mask[:, batch.cursor] = True
        logits, _ = forward(
            self.backend.model,
            buffer_cache(batch.layers, batch.cursor),
            input_ids=torch.tensor(ids, device=device).unsqueeze(-1),
            attention_mask=self._mask_4d(batch.mask),
            position_ids=torch.tensor(positions, device=device).unsqueeze(-1),
        )
        batch.cursor += 1
        self.decode_steps += 1
        batch.logits = logits[:, -1, :]
        self._batch = batch

    def _mask_4d(self, mask: torch.Tensor) -> torch.Tensor:
        """[slots, 1, 1, width]: what the model's attention takes as given (bool for sdpa, additive for eager)."""
        mask = mask[:, None, None, :]
        if self.backend.model.config._attn_implementation == "eager":
            dtype = self.backend.model.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return mask

    # -- rows in and out -------------------------------------------------------------------------

    def _slots(self, rows: int) -> int:
        """Buffer rows for `rows` requests: a power of two with padded shapes, else exact."""
        if not self.padded_shapes:
            return rows
        return 1 << (rows - 1).bit_length()

    @staticmethod
    def _first(batch: _Batch) -> int:
        starts = [r.start for r in batch.rows if r is not None]
        return min(starts) if starts else batch.cursor

    def _width(self, used: int) -> int:
        """A buffer width for `used` positions: whole blocks, at least one column free."""
        return (used // self.width_block + 1) * self.width_block

    def _relayout(self, batch: _Batch, keep: list[int], slots: int, cursor: int) -> _Batch:
        """New buffers with the `keep` slots on top, their positions ending at column `cursor`."""
        first = self._first(batch)
        used = batch.cursor - first
        width = self._width(cursor)
        device = batch.mask.device
        index = torch.tensor(keep, device=device)
        layers = []
        for k, v in batch.layers:
            new_k = k.new_zeros((slots, k.shape[1], width, k.shape[3]))
            new_v = v.new_zeros((slots, v.shape[1], width, v.shape[3]))
            if keep:
                new_k[: len(keep), :, cursor - used : cursor] = k[index, :, first : batch.cursor]
                new_v[: len(keep), :, cursor - used : cursor] = v[index, :, first : batch.cursor]
            layers.append((new_k, new_v))
        KV_COPIES.add([(k[: len(keep), :, cursor - used : cursor], v[: len(keep), :, cursor - used : cursor])
                       for k, v in layers])
        mask = torch.zeros((slots, width), dtype=torch.bool, device=device)
        logits = batch.logits.new_zeros((slots, batch.logits.shape[-1]))
        if keep:
            mask[: len(keep), cursor - used : cursor] = batch.mask[index, first : batch.cursor]
            logits[: len(keep)] = batch.logits[index]
        rows: list[_Request | None] = [batch.rows[slot] for slot in keep] + [None] * (slots - len(keep))
        for request in rows:
            if request is not None:
                request.start += cursor - batch.cursor
        return _Batch(rows, logits, layers, mask, cursor)

    def _admit(self, admitted: list[_Request]) -> None:
        """Prefill the new requests (past their cached prefixes) and write them into free slots."""
        prefilled = [self._prefill(request) for request in admitted]
        longest = max(layers[0][0].shape[-2] for _, layers in prefilled)
        batch = self._batch
        if batch is None:
            k, v = prefilled[0][1][0]
            slots = self._slots(len(admitted))
            width = self._width(longest)
            batch = _Batch(
                [None] * slots,
                prefilled[0][0].new_zeros((slots, prefilled[0][0].shape[-1])),
                [(k.new_zeros((slots, k.shape[1], width, k.shape[3])),
                  v.new_zeros((slots, v.shape[1], width, v.shape[3]))) for k, v in prefilled[0][1]],
                torch.zeros((slots, width), dtype=torch.bool, device=k.device),
                longest,
            )
        else:
            running = batch.active
            free = len(batch.rows) - len(running)
            if free < len(admitted) or batch.cursor < longest:
                used = batch.cursor - self._first(batch)
                batch = self._relayout(batch, running, max(len(batch.rows), self._slots(len(running) + len(admitted))),
                                       max(used, longest))
        free_slots = [slot for slot, request in enumerate(batch.rows) if request is None]
        for (logits, layers), request, slot in zip(prefilled, admitted, free_slots):
            n = layers[0][0].shape[-2]
            start = batch.cursor - n
            for (k, v), (row_k, row_v) in zip(batch.layers, layers):
                k[slot, :, start : batch.cursor] = row_k[0]
                v[slot, :, start : batch.cursor] = row_v[0]
            KV_COPIES.add(layers)
            batch.mask[slot] = False
            batch.mask[slot, start : batch.cursor] = True
            batch.logits[slot] = logits[0]
            request.start = start
            batch.rows[slot] = request
        self._batch = batch

    def _prefill(self, request: _Request) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One prompt alone past its cached prefix: its last logits [1, vocab] and its KV per layer.

        On CUDA the tokens fed are padded on the right to a whole block (causal attention: the
        padding never reaches them) and the cached prefix is cut to whole blocks, so prefill
        shapes come from a bounded set.
        """
        backend = self.backend
        if backend.model.config._attn_implementation not in ("sdpa", "eager"):
            raise _NotJoinable(f"continuous batching takes sdpa or eager attention, not "
                               f"{backend.model.config._attn_implementation!r}")
        device = backend._device
        prompt = request.prompt
        cached, past = backend._cached_prefix(prompt)
        block = PREFILL_BLOCK if self.padded_shapes else 1
        if cached % block:
            cached -= cached % block
            past = [(k[:, :, :cached], v[:, :, :cached]) for k, v in past] if cached else None
        fed = len(prompt) - cached
        pad = -fed % block
        out_logits, out_cache = forward(
            backend.model,
            cache_from_layers(past) if past is not None else None,
            input_ids=torch.tensor([prompt[cached:] + [backend.pad_token_id] * pad], device=device),
            position_ids=torch.arange(cached, len(prompt) + pad, device=device).unsqueeze(0),
            logits_to_keep=torch.tensor([fed - 1], device=device) if pad else 1,
        )
        if not plain_layers(out_cache):
            if self._batch is not None:
                raise RuntimeError("a model's KV cache changed kind between requests")
            raise _NotJoinable("this model's KV cache cannot be joined row-wise (sliding-window or "
                               "linear-attention layers)")
        layers = [(layer.keys[:, :, : len(prompt)], layer.values[:, :, : len(prompt)]) for layer in out_cache.layers]
        backend._remember(prompt, layers)  # the group's next rollout starts here
        return out_logits[:, -1, :], layers

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

    def _sample(self, batch: _Batch, active: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per running row, each row from its own generator (rows grouped by temperature, top_p)."""
        from seeupo_gym.agents.backends.hf import sample_with_uniform

        device = batch.logits.device
        rows = [batch.rows[slot] for slot in active]
        groups: dict[tuple[float, float], list[int]] = {}
        for i, request in enumerate(rows):
            groups.setdefault((request.sampling.temperature, request.sampling.top_p), []).append(i)
        all_slots = active == list(range(len(batch.rows)))
        if len(groups) == 1:  # the usual case: one pass over every row's logits
            logits = batch.logits if all_slots else batch.logits[torch.tensor(active, device=device)]
            sampling = rows[0].sampling
            return sample_with_uniform(logits, sampling, _uniforms(rows, sampling, device))
        n = len(rows)
        token = torch.empty(n, dtype=torch.long, device=device)
        token_logprob = torch.empty(n, dtype=torch.float32, device=device)
        for members in groups.values():
            sampling = rows[members[0]].sampling
            index = torch.tensor(members, device=device)
            slots = torch.tensor([active[i] for i in members], device=device)
            uniform = _uniforms([rows[i] for i in members], sampling, device)
            picked, picked_logprob = sample_with_uniform(batch.logits[slots], sampling, uniform)
            token[index] = picked
            token_logprob[index] = picked_logprob.float()
        return token, token_logprob


@functools.cache
def _warn_unmeasured_on_cuda() -> None:
    # The fixed cost measured on an H200 before the engine's thread, attention kernels and shapes
    # were changed is not re-measured on a GPU yet (docs/performance.md, "Generation on a GPU").
    logger.warning("HF continuous batching on CUDA is not yet re-measured against plain `generate` since its fix "
                   "for a fixed cost of seconds per collect (docs/performance.md): `bash scripts/gpu_check.sh "
                   "--parts generate` measures it; generation.backend=vllm is the measured GPU path")


def _uniforms(rows: list[_Request], sampling: SamplingParams, device: torch.device) -> torch.Tensor | None:
    """One uniform per row, each from its request's own (CPU) generator, sent to `device` in one
    copy ([n, 1] float64; None when greedy)."""
    if sampling.temperature == 0:
        return None
    draws = torch.cat([torch.rand((1, 1), generator=request.generator, dtype=torch.float64) for request in rows])
    return draws.to(device, non_blocking=True)
