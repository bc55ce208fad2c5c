"""Generation with a Hugging Face transformers model: batched, left-padded, CPU or GPU.

A plain decode loop over the model's KV cache rather than `model.generate`, so that the
backend controls exactly what it records (the policy's logprob of each sampled token), seeds
a private RNG (the caller's global torch RNG is untouched), stops each row on its own stop
tokens / strings and drops finished rows from the batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from seeupo_gym.agents.backends.base import FINISH_LENGTH, FINISH_STOP, Completion, SamplingParams, check_prompts
from seeupo_gym.agents.scoring import PER_ROW_MIN_TOKENS

logger = logging.getLogger(__name__)


class HFBackend:
    """`Backend` over a transformers causal LM (a `PeftModel` works too).

    The backend shares the module with the learner when they are the same object, so
    `update_weights` is then a no-op. max_batch_size bounds the rows decoded together
    (None: all prompts of a call at once). prefill_per_row: run each prompt's prefill alone
    and join the KV caches left-padded (None: on CPU when the longest prompt has at least
    `PER_ROW_MIN_TOKENS` tokens; on GPU one padded batch).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int | None = None,
        prefill_per_row: bool | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        # On CPU a left-padded prefill costs ~3x the sum of unpadded ones (the explicit mask
        # leaves sdpa's causal fast path); prefill each prompt alone, then decode together.
        self.prefill_per_row = prefill_per_row
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.default_stop_token_ids = default_stop_token_ids(model, tokenizer)

    # -- Backend -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        check_prompts(prompts)
        if not prompts:
            return []
        generator = torch.Generator(device=self._device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        step = self.max_batch_size or len(prompts)
        was_training = self.model.training
        self.model.eval()  # dropout (e.g. LoRA's) off while sampling
        try:
            completions: list[Completion] = []
            for start in range(0, len(prompts), step):
                completions.extend(self._generate_batch(prompts[start : start + step], sampling, generator))
        finally:
            self.model.train(was_training)
        return completions

    def update_weights(self, state_dict_or_model: Any) -> None:
        source = state_dict_or_model
        if source is self.model or getattr(self.model, "get_base_model", lambda: None)() is source:
            return  # same module as the learner: already up to date
        state_dict = source.state_dict() if isinstance(source, torch.nn.Module) else source
        self.model.load_state_dict(state_dict)

    # -- internals ---------------------------------------------------------------------------

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        device = self._device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        stop_ids = set(sampling.stop_token_ids or self.default_stop_token_ids)
        stop_window = max((len(s) for s in sampling.stop_strings), default=0) + 4
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        active = list(range(n))  # batch row -> prompt index

        per_row = self.prefill_per_row
        if per_row is None:
            per_row = device.type == "cpu" and width >= PER_ROW_MIN_TOKENS
        last_logits, cache = None, None
        if per_row and n > 1:
            last_logits, cache = self._prefill_rows(prompts, width)
        if cache is None:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
            )
            last_logits, cache = out.logits[:, -1, :], out.cache
        next_position = position_ids[:, -1:] + 1
        for _ in range(sampling.max_new_tokens):
            token, token_logprob = sample_next(last_logits, sampling, generator)
            keep = []
            for row, index in enumerate(active):
                token_id = int(token[row])
                tokens[index].append(token_id)
                logprobs[index].append(float(token_logprob[row]))
                if token_id in stop_ids or self._hit_stop_string(tokens[index], sampling.stop_strings, stop_window):
                    finish[index] = FINISH_STOP
                elif len(tokens[index]) >= sampling.max_new_tokens:
                    finish[index] = FINISH_LENGTH
                else:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                keep_index = torch.tensor(keep, device=device)
                _select_cache_rows(cache, keep_index)
                attention_mask = attention_mask[keep_index]
                next_position = next_position[keep_index]
                token = token[keep_index]
                active = [active[row] for row in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            out = self.model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=next_position,
                cache=cache,
                use_cache=True,
            )
            last_logits, cache = out.logits[:, -1, :], out.cache
            next_position = next_position + 1
        return [
            Completion(token_ids=tokens[i], logprobs=logprobs[i], finish_reason=finish[i] or FINISH_LENGTH)
            for i in range(n)
        ]

    def _prefill_rows(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor | None, Any]:
        """Prefill each prompt alone; return the last logits and one left-padded KV cache.

        Returns (None, None) when the cache has layers other than plain full-attention ones
        (sliding windows, linear attention): the caller then runs the padded batch prefill.
        """
        device = self._device
        logits, caches = [], []
        for prompt in prompts:
            out = self.model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
            layers = getattr(out.cache, "layers", None)
            if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
                return None, None
            logits.append(out.logits[:, -1, :])
            caches.append(out.cache)
        joined = caches[0]
        for index, layer in enumerate(joined.layers):
            keys, values = [], []
            for cache, prompt in zip(caches, prompts):
                pad = width - len(prompt)
                row = cache.layers[index]
                # Padded positions are masked out; their zero keys/values are never attended.
                keys.append(torch.nn.functional.pad(row.keys, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(row.values, (0, 0, pad, 0)))
            layer.keys = torch.cat(keys, dim=0)
            layer.values = torch.cat(values, dim=0)
        return torch.cat(logits, dim=0), joined

    def _hit_stop_string(self, tokens: list[int], stop_strings: tuple[str, ...], window: int) -> bool:
        if not stop_strings:
            return False
        tail = self.tokenizer.decode(tokens[-window:])
        return any(s in tail for s in stop_strings)


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its logprob log_softmax(logits / T) (T=1 if greedy)."""
    logits = logits.float()
    if sampling.temperature == 0:
        token = logits.argmax(dim=-1)
        return token, logits.log_softmax(-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    log_normalizer = scaled.logsumexp(-1, keepdim=True)
    probs = (scaled - log_normalizer).exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    # Inverse-CDF sampling: one uniform per row (torch.multinomial draws one per vocabulary
    # entry on CPU, which costs more than the tiny model's whole forward).
    cdf = probs.cumsum(-1)
    uniform = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device)
    token = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)
    token_logprob = (scaled.gather(-1, token.unsqueeze(-1)) - log_normalizer).squeeze(-1)
    return token, token_logprob


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


def _select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only `index` rows of a KV cache (in place)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            layer.batch_select_indices(index)
        return
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(index)
        return
    raise TypeError(f"cannot drop finished rows from a {type(cache).__name__} cache")
