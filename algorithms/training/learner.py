"""The LLM learner: `base.Learner` over a Hugging Face causal LM, driven by accelerate.

Algorithms see the whole step's batch on every process (the trainer gathers it), so their
control flow, their batch-level statistics (advantage normalization over the batch, T_max,
SeeUPO's M factors) and the number of optimizer steps are identical everywhere. The forward
work is what gets split: each call scores a contiguous share of the samples on each process
and all-gathers the detached results, and this process's rows are spliced back in with their
autograd graph. The loss is then the same number on every process, and the gradient of each
process covers its own rows; DDP averages over processes, so `optimize` scales the loss by
the number of processes to get the sum, i.e. exactly the single-process gradient.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch
from torch import nn

from seeupo_gym.agents.scoring import pad_batch, response_logprobs
from seeupo_gym.algorithms.base import TokenLogprobs
from seeupo_gym.algorithms.rollout import TurnSample


class ValueModel(nn.Module):
    """LM backbone + scalar head: V(state before response token j), aligned with logprobs."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        # Start at V = 0 so the first advantages are the plain returns.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state).squeeze(-1).float()


def lm_backbone(model: nn.Module) -> nn.Module:
    """The transformer under an LM head (works through a peft wrapper)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "get_decoder"):
        return inner.get_decoder()
    if hasattr(inner, "base_model") and inner.base_model is not inner:
        return inner.base_model
    raise TypeError(f"cannot find the transformer backbone of {type(inner).__name__} for the value model")


class LLMLearner:
    """Implements `algorithms.base.Learner` for the trainer's (accelerate-prepared) model.

    model: the prepared policy. reference: a frozen copy for full fine-tuning, or None when the
    policy is a peft model (the reference is then the base with the adapter disabled).
    """

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
        forward_batch_size: int = 8,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.pad_token_id = pad_token_id
        self.reference = reference
        self.value_model = value_model
        self.value_optimizer = value_optimizer
        self.max_grad_norm = max_grad_norm
        self.forward_batch_size = forward_batch_size
        if reference is None and not hasattr(accelerator.unwrap_model(model), "disable_adapter"):
            raise ValueError("full fine-tuning needs a frozen reference model (pass `reference=`)")

    # ------------------------------------------------------------------ Learner protocol

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True) -> TokenLogprobs:
        model = self.model if grad else self.accelerator.unwrap_model(self.model)
        return self._sharded(samples, lambda part: self._score(model, part, grad), grad)

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        if self.reference is not None:
            return self._sharded(samples, lambda part: self._score(self.reference, part, False), False)
        policy = self.accelerator.unwrap_model(self.model)
        with policy.disable_adapter():
            return self._sharded(samples, lambda part: self._score(policy, part, False), False)

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        if self.value_model is None:
            raise RuntimeError("this run has no value model; the algorithm must set needs_value_model = True")
        return self._sharded(samples, self._value, True).logprobs

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        if loss.dim() != 0:
            raise ValueError(f"optimize expects a scalar loss, got shape {tuple(loss.shape)}")
        optimizers = [self.optimizer] + ([self.value_optimizer] if self.value_optimizer is not None else [])
        if not torch.isfinite(loss):
            # Same value on every process (see module doc), so all of them skip together.
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            return {"skipped_nonfinite": 1.0}
        self.accelerator.backward(loss * self.accelerator.num_processes)
        metrics = {"grad_norm": self._clip(self.model)}
        if self.value_model is not None:
            metrics["value_grad_norm"] = self._clip(self.value_model)
        if not all(math.isfinite(v) for v in metrics.values()):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            return {**metrics, "skipped_nonfinite": 1.0}
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return metrics

    # ------------------------------------------------------------------ helpers

    def _clip(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.max_grad_norm > 0:
            norm = self.accelerator.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grads = [p.grad.detach().norm() for p in params if p.grad is not None]
            norm = torch.stack(grads).norm() if grads else torch.zeros(())
        return float(norm)

    def _score(self, model: nn.Module, samples: Sequence[TurnSample], grad: bool) -> torch.Tensor:
        logprobs, _ = response_logprobs(
            model,
            [s.turn.context_ids for s in samples],
            [s.turn.response_ids for s in samples],
            pad_token_id=self.pad_token_id,
            grad=grad,
        )
        return logprobs

    def _value(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        input_ids, attention_mask, position_ids, width = pad_batch(
            [s.turn.context_ids for s in samples], [s.turn.response_ids for s in samples], self.pad_token_id
        )
        device = self.accelerator.device
        values = self.value_model(input_ids.to(device), attention_mask.to(device), position_ids.to(device))
        if width == 0:
            return values[:, :0]
        # The state before response token j is the column that predicts it (C - 1 + j).
        values = values[:, -(width + 1) : -1]
        return values.masked_fill(~attention_mask[:, -width:].bool().to(device), 0.0)

    def _sharded(
        self, samples: Sequence[TurnSample], compute: Callable[[Sequence[TurnSample]], torch.Tensor], grad: bool
    ) -> TokenLogprobs:
        samples = list(samples)
        n = len(samples)
        device = self.accelerator.device
        width = max((len(s.turn.response_ids) for s in samples), default=0)
        mask = torch.zeros((n, width), dtype=torch.bool, device=device)
        for i, sample in enumerate(samples):
            mask[i, : len(sample.turn.response_ids)] = True
        if n == 0:
            return TokenLogprobs(torch.zeros((0, 0), device=device), mask)

        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        share = math.ceil(n / world)
        start, end = min(rank * share, n), min((rank + 1) * share, n)
        mine = samples[start:end]
        anchor = None
        with torch.set_grad_enabled(grad):
            local = self._compute_in_pieces(mine, compute, grad, width)
            if not mine and grad:
                # No rows here, but DDP's backward needs every process to have used the model.
                anchor = 0.0 * compute(samples[:1]).sum()
        if world == 1:
            return TokenLogprobs(local, mask)

        padded = torch.zeros((share, width), dtype=torch.float32, device=device)
        padded[: end - start] = local.detach()
        gathered = self.accelerator.gather(padded)[:n]
        if not grad:
            return TokenLogprobs(gathered, mask)
        merged = torch.cat([gathered[:start], local, gathered[end:]], dim=0)
        if anchor is not None:
            merged = merged + anchor
        return TokenLogprobs(merged, mask)

    def _compute_in_pieces(
        self, samples: Sequence[TurnSample], compute: Callable[[Sequence[TurnSample]], torch.Tensor], grad: bool, width: int
    ) -> torch.Tensor:
        device = self.accelerator.device
        if not samples:
            return torch.zeros((0, width), device=device)
        if grad or len(samples) <= self.forward_batch_size:
            # With grad: one forward, a single graph for one backward.
            part = compute(samples)
            return nn.functional.pad(part.float(), (0, width - part.shape[1]))
        # Without grad: bounded pieces of similar length, so little compute goes into padding.
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].turn.context_ids) + len(samples[i].turn.response_ids))
        out = torch.zeros((len(samples), width), device=device)
        for k in range(0, len(order), self.forward_batch_size):
            rows = order[k : k + self.forward_batch_size]
            part = compute([samples[i] for i in rows]).float()
            out[torch.tensor(rows, device=device), : part.shape[1]] = part
        return out


def frozen_copy(model: nn.Module) -> nn.Module:
    """The reference policy for full fine-tuning: a copy that never trains."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference
