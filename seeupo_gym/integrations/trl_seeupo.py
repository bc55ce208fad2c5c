"""SeeUPO in TRL: `SeeUPOTrainer`, a `trl.GRPOTrainer` whose update is the kit's `SeeUPO.update`.

    from seeupo_gym.integrations.trl import SeeUPOConfig, SeeUPOTrainer, make

    args = SeeUPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=8, ...)
    trainer = SeeUPOTrainer(model="Qwen/Qwen3-0.6B", args=args, **make("seeupo/TurnBandit-v0"))
    trainer.train()

GRPOTrainer generates, runs the tools (`environment_factory`) and scores as always. Then, instead of
GRPO's loss, one training step is SeeUPO's (algorithms/seeupo.py, the same code our own trainer runs):
each completion becomes a trajectory whose turns are the runs of model tokens in TRL's tool mask
(the assistant generations between tool results), the group rewards give batch-normalized GRAE
advantages, and the turn pools are updated in order (reverse by default), one optimizer step each,
with SeeUPO's loss and `M`, the ratios of each pool after its update going into `M`.

The kit talks to TRL's model through `TRLLearner` (the kit's `Learner` protocol). HF's Trainer takes one
optimizer step after `training_step`: the learner therefore takes a pool's step lazily, just before
the next pool is scored, and leaves the last pool's gradients to the Trainer's own clip + step, so
the lr scheduler, gradient clipping, logging and checkpoints stay the Trainer's. All pools of a step
run at that step's learning rate (the scheduler counts training steps, not pools).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from trl import GRPOConfig, GRPOTrainer

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import MicroLoss, TokenLogprobs, loss_share
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn, TurnSample
from seeupo_gym.algorithms.seeupo import ORDERS, OLD_POLICIES, SeeUPO
from seeupo_gym.algorithms.seeupo import SeeUPOConfig as KitSeeUPOConfig


@dataclass
class SeeUPOConfig(GRPOConfig):
    """GRPOConfig plus SeeUPO's options (paper defaults). Clipping is GRPOConfig's `epsilon` /
    `epsilon_high` (0.2 / 0.2) and the KL coefficient its `beta` (here 0.002, the paper's; 0 = off)."""

    beta: float = field(default=0.002, metadata={"help": "SeeUPO's KL-to-reference coefficient (the paper's 0.002; 0: off)."})
    seeupo_order: str = field(default="reverse", metadata={"help": f"Turn pool update order: one of {ORDERS}."})
    seeupo_normalization: str = field(default="batch", metadata={"help": "GRAE normalization of M: none | group | batch."})
    seeupo_m_clip: list[float] | None = field(
        default=None, metadata={"help": "[low, high] clip of M's ratio product (the authors' code: [0.8, 1.2]); none: off."})
    seeupo_old_policy: str = field(
        default="step_start", metadata={"help": f"Ratio anchor: one of {OLD_POLICIES} (step_start: the paper)."})
    seeupo_kl_estimator: str = field(default="low_var_kl", metadata={"help": "KL estimator: k1 | k2 | k3 | low_var_kl."})

    def __post_init__(self) -> None:
        super().__post_init__()
        kit_config(self)  # refuse bad SeeUPO options at construction, one line each
        if self.num_iterations != 1:
            raise ValueError(f"SeeUPOTrainer: num_iterations must be 1 (SeeUPO updates each pool once), got {self.num_iterations}")
        if self.steps_per_generation != 1 or self.gradient_accumulation_steps != 1:
            raise ValueError("SeeUPOTrainer updates a whole generation batch in one training step: set "
                             "gradient_accumulation_steps=1 and steps_per_generation=1 (batch size via per_device_train_batch_size)")
        if self.use_liger_kernel:
            raise ValueError("SeeUPOTrainer: use_liger_kernel computes GRPO's loss; SeeUPO's is the kit's, turn it off")


def kit_config(args: SeeUPOConfig) -> KitSeeUPOConfig:
    """The kit's SeeUPO config for these TRL arguments: one optimizer step per turn pool."""
    return KitSeeUPOConfig(
        normalization=args.seeupo_normalization,
        order=args.seeupo_order,
        old_policy=args.seeupo_old_policy,
        m_clip=tuple(args.seeupo_m_clip) if args.seeupo_m_clip is not None else None,
        clip_low=args.epsilon,
        clip_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        kl_coef=args.beta,
        kl_estimator=args.seeupo_kl_estimator,
        epochs=1,
        minibatch_size=1 << 30,  # a pool is one minibatch: one optimizer step
    )


# ------------------------------------------------------------------------- rollouts -> kit records


def turn_spans(tool_mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (1) in a completion's tool mask (0: tool results)."""
    spans, start = [], None
    for j, value in enumerate(tool_mask):
        if value not in (0, 1):
            raise ValueError(f"tool mask values must be 0 or 1, got {value!r} at position {j}")
        if value == 1 and start is None:
            start = j
        elif value == 0 and start is not None:
            spans.append((start, j))
            start = None
    if start is not None:
        spans.append((start, len(tool_mask)))
    return spans


def rollout_batch(
    inputs: dict[str, Any], *, num_generations: int, step: int, eos_ids: Sequence[int], temperature: float
) -> RolloutBatch:
    """The kit's records of one TRL generation batch (the output of `_generate_and_score_completions`
    with SeeUPOTrainer's `seeupo_rewards` / `seeupo_rows`): one trajectory per completion, one turn per
    run of model tokens. Rows whose reward is NaN (every reward function returned None) get no turns,
    so the kit leaves them out (`never_started`)."""
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "seeupo_rewards", "seeupo_rows"):
        if key not in inputs:
            raise ValueError(f"SeeUPOTrainer: the generation batch has no {key!r}")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    tool_mask = inputs.get("tool_mask")
    sampled = inputs.get("sampling_per_token_logps")
    rewards, rows = inputs["seeupo_rewards"], inputs["seeupo_rows"]
    n = len(completion_ids)
    shapes = [len(prompt_ids), len(prompt_mask), len(completion_mask), len(rewards), len(rows)]
    if any(size != n for size in shapes) or (tool_mask is not None and tuple(tool_mask.shape) != tuple(completion_ids.shape)):
        raise ValueError(f"SeeUPOTrainer: malformed generation batch: {n} completions but row counts {shapes}"
                         + (f", tool_mask {tuple(tool_mask.shape)} vs completions {tuple(completion_ids.shape)}" if tool_mask is not None else ""))
    trajectories = []
    for i in range(n):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        length = int(completion_mask[i].sum())
        if completion_mask[i][length:].any():
            raise ValueError(f"SeeUPOTrainer: completion {i}'s mask is not a prefix of ones")
        completion = completion_ids[i][:length].tolist()
        mask = tool_mask[i][:length].tolist() if tool_mask is not None else [1] * length
        reward = float(rewards[i])
        row = int(rows[i])
        logps = sampled[i][:length].tolist() if sampled is not None else None
        turns = []
        if math.isfinite(reward):
            for start, end in turn_spans(mask):
                turns.append(Turn(prompt + completion[:start], completion[start:end],
                                  logps[start:end] if logps is not None else [0.0] * (end - start),
                                  logprob_temperature=temperature if logps is not None else None))
        truncated = bool(completion) and completion[-1] not in eos_ids
        group = f"{step}-g{row // num_generations}"
        trajectories.append(Trajectory(group, group, f"{step}-r{row}", turns, reward if math.isfinite(reward) else 0.0,
                                       success=False, truncated=truncated))
    return RolloutBatch(trajectories)


# ---------------------------------------------------------------------------------- the learner


class TRLLearner:
    """The kit's `Learner` over a GRPOTrainer's model, reference, accelerator and optimizer.

    Frozen passes take one forward per trajectory (its longest turn scores all of them); `minimize`
    backpropagates each turn's share (one forward each)
    and leaves the optimizer step pending: it is taken (clip at max_grad_norm, step, zero_grad) before
    the next pass, and the last one is left to the Trainer (`pending` says so)."""

    measures_alongside = False  # SeeUPO measures each pool's ratios in a frozen pass of their own

    def __init__(self, trainer: GRPOTrainer, model: torch.nn.Module) -> None:
        self.trainer = trainer
        self.model = model
        self.accelerator = trainer.accelerator
        self.optimizer = trainer.optimizer
        self.temperature = float(trainer.temperature)
        self.max_grad_norm = trainer.args.max_grad_norm
        self.pending = False
        self.steps_taken = 0
        self.grad_norms: list[float] = []

    # ------------------------------------------------------------------ Learner protocol

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True) -> TokenLogprobs:
        self.flush()
        with torch.set_grad_enabled(grad):
            return self._score(self.model, samples)

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        self.flush()
        with torch.no_grad():
            if self.trainer.ref_model is not None:
                return self._score(self.trainer.ref_model, samples)
            from trl.trainer.grpo_trainer import use_adapter  # a peft policy: the base with the adapter off

            unwrapped = self.accelerator.unwrap_model(self.model)
            if not hasattr(unwrapped, "peft_config"):
                raise RuntimeError("SeeUPOTrainer: KL is on (beta > 0) but TRL built no reference model")
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                return self._score(self.model, samples)

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        raise RuntimeError("SeeUPOTrainer has no value model")

    def minimize(self, samples: Sequence[TurnSample], loss: MicroLoss, *, values: bool = False,
                 entropy: bool = False) -> dict[str, float]:
        if values or entropy:
            raise RuntimeError("SeeUPOTrainer's learner has no value model and no entropy term")
        self.flush()
        stats: Counter[str] = Counter()
        for sample in samples:  # one part per turn: its share, normalized by the minibatch's totals
            with torch.enable_grad():
                share, part_stats = loss_share(loss([sample], self._score(self.model, [sample]), None))
                if share.dim() != 0:
                    raise ValueError(f"a MicroLoss must return a scalar share, got shape {tuple(share.shape)}")
                self.accelerator.backward(share)
            stats.update(part_stats)
        self.pending = True
        return dict(stats)

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        self.flush()
        self.accelerator.backward(loss)
        self.pending = True
        return {}

    # ------------------------------------------------------------------ the lazy step

    def flush(self) -> None:
        """Take the pending optimizer step (as the Trainer would: clip, step, zero_grad)."""
        if not self.pending:
            return
        self.pending = False
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            norm = float(self.accelerator.clip_grad_norm_(params, self.max_grad_norm))
        else:
            grads = [p.grad.detach().norm() for p in params if p.grad is not None]
            norm = float(torch.stack(grads).norm()) if grads else 0.0
        self.grad_norms.append(norm)
        if math.isfinite(norm) and norm > 0:  # as the kit's learner: no step on a missing or bad gradient
            self.optimizer.step()
            self.steps_taken += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _score(self, model: torch.nn.Module, samples: Sequence[TurnSample]) -> TokenLogprobs:
        """Response logprobs of `samples`: one forward per trajectory when its turns' contexts extend each
        other (the longest sequence scores every turn: causal attention), else one per turn."""
        device = self.accelerator.device
        rows: list[torch.Tensor | None] = [None] * len(samples)
        by_trajectory: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            if not sample.turn.context_ids:
                raise ValueError(f"turn {sample.t} of {sample.rollout_id} has an empty context")
            by_trajectory.setdefault(sample.rollout_id, []).append(i)
        for indices in by_trajectory.values():
            longest = max(indices, key=lambda i: len(samples[i].turn.context_ids) + len(samples[i].turn.response_ids))
            sequence = samples[longest].turn.context_ids + samples[longest].turn.response_ids
            spans = [(i, len(samples[i].turn.context_ids), len(samples[i].turn.response_ids)) for i in indices]
            if all(sequence[: c + r] == samples[i].turn.context_ids + samples[i].turn.response_ids for i, c, r in spans):
                groups = [(sequence, spans)]
            else:
                groups = [(samples[i].turn.context_ids + samples[i].turn.response_ids, [(i, c, r)]) for i, c, r in spans]
            for tokens, group in groups:
                if not any(r for _, _, r in group):
                    for i, _, _ in group:
                        rows[i] = torch.zeros(0, device=device)
                    continue
                end = max(c + r for _, c, r in group)
                ids = torch.tensor([tokens[:end]], device=device)
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
                for i, c, r in group:
                    scores = torch.log_softmax(logits[c - 1 : c + r - 1].float() / self.temperature, dim=-1)
                    rows[i] = scores.gather(-1, ids[0, c : c + r, None]).squeeze(-1)
        width = max((len(row) for row in rows), default=0)
        logprobs = core.pad_rows(rows, width) if rows else torch.zeros(0, 0, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        for k, row in enumerate(rows):
            mask[k, : len(row)] = True
        return TokenLogprobs(logprobs, mask)


# ---------------------------------------------------------------------------------- the trainer


class SeeUPOTrainer(GRPOTrainer):
    """GRPOTrainer with SeeUPO's sequential turn-pool update (see the module doc). Takes GRPOTrainer's
    arguments; `args` is a `SeeUPOConfig` (a plain GRPOConfig gets SeeUPO's defaults, except its beta)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1:
            raise ValueError("SeeUPOTrainer runs on one process for now (its batch normalization and pools are per process)")
        train_args = self.args
        if not isinstance(train_args, SeeUPOConfig):
            if train_args.steps_per_generation != 1 or train_args.gradient_accumulation_steps != 1 or train_args.num_iterations != 1:
                raise ValueError("SeeUPOTrainer needs gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1")
            defaults = SeeUPOConfig.__dataclass_fields__
            for name in ("seeupo_order", "seeupo_normalization", "seeupo_m_clip", "seeupo_old_policy", "seeupo_kl_estimator"):
                setattr(train_args, name, defaults[name].default)
        self.seeupo = SeeUPO(kit_config(train_args))
        self.seeupo_generator = torch.Generator().manual_seed(train_args.seed)
        self.seeupo_last_batch: RolloutBatch | None = None  # the rollouts of the latest step, for audits and parity
        self._seeupo_rewards: torch.Tensor | None = None

    # ------------------------------------------------------------------ rewards beside the batch

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as GRPOTrainer marks it
        self._seeupo_rewards = rewards
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # Rewards and original row positions travel with each row through TRL's shuffle: groups are
            # consecutive rows of `num_generations` before it.
            n = len(output["completion_ids"])
            output["seeupo_rewards"] = self._seeupo_rewards[:n].to(output["completion_ids"].device)
            output["seeupo_rows"] = torch.arange(n, device=output["completion_ids"].device)
        return output

    # ------------------------------------------------------------------ the step

    def training_step(self, model, inputs, num_items_in_batch=None):
        started = time.perf_counter()
        model.train()
        inputs = self._prepare_inputs(inputs)
        batch = rollout_batch(inputs, num_generations=self.num_generations, step=self.state.global_step,
                              eos_ids=[*self.eos_token_ids, self._tokenizer.pad_token_id], temperature=float(self.temperature))
        self.seeupo_last_batch = batch
        learner = TRLLearner(self, model)
        with self.compute_loss_context_manager():
            metrics = self.seeupo.update(batch, learner, self.seeupo_generator)
        # The last pool's gradients stay for the Trainer's own clip + optimizer step + scheduler step.
        pools = [phase.turn for phase in self.seeupo.schedule]
        logged = {
            "pools_updated": float(len(pools)),
            "optimizer_steps": float(learner.steps_taken + (1 if learner.pending else 0)),
            "m_mean": metrics.get("m_mean", 0.0),
            "m_abs_max": metrics.get("m_abs_max", 0.0),
            "turns_per_trajectory": float(sum(len(t.turns) for t in batch) / max(len(batch), 1)),
        }
        for key, value in metrics.items():  # the kit's own figures (policy_loss, kl, clipfrac, turn_pools, ...)
            logged.setdefault(key, float(value))
        for key, value in logged.items():
            self._metrics["train"][f"seeupo/{key}"].append(value)
        self._step += 1
        self._metrics["train"]["step_time"].append(time.perf_counter() - started)
        loss = metrics.get("policy_loss", 0.0)
        return torch.tensor(float(loss) if math.isfinite(loss) else 0.0, device=self.accelerator.device)
