"""Generation with a Hugging Face transformers model: batched, left-padded, CPU or GPU.

A plain decode loop over the model's KV cache rather than `model.generate`, so that the
backend controls exactly what it records (the policy's logprob of each sampled token), seeds
a private RNG (the caller's global torch RNG is untouched), stops each row on its own stop
tokens / strings and drops finished rows from the batch.

Prefix reuse: the backend keeps the KV states of the prompts it prefilled and of the sequences
it finished (prompt + response) in a token-keyed, memory-bounded LRU `PrefixCache`, and a
prompt that starts with a cached sequence prefills only the rest. The API stays stateless:
callers pass whole token sequences. Turn t + 1 of an episode then feeds only the observation
delta after turn t's context + response, and the G rollouts of a group share one prefill of
their prompt. The cache is emptied whenever the weights may have changed (`update_weights`,
or any in-place edit of a parameter, e.g. an optimizer step on the shared module).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from seeupo_gym.agents.backends.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Backend,
    Completion,
    SamplingParams,
    TrainingSetup,
    check_prompts,
)
from seeupo_gym.agents.backends.kv_rows import (
    attention_backends,
    cache_from_layers,
    forward,
    join_rows,
    plain_layers,
    row_layers,
    select_rows,
)
from seeupo_gym.agents.backends.prefix_cache import LayerKV, PrefixCache, block_hashes
from seeupo_gym.agents.scoring import PER_ROW_MIN_TOKENS

logger = logging.getLogger(__name__)

# Default bound of the prefix cache: e.g. ~43k tokens of Qwen2.5-0.5B in fp32 (24 KiB per token).
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


class HFBackend(Backend):
    """`Backend` over a transformers causal LM (a `PeftModel` works too).

    The backend shares the module with the learner when they are the same object, so
    `update_weights` then only empties the prefix cache. max_batch_size bounds the rows decoded
    together (None: all prompts of a call at once). prefill_per_row: run each prompt's prefill
    alone and join the KV caches left-padded (None: on CPU when the longest prompt has at least
    `PER_ROW_MIN_TOKENS` tokens; on GPU one padded batch). prefix_cache_bytes: bound of the
    prefix cache (0 turns prefix reuse off). cudnn_attention: on CUDA, let torch pick cuDNN's
    attention kernel (off: flash, memory-efficient or math; `kv_rows.attention_backends`).
    Sampling draws its uniforms from a CPU generator seeded with `sampling.seed`, so a seed
    samples the same on every device up to the logits' own rounding.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int | None = None,
        prefill_per_row: bool | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        cudnn_attention: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        # On CPU a left-padded prefill costs ~3x the sum of unpadded ones (the explicit mask
        # leaves sdpa's causal fast path); prefill each prompt alone, then decode together.
        self.prefill_per_row = prefill_per_row
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.default_stop_token_ids = default_stop_token_ids(model, tokenizer)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.cudnn_attention = cudnn_attention
        self._weights_seen: int | None = None
        self._engine: Any = None  # the continuous-batching loop behind `submit`, started on first use

    # -- Backend -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        check_prompts(prompts)
        if not prompts:
            return []
        self._forget_stale_prefixes()
        generator = torch.Generator()  # on the CPU: see the class docstring
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        step = self.max_batch_size or len(prompts)
        was_training = self.model.training
        self.model.eval()  # dropout (e.g. LoRA's) off while sampling
        try:
            completions: list[Completion] = []
            with attention_backends(self._device, self.cudnn_attention):
                for start in range(0, len(prompts), step):
                    completions.extend(self._generate_batch(prompts[start : start + step], sampling, generator))
        finally:
            self.model.train(was_training)
        return completions

    @classmethod
    def for_training(cls, model: Any, tokenizer: Any, setup: TrainingSetup) -> "HFBackend":
        # It generates with the very module being trained: a sync only empties its prefix cache.
        return cls(model, tokenizer, prefix_cache_bytes=int(setup.options.get("prefix_cache_mib", 1024)) << 20)

    def overlapped_sampler(self) -> "HFBackend":
        # This backend generates with the very module being trained: the sampler gets a frozen copy.
        import copy

        model = copy.deepcopy(self.model)
        model.requires_grad_(False)
        cache = self.prefix_cache.max_bytes if self.prefix_cache is not None else 0
        return type(self)(model, self.tokenizer, max_batch_size=self.max_batch_size,
                          prefill_per_row=self.prefill_per_row, prefix_cache_bytes=cache,
                          cudnn_attention=self.cudnn_attention)

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        """One request, batched continuously with whatever else is in flight (`hf_engine.HFEngine`);
        `sampling.seed` seeds this request alone."""
        if self._engine is None:
            from seeupo_gym.agents.backends.hf_engine import HFEngine

            self._engine = HFEngine(self)
        return self._engine.submit(prompt, sampling)

    def update_weights(self, state_dict_or_model: Any) -> None:
        # Cached states were computed with the old weights, also when the learner updated this
        # very module in place.
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        source = state_dict_or_model
        if source is self.model or getattr(self.model, "get_base_model", lambda: None)() is source:
            return  # same module as the learner: already up to date
        state_dict = source.state_dict() if isinstance(source, torch.nn.Module) else source
        self.model.load_state_dict(state_dict)

    # -- internals ---------------------------------------------------------------------------

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forget_stale_prefixes(self) -> None:
        """Empty the prefix cache when any parameter was replaced or edited in place since the last call."""
        if self.prefix_cache is None:
            return
        # Every in-place edit (optimizer step, load_state_dict, copy_) bumps a tensor's version.
        seen = hash(tuple((p.data_ptr(), p._version) for p in self.model.parameters()))
        if seen != self._weights_seen:
            self.prefix_cache.clear()
            self._weights_seen = seen

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        device = self._device
        n = len(prompts)
        last_logits, cache, attention_mask = self._prefill(prompts)
        next_position = torch.tensor([[len(p)] for p in prompts], device=device)
        remember = self.prefix_cache is not None and plain_layers(cache)

        stop_ids = set(sampling.stop_token_ids or self.default_stop_token_ids)
        stop_window = max((len(s) for s in sampling.stop_strings), default=0) + 4
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        active = list(range(n))  # batch row -> prompt index
        for _ in range(sampling.max_new_tokens):
            token, token_logprob = sample_next(last_logits, sampling, generator)
            # One host transfer per step, not one per row (each is a device sync on a GPU).
            token_ids, token_logprobs = token.tolist(), token_logprob.tolist()
            keep = []
            for row, index in enumerate(active):
                token_id = token_ids[row]
                tokens[index].append(token_id)
                logprobs[index].append(token_logprobs[row])
                if token_id in stop_ids or self._hit_stop_string(tokens[index], sampling.stop_strings, stop_window):
                    finish[index] = FINISH_STOP
                elif len(tokens[index]) >= sampling.max_new_tokens:
                    finish[index] = FINISH_LENGTH
                else:
                    keep.append(row)
                    continue
                if remember:
                    # The cache holds the prompt and every sampled token but the last (never fed).
                    self._remember(prompts[index] + tokens[index][:-1], row_layers(cache, row, attention_mask))
            if not keep:
                break
            if len(keep) < len(active):
                keep_index = torch.tensor(keep, device=device)
                select_rows(cache, keep_index)
                attention_mask = attention_mask[keep_index]
                next_position = next_position[keep_index]
                token = token[keep_index]
                active = [active[row] for row in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            logits, cache = forward(
                self.model, cache, input_ids=token.unsqueeze(-1), attention_mask=attention_mask, position_ids=next_position
            )
            last_logits = logits[:, -1, :]
            next_position = next_position + 1
        return [
            Completion(token_ids=tokens[i], logprobs=logprobs[i], finish_reason=finish[i] or FINISH_LENGTH)
            for i in range(n)
        ]

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Feed the prompts (past their cached prefixes): last logits, batch KV cache, attention mask."""
        per_row = self.prefill_per_row
        if per_row is None:
            per_row = self._device.type == "cpu" and max(len(p) for p in prompts) >= PER_ROW_MIN_TOKENS
        if per_row:
            result = self._prefill_rows(prompts)
            if result is not None:
                return result
        return self._prefill_batched(prompts)

    def _cached_prefix(self, prompt: list[int]) -> tuple[int, list[LayerKV] | None]:
        if self.prefix_cache is None:
            return 0, None
        # At least the last prompt token is fed: its logits give the first response token.
        return self.prefix_cache.longest_prefix(prompt, max_length=len(prompt) - 1)

    def _remember(self, tokens: list[int], layers: list[LayerKV]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.insert(tokens, layers)

    def _prefill_rows(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Any, torch.Tensor] | None:
        """Prefill each prompt alone, then join the KV caches left-padded.

        Returns None when the cache has layers other than plain full-attention ones (sliding
        windows, linear attention): the caller then runs the padded batch prefill.
        """
        device = self._device
        logits, rows = [], []
        for prompt in prompts:
            cached, past = self._cached_prefix(prompt)
            out_logits, out_cache = forward(
                self.model,
                cache_from_layers(past) if past is not None else None,
                input_ids=torch.tensor([prompt[cached:]], device=device),
                position_ids=torch.arange(cached, len(prompt), device=device).unsqueeze(0),
                logits_to_keep=1,
            )
            if not plain_layers(out_cache):
                return None
            layers = [(layer.keys, layer.values) for layer in out_cache.layers]
            self._remember(prompt, layers)  # the next rollout of the group starts here
            logits.append(out_logits[:, -1, :])
            rows.append(layers)
        cache, attention_mask = join_rows(rows)
        return torch.cat(logits, dim=0), cache, attention_mask

    def _prefill_batched(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Prefill in padded batches; a prompt that shares its first uncached block with an
        earlier prompt of the call waits for the next round, where that prefix is cached."""
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        rows: list[list[LayerKV] | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            now: list[tuple[int, int, list[LayerKV] | None]] = []
            later: list[int] = []
            claimed: set[int] = set()
            for index in pending:
                cached, past = self._cached_prefix(prompts[index])
                claim = self._first_uncached_block(prompts[index], cached)
                if claim is not None and claim in claimed:
                    later.append(index)
                    continue
                if claim is not None:
                    claimed.add(claim)
                now.append((index, cached, past))
            out_logits, cache, attention_mask = self._forward_padded(prompts, now)
            if not later and len(now) == len(prompts):
                if self.prefix_cache is not None and plain_layers(cache):
                    for row, (index, _, _) in enumerate(now):
                        self._remember(prompts[index], row_layers(cache, row, attention_mask))
                return out_logits, cache, attention_mask
            for row, (index, _, _) in enumerate(now):
                logits[index] = out_logits[row : row + 1]
                rows[index] = row_layers(cache, row, attention_mask)
                self._remember(prompts[index], rows[index])
            pending = later
        cache, attention_mask = join_rows(rows)  # type: ignore[arg-type]
        return torch.cat(logits, dim=0), cache, attention_mask  # type: ignore[arg-type]

    def _first_uncached_block(self, prompt: list[int], cached: int) -> int | None:
        """Hash of the prompt up to the end of its first block past the cached prefix (None: no such block)."""
        if self.prefix_cache is None:
            return None
        block = self.prefix_cache.block_size
        hashes = block_hashes(prompt[: (cached // block + 1) * block], block)
        return hashes[-1] if len(hashes) > cached // block else None

    def _forward_padded(
        self, prompts: list[list[int]], rows: list[tuple[int, int, list[LayerKV] | None]]
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward over rows (prompt index, cached length, cached KV): each row's cached
        prefix right-aligned in the past, its remaining tokens right-aligned in the input."""
        device = self._device
        cached_width = max(cached for _, cached, _ in rows)
        new_width = max(len(prompts[index]) - cached for index, cached, _ in rows)
        n = len(rows)
        input_ids = torch.full((n, new_width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, cached_width + new_width), dtype=torch.long)
        position_ids = torch.zeros((n, new_width), dtype=torch.long)
        for row, (index, cached, _) in enumerate(rows):
            prompt = prompts[index]
            fed = len(prompt) - cached
            input_ids[row, new_width - fed :] = torch.tensor(prompt[cached:], dtype=torch.long)
            attention_mask[row, cached_width - cached : cached_width] = 1
            attention_mask[row, cached_width + new_width - fed :] = 1
            position_ids[row, new_width - fed :] = torch.arange(cached, len(prompt))
        past = None
        if cached_width:
            past_rows = [layers for _, _, layers in rows if layers is not None]
            empty = [(k[:, :, :0], v[:, :, :0]) for k, v in past_rows[0]]
            past, _ = join_rows([layers if layers is not None else empty for _, _, layers in rows])
        logits, cache = forward(
            self.model,
            past,
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            logits_to_keep=1,
        )
        return logits[:, -1, :], cache, attention_mask.to(device)

    def _hit_stop_string(self, tokens: list[int], stop_strings: tuple[str, ...], window: int) -> bool:
        if not stop_strings:
            return False
        tail = self.tokenizer.decode(tokens[-window:])
        return any(s in tail for s in stop_strings)


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its logprob log_softmax(logits / T) (T=1 if greedy)."""
    if sampling.temperature == 0:
        return sample_with_uniform(logits, sampling, None)
    # Inverse-CDF sampling: one uniform per row (torch.multinomial draws one per vocabulary
    # entry on CPU, which costs more than the tiny model's whole forward).
    uniform = torch.rand((logits.shape[0], 1), generator=generator, device=generator.device, dtype=torch.float64)
    return sample_with_uniform(logits, sampling, uniform.to(logits.device))


def sample_with_uniform(
    logits: torch.Tensor, sampling: SamplingParams, uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` with the rows' uniforms given ([n, 1] float64; None when greedy)."""
    logits = logits.float()
    if sampling.temperature == 0:
        token = logits.argmax(dim=-1)
        return token, logits.log_softmax(-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    # exp(scaled - max) is the distribution up to its normalizer, which the inverse CDF does not
    # need; one pass over the vocabulary fewer than logsumexp + exp (the sampling cost as much as
    # the tiny model's forward, scripts/bench_generate.py).
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()
    mass = weights.sum(-1, keepdim=True)
    log_normalizer = peak + mass.log()
    if sampling.top_p < 1.0:
        sorted_probs, order = (weights / mass).sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        weights = torch.zeros_like(weights).scatter(-1, order, sorted_probs)
    assert uniform is not None
    token = inverse_cdf(weights, uniform)
    token_logprob = (scaled.gather(-1, token.unsqueeze(-1)) - log_normalizer).squeeze(-1)
    return token, token_logprob


# Vocabulary entries per block of the two-level inverse CDF.
_CDF_BLOCK = 1024


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds uniform x total mass (probs need
    not be normalized).

    In float64 and in two levels (a block of the vocabulary, then a token inside it): a float32
    running sum over a 150k vocabulary carries rounding errors wider than one token's share of
    the mass, so logits that differ in their last bits (a prefix computed in another chunking)
    would often pick a neighbouring token. Entries without mass are never picked. Only block
    sums and the one chosen block are held in float64, never a float64 copy of the vocabulary.
    """
    n, vocab = probs.shape
    full = vocab - vocab % _CDF_BLOCK
    block_mass = probs[:, :full].reshape(n, -1, _CDF_BLOCK).sum(-1, dtype=torch.float64)
    if full < vocab:
        block_mass = torch.cat([block_mass, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    block_cdf = block_mass.cumsum(-1)
    target = uniform.double() * block_cdf[:, -1:]
    block = _first_above(block_mass, block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    columns = block.unsqueeze(-1) * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill(columns >= vocab, 0.0)
    token = _first_above(inside, inside.cumsum(-1), target - before.unsqueeze(-1))
    return block * _CDF_BLOCK + token


def _first_above(mass: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # A target at the very top (rounding) falls on the last entry that has mass.
    last = mass.shape[-1] - 1 - (mass.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(index, last)


def default_stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The model's eos ids (generation config) plus the tokenizer's eos token."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    elif eos:
        ids.extend(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))
