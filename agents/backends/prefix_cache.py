"""A token-keyed, memory-bounded LRU store of KV states, so a prompt prefills only what is new.

An entry is a token sequence and the model's keys/values for exactly those tokens (one row,
every layer). The KV of position i depends only on tokens[: i + 1], so an entry serves any
prompt that starts with some of its tokens: the longest such prefix, cropped. Within an
episode the context of turn t + 1 starts with turn t's context + response; the G rollouts of a
group start with the same prompt.

Lookup goes through chained hashes of fixed-size token blocks (as vLLM's automatic prefix
caching does), then extends token by token inside the entry found. A served prefix is always
compared id by id with the prompt first: a hash collision costs a miss, never a wrong prefix.

Memory: the entries' tensors together stay within `max_bytes`; the least recently used
entries are dropped first. An entry that is a prefix of a newly stored sequence is dropped
(the new one serves everything it served).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Per layer: (keys, values), each [1, kv_heads, tokens, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Entry:
    tokens: list[int]
    layers: list[LayerKV]
    block_hashes: list[int]
    nbytes: int


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: hash i identifies tokens[: (i + 1) * block_size]."""
    hashes = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(previous)
    return hashes


def _common_prefix(a: list[int], b: list[int], start: int, limit: int) -> int:
    """Length of the common prefix of a and b, given that the first `start` ids are equal."""
    n = start
    end = min(len(a), len(b), start + limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    # A view into a larger tensor would keep all of it alive and escape the byte count.
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.contiguous().clone()


class PrefixCache:
    """LRU store of (tokens, KV) entries within `max_bytes`; see the module docstring.

    block_size: granularity of the hash index; prefixes shorter than one block are not served.
    """

    def __init__(self, max_bytes: int, *, block_size: int = 16) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, dict[int, None]] = {}  # block hash -> ids of entries holding that prefix
        self._ids = itertools.count()
        self.nbytes = 0
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def longest_prefix(self, tokens: list[int], *, max_length: int | None = None) -> tuple[int, list[LayerKV] | None]:
        """The longest cached prefix of `tokens` (at most max_length ids): its length and KV (views).

        (0, None) when nothing is cached for these tokens.
        """
        limit = len(tokens) if max_length is None else min(max_length, len(tokens))
        entry_id, length = self._find(tokens, block_hashes(tokens[:limit], self.block_size), limit)
        if entry_id is None or length < self.block_size:
            return 0, None
        entry = self._entries[entry_id]
        if entry.tokens[:length] != tokens[:length]:  # a hash collision: never serve it
            return 0, None
        self._entries.move_to_end(entry_id)
        return length, [(k[:, :, :length], v[:, :, :length]) for k, v in entry.layers]

    def insert(self, tokens: list[int], layers: list[LayerKV]) -> None:
        """Store the KV of `tokens` (each tensor [1, kv_heads, len(tokens), head_dim])."""
        if len(tokens) < self.block_size or self.max_bytes == 0:
            return
        if any(k.shape[-2] != len(tokens) or v.shape[-2] != len(tokens) for k, v in layers):
            raise ValueError(f"KV covers {layers[0][0].shape[-2]} positions, not the {len(tokens)} tokens given")
        hashes = block_hashes(tokens, self.block_size)
        covering, length = self._find(tokens, hashes, len(tokens))
        if covering is not None and length == len(tokens) and self._entries[covering].tokens[:length] == tokens:
            self._entries.move_to_end(covering)  # already held (as this sequence or a longer one)
            return
        for entry_id in self._prefixes_of(tokens, hashes):
            self._remove(entry_id)
        layers = [(_compact(k), _compact(v)) for k, v in layers]
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes:
            return
        while self.nbytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        entry_id = next(self._ids)
        self._entries[entry_id] = _Entry(list(tokens), layers, hashes, nbytes)
        for h in hashes:
            self._index.setdefault(h, {})[entry_id] = None
        self.nbytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def clear(self) -> None:
        """Drop everything (the weights that computed these states changed)."""
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_entries": len(self),
            "prefix_cache_tokens": self.tokens,
            "prefix_cache_bytes": self.nbytes,
            "prefix_cache_peak_bytes": self.peak_bytes,
            "prefix_cache_max_bytes": self.max_bytes,
        }

    # -- internals ---------------------------------------------------------------------------

    def _find(self, tokens: list[int], hashes: list[int], limit: int) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with tokens[:limit] (by block hashes, then ids)."""
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._index:
            depth += 1
        if depth == 0:
            return None, 0
        start = depth * self.block_size
        best_id, best = None, 0
        # The next block matched no entry: each candidate extends by fewer than block_size ids.
        for entry_id in self._index[hashes[depth - 1]]:
            length = _common_prefix(self._entries[entry_id].tokens, tokens, start, min(self.block_size, limit - start))
            if length > best:
                best_id, best = entry_id, length
        return best_id, best

    def _prefixes_of(self, tokens: list[int], hashes: list[int]) -> list[int]:
        """Entries whose whole sequence is a prefix of `tokens`."""
        candidates: dict[int, None] = {}
        for h in hashes:
            ids = self._index.get(h)
            if ids is None:
                break
            candidates.update(ids)
        return [
            entry_id for entry_id in candidates
            if len(self._entries[entry_id].tokens) <= len(tokens)
            and tokens[: len(self._entries[entry_id].tokens)] == self._entries[entry_id].tokens
        ]

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for h in entry.block_hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.pop(entry_id, None)
                if not ids:
                    del self._index[h]
        self.nbytes -= entry.nbytes
