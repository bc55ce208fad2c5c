"""The LLM learner: `base.Learner` over a Hugging Face causal LM, driven by accelerate.

Packing. The samples of a call are merged per trajectory into token sequences
(`scoring.pack_sequences`): when a trajectory's turn contexts extend each other, one sequence
(its longest context + response) scores every turn's response, so a frozen pass or a gradient
pass over whole trajectories feeds each token once. A context that was rebuilt (e.g. earlier
reasoning dropped) starts a new sequence, scored on its own.

Micro-batches. Sequences are cut into micro-batches of at most `max_tokens_per_microbatch`
tokens, each run as one packed row (position ids restart per sequence, attention stays inside
each sequence) and, in `minimize`, backpropagated at once with its share of the minibatch
loss; one optimizer step follows the last. Peak memory follows the budget, not the minibatch.
On CPU long sequences are not packed together (a packed row has a dense block mask and loses
sdpa's causal fast path): a sequence of `PER_ROW_MIN_TOKENS` or more is a micro-batch alone.
A single sequence longer than the budget is a micro-batch alone too.

Processes. Every process holds the whole batch (the trainer gathers it), so every process
computes the same plan: sequences are dealt to processes longest first to the least loaded
(by tokens), then cut into micro-batches, and every process runs the largest count, padding
with a one-token dummy forward (and a zero backward) so that collectives (DDP's gradient
all-reduce, FSDP's all-gathers) match. Frozen passes all-gather their results; the gradients of
a step are summed over processes, so each process scales its shares by the number of
processes (DDP and FSDP average).

Temperature. Every pass (old, reference, gradient) scores `log_softmax(logits / T)` with one
`logprob_temperature` T, the temperature the rollouts were sampled at (verl and TRL divide by the
rollout temperature in every pass): the gradient is then of the distribution that sampled, and the
importance weights of overlapped collection compare like with like. A turn records the temperature
of its sampler's logprobs (`Turn.logprob_temperature`); weights against a turn recorded at another
temperature are refused, and scoring one on-policy at another temperature is logged once, loudly.

Frozen trunk. When only the last layers train (LoRA on them, or the layers below frozen), the
states of the layers below are computed once per trajectory and every pass runs only the layers
above (`trunk.TrunkCache`, `trunk_cache_mib`); not under FSDP or DeepSpeed, which shard the layers.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from seeupo_gym.agents.scoring import (
    LOGIT_CHUNK,
    PER_ROW_MIN_TOKENS,
    PackedSequence,
    pack_sequences,
    packed_logprobs,
    packed_row,
)
from seeupo_gym.algorithms.base import MicroLoss, TokenLogprobs, loss_share
from seeupo_gym.algorithms.rollout import TurnSample
from seeupo_gym.training.trunk import TrunkCache, frozen_depth

logger = logging.getLogger(__name__)
# One forward of `sequences` -> flat scores of their spans (see `packed_logprobs`).
RowScorer = Callable[[Sequence[PackedSequence]], torch.Tensor]


class ValueModel(nn.Module):
    """LM backbone + scalar head: V(state before response token j), aligned with logprobs."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        # Start at V = 0 so the first advantages are the plain returns.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Values at the row positions `index` of one packed row (position ids restart per sequence)."""
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state[0, index]).squeeze(-1).float()


def lm_backbone(model: nn.Module) -> nn.Module:
    """The transformer under an LM head (works through a peft wrapper)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "get_decoder"):
        return inner.get_decoder()
    if hasattr(inner, "base_model") and inner.base_model is not inner:
        return inner.base_model
    raise TypeError(f"cannot find the transformer backbone of {type(inner).__name__} for the value model")


def plan_microbatches(lengths: Sequence[int], budget: int, processes: int, pack_limit: int | None = None) -> list[list[list[int]]]:
    """Deal sequences (by their token counts) to processes and cut each share into micro-batches.

    Returns plan[process][k] = the sequence indices of micro-batch k; every process gets the same
    number of micro-batches (trailing ones may be empty). Longest first to the least-loaded process
    balances tokens; first-fit keeps each micro-batch under `budget` tokens, or under `pack_limit`
    for sequences packed together (a longer sequence is a micro-batch alone).
    """
    pack_limit = budget if pack_limit is None else min(pack_limit, budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads, shares = [0] * processes, [[] for _ in range(processes)]
    for i in order:
        p = min(range(processes), key=lambda q: (loads[q], q))
        shares[p].append(i)
        loads[p] += lengths[i]
    plan = []
    for share in shares:
        bins: list[list[int]] = []
        room: list[int] = []
        for i in share:
            fits = next((b for b in range(len(bins)) if lengths[i] <= room[b]), None)
            if fits is None:
                bins.append([i])
                room.append(pack_limit - lengths[i] if lengths[i] < pack_limit else -1)
            else:
                bins[fits].append(i)
                room[fits] -= lengths[i]
        plan.append(bins)
    count = max(len(bins) for bins in plan)
    return [bins + [[] for _ in range(count - len(bins))] for bins in plan]


class LLMLearner:
    """Implements `algorithms.base.Learner` for the trainer's (accelerate-prepared) model.

    model: the prepared policy. reference: a frozen copy for full fine-tuning, or None when the
    policy is a peft model (the reference is then the base with the adapter disabled).
    max_tokens_per_microbatch: tokens fed per forward (and per backward); bounds activation memory.
    pack_limit: pack sequences into one row only up to this many tokens (None: the budget on GPU,
    `PER_ROW_MIN_TOKENS` on CPU, see the module doc).
    logprob_temperature: T of every pass's log_softmax(logits / T): the sampling temperature (1 for
    greedy sampling).
    trunk_cache_mib: bound of the frozen-trunk cache (used only when the leading layers are frozen;
    0: off).
    """

    # A packed sequence is never cut across micro-batches and `minimize` sums every part's diagnostics
    # over processes: SeeUPO may measure its ratios inside a gradient pass (`base.Learner`).
    measures_alongside = True

    def __init__(
        self,
        accelerator,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        pad_token_id: int,
        reference: nn.Module | None = None,
        value_model: nn.Module | None = None,
        value_optimizer: torch.optim.Optimizer | None = None,
        max_grad_norm: float = 1.0,
        max_tokens_per_microbatch: int = 8192,
        pack_limit: int | None = None,
        logit_chunk: int = LOGIT_CHUNK,
        logprob_temperature: float = 1.0,
        trunk_cache_mib: int = 2048,
    ) -> None:
        if max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
        if not logprob_temperature > 0:
            raise ValueError(f"logprob_temperature must be > 0, got {logprob_temperature}")
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.pad_token_id = pad_token_id
        self.reference = reference
        self.value_model = value_model
        self.value_optimizer = value_optimizer
        self.max_grad_norm = max_grad_norm
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        if pack_limit is None:
            pack_limit = max_tokens_per_microbatch if accelerator.device.type == "cuda" else PER_ROW_MIN_TOKENS
        self.pack_limit = pack_limit
        self.logit_chunk = logit_chunk
        self.logprob_temperature = float(logprob_temperature)
        self._warned_temperature = False
        # Set (to the cap) when rollouts may come from older weights than these (train.max_staleness > 0):
        # the losses then see the sampler's logprobs and apply a truncated importance weight.
        self.behaviour_cap: float | None = None
        # Tokens this process fed to each model ("policy", "reference", "value"), dummies excluded.
        self.tokens_fed: Counter[str] = Counter()
        # Two pad tokens, the second scored: the forward that keeps processes in step.
        self._dummy = [PackedSequence([pad_token_id, pad_token_id], [(0, 1, 1)])]
        if reference is None and not hasattr(accelerator.unwrap_model(model), "disable_adapter"):
            raise ValueError("full fine-tuning needs a frozen reference model (pass `reference=`)")
        self.trunk = self._trunk_cache(trunk_cache_mib)

    # ------------------------------------------------------------------ Learner protocol

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True) -> TokenLogprobs:
        self._check_temperature(samples)
        if grad:
            # The simple path: one graph over every sample, computed whole on every process.
            rows = self._local_rows(samples, self._scorer(self.model, "policy"))
            return self._as_tokens(samples, rows)
        return self._frozen(samples, self._scorer(self.accelerator.unwrap_model(self.model), "policy"))

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        self._check_temperature(samples)
        if self.reference is not None:
            return self._frozen(samples, self._scorer(self.reference, "reference"))
        policy = self.accelerator.unwrap_model(self.model)
        with policy.disable_adapter():
            return self._frozen(samples, self._scorer(policy, "reference"))

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        if self.value_model is None:
            raise RuntimeError("this run has no value model; the algorithm must set needs_value_model = True")
        if torch.is_grad_enabled():
            return self._as_tokens(samples, self._local_rows(samples, self._value_scorer(self.value_model))).logprobs
        return self._frozen(samples, self._value_scorer(self.accelerator.unwrap_model(self.value_model))).logprobs

    def minimize(
        self, samples: Sequence[TurnSample], loss: MicroLoss, *, values: bool = False, entropy: bool = False
    ) -> dict[str, float]:
        samples = list(samples)
        if values and self.value_model is None:
            raise RuntimeError("this run has no value model; the algorithm must set needs_value_model = True")
        self._check_temperature(samples)
        world = self.accelerator.num_processes
        sequences = self._pack(samples)
        plan = self._plan(sequences)[self.accelerator.process_index]
        policy, critic = self._scorer(self.model, "policy", entropy), self._value_scorer(self.value_model) if values else None
        stats: Counter[str] = Counter()
        finite = True
        for k, micro in enumerate(plan):
            last = k == len(plan) - 1
            with self._no_sync(not last):
                if not micro:
                    self._dummy_backward(policy, critic)
                    continue
                part_sequences = [sequences[i] for i in micro]
                indices = [i for sequence in part_sequences for i, _, _ in sequence.spans]
                part = [samples[i] for i in indices]
                scored = policy(part_sequences)
                if entropy:  # (logprobs, entropy), both flat over the spans
                    scored, token_entropy = scored
                new = self._as_tokens(part, self._split(part_sequences, scored, indices))
                if entropy:
                    new.entropy = self._as_tokens(part, self._split(part_sequences, token_entropy, indices)).logprobs
                if self.behaviour_cap is not None:
                    new = self._with_sampled(part, new)
                value_rows = None
                if critic is not None:
                    value_rows = self._as_tokens(part, self._split(part_sequences, critic(part_sequences), indices)).logprobs
                share, part_stats = loss_share(loss(part, new, value_rows))
                if share.dim() != 0:
                    raise ValueError(f"a MicroLoss must return a scalar share, got shape {tuple(share.shape)}")
                finite = finite and bool(torch.isfinite(share.detach()))
                # DDP and FSDP average gradients over processes; the step needs their sum.
                self.accelerator.backward(share * world)
                stats.update(part_stats)
        stats, finite = self._reduce_stats(stats, finite)
        return {**stats, **self._step(finite)}

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        if loss.dim() != 0:
            raise ValueError(f"optimize expects a scalar loss, got shape {tuple(loss.shape)}")
        if not torch.isfinite(loss):
            # Same value on every process (each computed the whole loss), so all of them skip together.
            self._zero_grad()
            return {"skipped_nonfinite": 1.0}
        self.accelerator.backward(loss)
        return self._step(True)

    # ------------------------------------------------------------------ packing and planning

    def _pack(self, samples: Sequence[TurnSample]) -> list[PackedSequence]:
        # Turns in order within each trajectory, so that later turns extend earlier ones.
        order = sorted(range(len(samples)), key=lambda i: (samples[i].rollout_id, samples[i].t))
        sequences = pack_sequences(
            [samples[i].rollout_id for i in order],
            [samples[i].turn.context_ids for i in order],
            [samples[i].turn.response_ids for i in order],
        )
        for sequence in sequences:
            sequence.spans = [(order[i], start, length) for i, start, length in sequence.spans]
            # The trajectory object keys the trunk cache (an entry lives as long as it does).
            sequence.key = samples[sequence.spans[0][0]].trajectory
        return sequences

    def _plan(self, sequences: Sequence[PackedSequence]) -> list[list[list[int]]]:
        lengths = [len(s.tokens) for s in sequences]
        return plan_microbatches(lengths, self.max_tokens_per_microbatch, self.accelerator.num_processes, self.pack_limit)

    # ------------------------------------------------------------------ forwards

    def _scorer(self, model: nn.Module, name: str, entropy: bool = False) -> RowScorer:
        trunk = self.trunk if self.trunk is not None and self.trunk.shares_trunk(model) else None

        def score(sequences: Sequence[PackedSequence]) -> torch.Tensor:
            # The dummy forward keeps processes in step; it needs no entropy.
            with_entropy = entropy and sequences is not self._dummy

            def run() -> torch.Tensor:
                return packed_logprobs(model, sequences, chunk=self.logit_chunk, entropy=with_entropy,
                                       temperature=self.logprob_temperature)

            if sequences is self._dummy:
                return run()
            self.tokens_fed[name] += sum(len(s.tokens) for s in sequences)
            if trunk is None:
                return run()
            with trunk.feeding(model, trunk.states(sequences)):
                return run()

        return score

    def _trunk_cache(self, budget_mib: int) -> TrunkCache | None:
        """The frozen-trunk cache when the model's leading layers are frozen and the probe agrees."""
        from accelerate.utils import DistributedType

        sharded = self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        policy = self.accelerator.unwrap_model(self.model)
        depth = frozen_depth(policy)
        if budget_mib <= 0 or sharded or depth == 0:
            return None
        cache = TrunkCache(policy, depth, budget_mib << 20)
        # Probe: the layers above fed the cached states must give the full forward's logprobs.
        probe = [PackedSequence(list(range(1, 9)), [(0, 4, 4)])]
        try:
            with torch.no_grad():
                full = packed_logprobs(policy, probe, chunk=self.logit_chunk)
                with cache.feeding(policy, cache.states(probe)):
                    fed = packed_logprobs(policy, probe, chunk=self.logit_chunk)
            agrees = bool(torch.allclose(full, fed, atol=1e-4, rtol=0))
        except Exception as error:  # a model whose layers follow another convention
            logger.warning("frozen-trunk cache off: probing the model failed (%s)", error)
            return None
        if not agrees:
            logger.warning("frozen-trunk cache off: feeding the cached trunk states does not reproduce the full "
                           "forward for %s", type(policy).__name__)
            return None
        cache.stats.clear()
        return cache

    def _value_scorer(self, model: nn.Module | None) -> RowScorer | None:
        if model is None:
            return None

        def score(sequences: Sequence[PackedSequence]) -> torch.Tensor:
            if sequences is not self._dummy:
                self.tokens_fed["value"] += sum(len(s.tokens) for s in sequences)
            input_ids, position_ids, index, _ = packed_row(sequences)
            device = self.accelerator.device
            return model(input_ids.to(device), position_ids.to(device), index.to(device))

        return score

    def _dummy_backward(self, policy: RowScorer, critic: RowScorer | None) -> None:
        # A token's score times 0: the collectives of a real micro-batch, no gradient.
        total = policy(self._dummy).sum() * 0.0
        if critic is not None:
            total = total + critic(self._dummy).sum() * 0.0
        self.accelerator.backward(total)

    def _split(
        self, sequences: Sequence[PackedSequence], flat: torch.Tensor, indices: Sequence[int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Flat span scores -> {sample index: its response-token row}; with `indices`, keyed by position
        in `indices` instead (a micro-batch's own numbering)."""
        spans = [span for sequence in sequences for span in sequence.spans]
        rows = torch.split(flat, [length for _, _, length in spans])
        by_sample = {i: row for (i, _, _), row in zip(spans, rows)}
        return by_sample if indices is None else {j: by_sample[i] for j, i in enumerate(indices)}

    def _local_rows(self, samples: Sequence[TurnSample], score: RowScorer) -> dict[int, torch.Tensor]:
        sequences = self._pack(samples)
        out: dict[int, torch.Tensor] = {}
        for micro in self._plan_local(sequences):
            part = [sequences[i] for i in micro]
            out.update(self._split(part, score(part)))
        return out

    def _plan_local(self, sequences: Sequence[PackedSequence]) -> list[list[int]]:
        lengths = [len(s.tokens) for s in sequences]
        return [m for m in plan_microbatches(lengths, self.max_tokens_per_microbatch, 1, self.pack_limit)[0] if m]

    def _frozen(self, samples: Sequence[TurnSample], score: RowScorer) -> TokenLogprobs:
        """A no-grad pass: this process scores its share of the plan, then everyone gathers everything."""
        samples = list(samples)
        sequences = self._pack(samples)
        plans = self._plan(sequences)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for micro in plans[rank]:
                if micro:
                    part = [sequences[i] for i in micro]
                    rows.update(self._split(part, score(part).float()))
                elif world > 1:
                    score(self._dummy)  # keeps FSDP's all-gathers in step
        if world > 1:
            rows = self._gather_rows(sequences, plans, rows)
        return self._as_tokens(samples, rows)

    def _gather_rows(self, sequences, plans, mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        device = self.accelerator.device

        def spans_of(p: int) -> list[tuple[int, int, int]]:
            return [span for micro in plans[p] for i in micro for span in sequences[i].spans]

        sizes = [sum(length for _, _, length in spans_of(p)) for p in range(len(plans))]
        width = max(max(sizes), 1)
        rank = self.accelerator.process_index
        flat = torch.zeros(width, device=device)
        local = [mine[i] for i, _, _ in spans_of(rank)]
        if local:
            joined = torch.cat(local)
            flat[: joined.numel()] = joined
        gathered = self.accelerator.gather(flat).view(len(plans), width)
        rows: dict[int, torch.Tensor] = {}
        for p in range(len(plans)):
            spans = spans_of(p)
            pieces = torch.split(gathered[p, : sizes[p]], [length for _, _, length in spans])
            rows.update({i: piece for (i, _, _), piece in zip(spans, pieces)})
        return rows

    def _as_tokens(self, samples: Sequence[TurnSample], rows: dict[int, torch.Tensor]) -> TokenLogprobs:
        """Rows by sample index -> right-padded [n, L] in `samples`' order (the autograd graph kept)."""
        device = self.accelerator.device
        lengths = [s.turn.num_response_tokens for s in samples]
        width = max(lengths, default=0)
        mask = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device, dtype=torch.long)[:, None]
        if not samples or width == 0:
            return TokenLogprobs(torch.zeros((len(samples), width), device=device), mask)
        ordered = [rows[i] if lengths[i] else torch.zeros(0, device=device) for i in range(len(samples))]
        padded = nn.utils.rnn.pad_sequence(ordered, batch_first=True)
        if padded.shape[1] < width:
            padded = nn.functional.pad(padded, (0, width - padded.shape[1]))
        return TokenLogprobs(padded, mask)

    def _check_temperature(self, samples: Sequence[TurnSample]) -> None:
        """Refuse importance weights against logprobs recorded at another temperature; say once, loudly,
        when on-policy turns are scored at another temperature than the one that sampled them."""
        recorded = {s.turn.logprob_temperature for s in samples} - {None}
        other = sorted(t for t in recorded if not math.isclose(t, self.logprob_temperature, rel_tol=1e-6))
        if not other:
            return
        message = (f"turns sampled at temperature {other} are scored at logprob_temperature "
                   f"{self.logprob_temperature}")
        if self.behaviour_cap is not None:
            raise ValueError(f"{message}: the importance weights would compare two distributions; set "
                             "train.logprob_temperature to the sampling temperature")
        if not self._warned_temperature:
            self._warned_temperature = True
            logger.warning("%s: the update follows the gradient of another distribution than the one sampled", message)

    def _with_sampled(self, samples: Sequence[TurnSample], new: TokenLogprobs) -> TokenLogprobs:
        """`new` with the sampler's logprobs of the same tokens (for the importance weights)."""
        rows = [torch.tensor(s.turn.sample_logprobs, dtype=new.logprobs.dtype) for s in samples]
        sampled = torch.zeros_like(new.logprobs)
        for i, row in enumerate(rows):
            sampled[i, : row.numel()] = row.to(sampled.device)
        return TokenLogprobs(new.logprobs, new.mask, sampled=sampled, sampled_cap=float(self.behaviour_cap), entropy=new.entropy)

    # ------------------------------------------------------------------ the step

    def _no_sync(self, skip: bool):
        if not skip or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for module in self._trained():
            stack.enter_context(self.accelerator.no_sync(module))
        return stack

    def _trained(self) -> Iterator[nn.Module]:
        yield self.model
        if self.value_model is not None:
            yield self.value_model

    def _reduce_stats(self, stats: Counter[str], finite: bool) -> tuple[dict[str, float], bool]:
        if self.accelerator.num_processes == 1:
            return dict(stats), finite
        from accelerate.utils import gather_object

        everyone = gather_object([(dict(stats), finite)])
        total: Counter[str] = Counter()
        for part, _ in everyone:
            total.update(part)
        return dict(total), all(ok for _, ok in everyone)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)

    def _step(self, finite: bool) -> dict[str, float]:
        metrics = {"grad_norm": self._clip(self.model)}
        if self.value_model is not None:
            metrics["value_grad_norm"] = self._clip(self.value_model)
        if not finite or not all(math.isfinite(v) for v in metrics.values()):
            self._zero_grad()
            return {**metrics, "skipped_nonfinite": 1.0}
        # A model with no gradient (all advantages 0 and no KL) is not stepped: AdamW would still
        # move it on its momentum and weight decay. The norms are all-reduced: every process agrees.
        norms = [metrics["grad_norm"], metrics.get("value_grad_norm")]
        for optimizer, norm in zip((self.optimizer, self.value_optimizer), norms):
            if optimizer is not None and norm > 0:
                optimizer.step()
        self._zero_grad()
        if not any(norm for norm in norms if norm is not None):
            metrics["skipped_no_gradient"] = 1.0
        return metrics

    def _clip(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.max_grad_norm > 0:
            norm = self.accelerator.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grads = [p.grad.detach().norm() for p in params if p.grad is not None]
            norm = torch.stack(grads).norm() if grads else torch.zeros(())
        return float(norm)


def frozen_copy(model: nn.Module) -> nn.Module:
    """The reference policy for full fine-tuning: a copy that never trains."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference
