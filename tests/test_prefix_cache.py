"""PrefixCache: longest exact token prefix, never a near miss, LRU within a byte bound."""

from __future__ import annotations

import pytest
import torch

from seeupo_gym.agents.backends import prefix_cache
from seeupo_gym.agents.backends.prefix_cache import PrefixCache

BLOCK = 16


def kv_of(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every position holds its token id, so a served slice shows which tokens it covers."""
    ids = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(ids.expand(1, 2, -1, 4).clone(), -ids.expand(1, 2, -1, 4).clone()) for _ in range(layers)]


def served_ids(layers) -> list[int]:
    return [int(x) for x in layers[0][0][0, 0, :, 0]]


def sequence(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 150_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_serves_the_longest_cached_prefix_cropped_to_the_shared_tokens():
    cache = PrefixCache(1 << 20, block_size=BLOCK)
    stored = sequence(70)
    cache.insert(stored, kv_of(stored))
    prompt = stored[:53] + sequence(30, seed=1)
    length, layers = cache.longest_prefix(prompt)
    assert length == 53
    assert served_ids(layers) == stored[:53]
    assert [tuple(k.shape) for k, _ in layers] == [(1, 2, 53, 4)] * 2
    assert cache.longest_prefix(stored, max_length=len(stored) - 1)[0] == 69
    assert cache.longest_prefix(sequence(40, seed=2)) == (0, None)


def test_never_serves_a_prefix_that_differs_by_one_token():
    cache = PrefixCache(1 << 20, block_size=BLOCK)
    stored = sequence(64)
    cache.insert(stored, kv_of(stored))
    for position in range(64):
        prompt = list(stored)
        prompt[position] = (prompt[position] + 1) % 150_000
        length, layers = cache.longest_prefix(prompt)
        # Up to the changed token when at least a block is left, nothing otherwise.
        assert length == (position if position >= BLOCK else 0)
        assert (layers is None) == (length == 0)
        assert length == 0 or served_ids(layers) == prompt[:length]


def test_a_hash_collision_is_a_miss_not_a_wrong_prefix(monkeypatch):
    # Every sequence with as many blocks gets the same hashes: only the id check can tell them apart.
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda tokens, size: list(range(len(tokens) // size)))
    cache = PrefixCache(1 << 20, block_size=BLOCK)
    stored = sequence(48)
    cache.insert(stored, kv_of(stored))
    assert cache.longest_prefix(sequence(48, seed=5)) == (0, None)
    assert cache.longest_prefix(stored + [1, 2])[0] == 48


def test_stays_within_its_bound_dropping_the_least_recently_used():
    one_entry = sum(k.numel() * 4 + v.numel() * 4 for k, v in kv_of([0] * 32))
    cache = PrefixCache(3 * one_entry, block_size=BLOCK)
    sequences = [sequence(32, seed=s) for s in range(4)]
    for s, tokens in enumerate(sequences):
        cache.insert(tokens, kv_of(tokens))
        if s == 2:
            cache.longest_prefix(sequences[0] + [7])  # the oldest is used again: it stays
        assert cache.nbytes <= cache.max_bytes
    assert cache.peak_bytes <= cache.max_bytes == 3 * one_entry
    assert len(cache) == 3 and cache.tokens == 96
    held = [s for s, tokens in enumerate(sequences) if cache.longest_prefix(tokens + [7])[0] == 32]
    assert held == [0, 2, 3]
    too_large = sequence(200, seed=9)
    cache.insert(too_large, kv_of(too_large))
    assert cache.longest_prefix(too_large + [7]) == (0, None)
    assert cache.nbytes <= cache.max_bytes


def test_a_sequence_replaces_the_cached_prefixes_it_extends():
    cache = PrefixCache(1 << 20, block_size=BLOCK)
    turn_two = sequence(80)
    cache.insert(turn_two[:40], kv_of(turn_two[:40]))
    cache.insert(turn_two, kv_of(turn_two))
    cache.insert(turn_two[:60], kv_of(turn_two[:60]))  # already held inside the longer one
    assert len(cache) == 1 and cache.tokens == 80
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.longest_prefix(turn_two) == (0, None)


def test_served_views_are_never_written_by_the_forward_that_extends_them():
    from seeupo_gym.agents.backends.kv_rows import cache_from_layers

    store = PrefixCache(1 << 20, block_size=BLOCK)
    stored = sequence(40)
    store.insert(stored, kv_of(stored))
    _, layers = store.longest_prefix(stored + [3])
    grown = cache_from_layers(layers)
    grown.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    assert grown.layers[0].keys.shape[-2] == 45
    assert served_ids(store.longest_prefix(stored + [3])[1]) == stored


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(10, block_size=0)
