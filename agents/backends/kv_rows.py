"""KV caches seen as rows: one row's real positions out of a padded batch, rows into one batch.

A batch cache holds [batch, kv_heads, width, head_dim] per layer with padding wherever the
attention mask is 0 (on the left, or between a cached prefix and the tokens fed after it);
padded positions are masked out, so their contents never matter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from seeupo_gym.agents.backends.prefix_cache import LayerKV

# The name of the KV cache, as forward argument and output field: `past_key_values` up to
# transformers 5.17 at least, `cache` in later 5.x (where `past_key_values` is deprecated, to be
# removed in 5.40). Read from what the installed release's outputs declare, not from its version.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class KVCopies:
    """Bytes of KV the backend itself copied (cutting, joining, stacking rows): a benchmark figure
    (`scripts/bench_generate.py`); the cache's own growth inside the forward is not counted here."""

    bytes: int = 0

    def add(self, layers: list[LayerKV]) -> None:
        self.bytes += sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


KV_COPIES = KVCopies()


class BufferLayer(DynamicLayer):
    """A layer's KV in preallocated buffers [rows, kv_heads, width, head_dim]: a forward writes
    its new positions at column `cursor` (the same for every row) and attends to the whole
    buffer, the 4D mask leaving out padding and columns not written yet. The shape changes only
    when the engine reallocates the buffers (to buckets), not at every step as a growing cache's."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cursor: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.cursor = keys, values, cursor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        n = key_states.shape[-2]
        self.keys[:, :, self.cursor : self.cursor + n].copy_(key_states)
        self.values[:, :, self.cursor : self.cursor + n].copy_(value_states)
        self.cursor += n
        return self.keys, self.values

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.cursor

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.keys.shape[-2], 0


def buffer_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], cursor: int) -> DynamicCache:
    """A cache over these buffers (not copies), the next position written at column `cursor`."""
    cache = DynamicCache()
    cache.layers = [BufferLayer(keys, values, cursor) for keys, values in layers]
    return cache


def attention_backends(device: torch.device, cudnn: bool) -> Any:
    """The scaled-dot-product attention kernels a forward on `device` may use.

    On CUDA without `cudnn`: flash, memory-efficient and math, not cuDNN's attention (torch's
    first choice on sm90), which builds an execution graph for each new shape and caches it per
    thread (docs/performance.md, "Generation on a GPU"). Elsewhere: torch's own choice. torch
    keeps this choice process-wide while the context is open.
    """
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def forward(model: Any, cache: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """`model(**inputs)` continuing `cache` (None: a fresh one): its logits and the grown cache."""
    out = model(**inputs, use_cache=True, **{CACHE_NAME: cache})
    return out.logits, getattr(out, CACHE_NAME)


def plain_layers(cache: Any) -> bool:
    """True when every layer is a plain full-attention `DynamicLayer` (rows can be cut and joined)."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) is DynamicLayer for layer in layers)


def cache_from_layers(layers: list[LayerKV]) -> DynamicCache:
    """A DynamicCache over these very tensors, not copies: it grows by concatenation and never
    writes into them, so a stored prefix can be lent to a forward pass."""
    cache_layers = []
    for keys, values in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache_layers.append(layer)
    cache = DynamicCache()
    cache.layers = cache_layers
    return cache


def row_layers(cache: Any, row: int, attention_mask: torch.Tensor) -> list[LayerKV]:
    """The KV of batch row `row` at its real positions (mask 1), as [1, kv_heads, n, head_dim] copies."""
    columns = attention_mask[row].nonzero().squeeze(-1)
    layers = [
        (layer.keys[row : row + 1].index_select(2, columns), layer.values[row : row + 1].index_select(2, columns))
        for layer in cache.layers
    ]
    KV_COPIES.add(layers)
    return layers


def join_rows(rows: list[list[LayerKV]]) -> tuple[DynamicCache, torch.Tensor]:
    """One left-padded batch cache from per-row KV, and its attention mask [rows, width]."""
    lengths = [row[0][0].shape[-2] for row in rows]
    width = max(lengths)
    layers = []
    for index in range(len(rows[0])):
        keys = [torch.nn.functional.pad(row[index][0], (0, 0, width - n, 0)) for row, n in zip(rows, lengths)]
        values = [torch.nn.functional.pad(row[index][1], (0, 0, width - n, 0)) for row, n in zip(rows, lengths)]
        layers.append((torch.cat(keys, dim=0), torch.cat(values, dim=0)))
    KV_COPIES.add(layers)
    device = rows[0][0][0].device
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    return cache_from_layers(layers), mask


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only `index` rows of a KV cache (in place)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            layer.batch_select_indices(index)
        KV_COPIES.add([(layer.keys, layer.values) for layer in layers])
        return
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(index)
        return
    raise TypeError(f"cannot drop finished rows from a {type(cache).__name__} cache")
