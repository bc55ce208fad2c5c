"""The frozen trunk: hidden states of the layers below the trainable ones, computed once per trajectory.

When only the last k decoder layers train (LoRA on them, or every layer below them frozen), the
embeddings and the first L - k layers (the trunk) are a fixed function of the tokens: every pass
of a step (old, reference, SeeUPO's pools, the shared ratio pass, GRPO's gradient pass) would
compute the same trunk states again. `TrunkCache` computes them once per trajectory and the
passes run only the layers above, fed with the cached states:

- a sequence whose tokens are a prefix of a cached one (SeeUPO's pool t scores context_t +
  response_t, a prefix of the packed trajectory) reads the first rows of that entry: attention is
  causal and position ids restart per sequence, so a prefix's trunk states are the same numbers,
  up to float rounding (other matmul shapes);
- the reference reads the policy's entries: with LoRA it is the same trunk (adapter disabled,
  and the trunk has no adapter); a frozen copy is used only after checking its trunk weights
  equal the policy's.

Memory: an entry is tokens x hidden x the model's element size (a 2,000-token BFCL trajectory of
the 0.5B model in float32: 2,000 x 896 x 4 B = 7 MiB; Qwen3-14B at the paper's 16k tokens in
bfloat16: 16,384 x 5,120 x 2 B = 160 MiB, 320 MiB in float32, so a process holding 32
trajectories (256 over 8 GPUs) needs 5 GiB). The cache holds at most `budget_bytes` on the model's
device; a trajectory that does not fit is not cached (its trunk is recomputed in each pass, as
without the cache), nothing is spilled to host memory. An entry dies with its trajectory (a weak
reference), so the cache never outlives the batch that filled it.

Processes (DDP): each process caches the sequences of its own share of a pass; a trajectory that a
later pass deals to another process (the pools' prefix lengths plan differently) is computed there
once more. FSDP and DeepSpeed shard the layers: the learner does not use the cache under them.

Gradient checkpointing: the trunk runs without autograd, so it stores no activations and needs no
checkpointing; the layers above keep the model's checkpointing as configured. Packing: a packed
row's sequences read their own entries, concatenated in the row's order; the layers above see
the same position ids (restarting per sequence) as a full forward.

The layers above are run by the model's own forward: for the duration of a pass, the trunk's
first layer returns the cached states and the others pass them through (their `forward` is
replaced on the instance), so masks, rotary embeddings and wrappers (peft, DDP) stay the model's.
Before first use the cache checks, on a probe sequence, that this gives the full forward's
logprobs; a model where it does not (another layer convention) runs without the cache, with a
warning.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from seeupo_gym.agents.scoring import PackedSequence, packed_row

logger = logging.getLogger(__name__)


class _TrunkDone(Exception):
    """Raised by the hook after the trunk's last layer: the layers above are not needed."""


@dataclass
class _Entry:
    tokens: list[int]
    states: torch.Tensor  # [len(tokens), hidden], no autograd


def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(the decoder under the LM head, its layer list), through peft / DDP wrappers; None if unknown."""
    inner = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    types = getattr(getattr(decoder, "config", None), "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return None  # mixed attention kinds (sliding windows): keep to the plain path
    return decoder, layers


def frozen_depth(model: nn.Module) -> int:
    """How many leading decoder layers (with the embeddings) have no trainable parameter: 0 when the
    embeddings train (e.g. tied to a trained LM head) or the structure is unknown."""
    found = decoder_layers(model)
    if found is None:
        return 0
    decoder, layers = found
    embeddings = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    if embeddings is None or any(p.requires_grad for p in embeddings.parameters()):
        return 0
    for depth, layer in enumerate(layers):
        if any(p.requires_grad for p in layer.parameters()):
            return depth
    return 0  # nothing trains in the layers: no layer above to feed


class TrunkCache:
    """Trunk states of the first `depth` layers of `model`'s decoder, by trajectory (see the module doc)."""

    def __init__(self, model: nn.Module, depth: int, budget_bytes: int) -> None:
        found = decoder_layers(model)
        if found is None or depth < 1:
            raise ValueError("TrunkCache needs a decoder with a frozen leading layer (see frozen_depth)")
        self.decoder, self.layers = found
        self.depth = depth
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: dict[int, list[_Entry]] = {}
        self._shared_with: dict[int, bool] = {}
        # Trunk tokens computed, and sequences served from an entry.
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ states

    def states(self, sequences: Sequence[PackedSequence]) -> torch.Tensor:
        """The trunk states of a packed row of `sequences` [1, R, hidden]: cached, or computed (and
        cached while the budget allows). Each sequence's `key` is its trajectory (None: not cached)."""
        pieces: list[torch.Tensor | None] = []
        missing: list[int] = []
        for k, sequence in enumerate(sequences):
            entry = self._lookup(sequence)
            if entry is None:
                pieces.append(None)
                missing.append(k)
            else:
                self.stats["hits"] += 1
                pieces.append(entry.states[: len(sequence.tokens)])
        if missing:
            computed = self._compute([sequences[k] for k in missing])
            for k, states in zip(missing, computed):
                pieces[k] = states
                self._store(sequences[k], states)
        return torch.cat(pieces)[None]  # type: ignore[arg-type]

    def _lookup(self, sequence: PackedSequence) -> _Entry | None:
        if sequence.key is None:
            return None
        n = len(sequence.tokens)
        for entry in self._entries.get(id(sequence.key), ()):
            if len(entry.tokens) >= n and entry.tokens[:n] == sequence.tokens:
                return entry
        return None

    def _store(self, sequence: PackedSequence, states: torch.Tensor) -> None:
        owner = sequence.key
        size = states.numel() * states.element_size()
        if owner is None or self.bytes + size > self.budget_bytes:
            self.stats["not_cached"] += 1
            return
        key = id(owner)
        if key not in self._entries:
            self._entries[key] = []
            # The entry dies with its trajectory: the cache never outlives the batch.
            weakref.finalize(owner, self._drop, key)
        entries = self._entries[key]
        # A longer sequence of the same trajectory replaces the entries it extends.
        kept = [e for e in entries if not (len(e.tokens) <= len(sequence.tokens) and sequence.tokens[: len(e.tokens)] == e.tokens)]
        self.bytes -= sum(e.states.numel() * e.states.element_size() for e in entries if e not in kept)
        kept.append(_Entry(list(sequence.tokens), states))
        self._entries[key] = kept
        self.bytes += size

    def _drop(self, key: int) -> None:
        for entry in self._entries.pop(key, ()):
            self.bytes -= entry.states.numel() * entry.states.element_size()

    @torch.no_grad()
    def _compute(self, sequences: Sequence[PackedSequence]) -> list[torch.Tensor]:
        """One forward of the trunk over `sequences` packed in a row; stops after the trunk's last layer."""
        input_ids, position_ids, _, _ = packed_row(sequences)
        device = next(self.decoder.parameters()).device
        captured: dict[str, torch.Tensor] = {}

        def stop(module: nn.Module, args: tuple, output: Any) -> None:
            captured["states"] = output[0] if isinstance(output, tuple) else output
            raise _TrunkDone

        handle = self.layers[self.depth - 1].register_forward_hook(stop)
        try:
            self.decoder(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False)
        except _TrunkDone:
            pass
        finally:
            handle.remove()
        self.stats["tokens"] += input_ids.shape[1]
        return list(torch.split(captured["states"][0].detach(), [len(s.tokens) for s in sequences]))

    # ------------------------------------------------------------------ the layers above

    @contextlib.contextmanager
    def feeding(self, model: nn.Module, states: torch.Tensor) -> Iterator[None]:
        """Within the block, a forward of `model` (the policy, or a reference with the same trunk) skips
        its trunk: its first layer returns `states`, the next ones pass them on."""
        found = decoder_layers(model)
        if found is None:
            raise ValueError("the model has no decoder layers to feed")
        layers = found[1]
        patched = list(layers[: self.depth])
        layers[0].forward = lambda hidden_states, *args, **kwargs: states.to(hidden_states.dtype)
        for layer in patched[1:]:
            layer.forward = lambda hidden_states, *args, **kwargs: hidden_states
        try:
            yield
        finally:
            for layer in patched:
                del layer.forward

    def shares_trunk(self, model: nn.Module) -> bool:
        """True when `model`'s trunk is this cache's (the same modules, or equal frozen weights)."""
        key = id(model)
        if key not in self._shared_with:
            found = decoder_layers(model)
            same = False
            if found is not None and len(found[1]) > self.depth - 1:
                mine = list(self._trunk_parameters(self.decoder, self.layers))
                theirs = list(self._trunk_parameters(*found))
                same = len(mine) == len(theirs) and all(
                    a is b or (a.shape == b.shape and torch.equal(a, b)) for a, b in zip(mine, theirs)
                )
            self._shared_with[key] = same
        return self._shared_with[key]

    def _trunk_parameters(self, decoder: nn.Module, layers: nn.ModuleList) -> Iterator[torch.Tensor]:
        yield from decoder.get_input_embeddings().parameters()
        for layer in layers[: self.depth]:
            yield from layer.parameters()
