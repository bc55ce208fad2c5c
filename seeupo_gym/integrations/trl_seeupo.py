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

The learner is the kit's (`TRLLearner` is `training.learner.LLMLearner` over TRL's model, reference,
accelerator and optimizer): every pass packs each trajectory's turns into one sequence and runs
micro-batches under `seeupo_max_tokens_per_microbatch` tokens, and each pool's ratio pass shares the
next pool's gradient pass. HF's Trainer takes one optimizer step after `training_step`: the learner
therefore takes a pool's step lazily, just before the next pass, and leaves the last pool's gradients
to the Trainer's own clip + step, so the lr scheduler, gradient clipping, logging and checkpoints
stay the Trainer's. All pools of a step run at that step's learning rate.

One SeeUPO step is one generation batch (`per_device_train_batch_size x gradient_accumulation_steps x
processes` completions): with gradient accumulation the Trainer's micro-steps before the last only
let TRL generate, and the last runs the update on the whole batch (the pools need it whole: an
optimizer step between them). With several processes (`accelerate launch`, DDP) every process
gathers the batch and the learner deals its sequences out by tokens, as in the kit's trainer.

GRPOConfig options that SeeUPO does not use are refused in one line when set (`unused_options`);
a plain `GRPOConfig` gets SeeUPO's KL default (beta 0.002) with one warning line.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections import Counter
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Sequence

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

from seeupo_gym.algorithms.base import MicroLoss, TokenLogprobs
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn, TurnSample
from seeupo_gym.algorithms.seeupo import ORDERS, OLD_POLICIES, SeeUPO
from seeupo_gym.algorithms.seeupo import SeeUPOConfig as KitSeeUPOConfig
from seeupo_gym.algorithms.seeupo_authors import M_ALIGNMENTS, SeeUPOAuthors, SeeUPOAuthorsConfig
from seeupo_gym.training.learner import LLMLearner

KL_DEFAULT = 0.002  # the paper's KL-to-reference coefficient


# ---------------------------------------------------------------------------------- the options

# GRPOConfig options SeeUPO's update does not read, each with what SeeUPO does instead. Set to anything
# but GRPOConfig's default (SeeUPOConfig's where SEEUPO_DEFAULTS changes it), they are refused in one line.
UNUSED_OPTIONS: dict[str, str] = {
    "loss_type": "the loss is SeeUPO's (clipped sequence ratio per turn pool, mean over the pool)",
    "scale_rewards": "advantages are normalized by seeupo_normalization",
    "multi_objective_aggregation": "rewards are the reward_weights-weighted sum",
    "importance_sampling_level": "the ratio is one per turn: GSPO's sequence ratio, 'sequence'",
    "top_entropy_quantile": "every response token is in the loss",
    "delta": "the clip is epsilon / epsilon_high only",
    "off_policy_mask_threshold": "no off-policy masking",
    "entropy_coef": "no entropy term",
    "use_adaptive_entropy": "no entropy term",
    "entropy_coef_min": "no entropy term",
    "entropy_coef_max": "no entropy term",
    "entropy_coef_delta": "no entropy term",
    "entropy_target": "no entropy term",
    "sapo_temperature_neg": "not the sapo loss",
    "sapo_temperature_pos": "not the sapo loss",
    "vespo_k_pos": "not the vespo loss",
    "vespo_lambda_pos": "not the vespo loss",
    "vespo_k_neg": "not the vespo loss",
    "vespo_lambda_neg": "not the vespo loss",
    "use_bias_correction_kl": "the KL term is the kit's estimator per token, without a ratio weight",
    "vllm_importance_sampling_correction": "no correction against vLLM's logprobs",
    "cast_lm_head_to_fp32": "the kit scores the LM head in float32 chunks itself",
    "use_liger_kernel": "liger computes GRPO's loss",
}
# The defaults SeeUPOConfig changes: what SeeUPO does, where GRPOConfig's default says otherwise.
SEEUPO_DEFAULTS = {"beta": KL_DEFAULT, "importance_sampling_level": "sequence", "use_bias_correction_kl": False,
                   "vllm_importance_sampling_correction": False}
# The other GRPOConfig options (beyond transformers' TrainingArguments): read by GRPOTrainer's generation,
# scoring, reference and logging, which SeeUPOTrainer keeps, or checked here (num_iterations,
# steps_per_generation), or moot where they are (the vLLM correction's settings, refused when it is on;
# router_aux_loss_coef: one warning line when the model's router loss is on).
USED_OPTIONS = frozenset({
    "beta", "epsilon", "epsilon_high", "reward_weights", "num_iterations", "steps_per_generation", "generation_batch_size",
    "num_generations", "num_generations_eval", "mask_truncated_completions", "max_completion_length", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs", "cache_implementation",
    "max_tool_calling_iterations", "pad_to_multiple_of", "shuffle_dataset", "model_init_kwargs", "trust_remote_code",
    "disable_dropout", "ds3_gather_for_generation", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "router_aux_loss_coef", "log_completions", "log_completions_hub_repo", "log_multimodal", "log_unique_prompts",
    "num_completions_to_print", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "use_transformers_paged", "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
    "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
})


def grpo_default(name: str) -> Any:
    spec = GRPOConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default


def unused_options(args: GRPOConfig, defaults: dict[str, Any] | None = None) -> list[str]:
    """'name=value (what SeeUPO does instead)' for every option of UNUSED_OPTIONS set away from its default."""
    defaults = {**{name: grpo_default(name) for name in UNUSED_OPTIONS}, **(defaults or {})}
    if not getattr(args, "use_vllm", False):  # TRL itself reads it only with vLLM
        defaults["vllm_importance_sampling_correction"] = args.vllm_importance_sampling_correction
    if not args.beta:  # no KL term: the correction of one changes nothing
        defaults["use_bias_correction_kl"] = args.use_bias_correction_kl
    return [f"{name}={getattr(args, name)!r} ({why})" for name, why in UNUSED_OPTIONS.items()
            if getattr(args, name) != defaults[name]]


def check_options(args: GRPOConfig, defaults: dict[str, Any] | None = None) -> None:
    """Refuse, in one line each, what SeeUPOTrainer cannot honour."""
    unused = unused_options(args, defaults)
    if unused:
        raise ValueError("SeeUPOTrainer does not use these GRPO options, leave them at their defaults: " + "; ".join(unused))
    if args.num_iterations != 1:
        raise ValueError(f"SeeUPOTrainer: num_iterations must be 1 (SeeUPO updates each pool once), got {args.num_iterations}")
    if args.steps_per_generation != args.gradient_accumulation_steps:
        raise ValueError(
            f"SeeUPOTrainer: steps_per_generation ({args.steps_per_generation}) must equal gradient_accumulation_steps "
            f"({args.gradient_accumulation_steps}): one SeeUPO step updates one whole generation batch (leave "
            "generation_batch_size and steps_per_generation unset)")
    if args.seeupo_max_tokens_per_microbatch < 1:
        raise ValueError(f"seeupo_max_tokens_per_microbatch must be >= 1, got {args.seeupo_max_tokens_per_microbatch}")
    kit_config(args)  # SeeUPO's own options


@dataclass
class SeeUPOConfig(GRPOConfig):
    """GRPOConfig plus SeeUPO's options (paper defaults). Clipping is GRPOConfig's `epsilon` /
    `epsilon_high` (0.2 / 0.2) and the KL coefficient its `beta` (here 0.002, the paper's; 0 = off)."""

    beta: float = field(default=KL_DEFAULT, metadata={"help": "SeeUPO's KL-to-reference coefficient (the paper's 0.002; 0: off)."})
    importance_sampling_level: str = field(
        default="sequence", metadata={"help": "SeeUPO's ratio is one per turn (GSPO's sequence ratio): 'token' is refused."})
    use_bias_correction_kl: bool = field(
        default=False, metadata={"help": "Not used by SeeUPO (its KL term has no ratio weight): True is refused."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Not used by SeeUPO: True with use_vllm is refused."})
    seeupo_order: str = field(default="reverse", metadata={"help": f"Turn pool update order: one of {ORDERS}."})
    seeupo_normalization: str = field(default="batch", metadata={"help": "GRAE normalization of M: none | group | batch."})
    seeupo_m_clip: list[float] | None = field(
        default=None, metadata={"help": "[low, high] clip of M's ratio product (the authors' code: [0.8, 1.2]); none: off."})
    seeupo_old_policy: str = field(
        default="step_start", metadata={"help": f"Ratio anchor: one of {OLD_POLICIES} (step_start: the paper)."})
    seeupo_kl_estimator: str = field(default="low_var_kl", metadata={"help": "KL estimator: k1 | k2 | k3 | low_var_kl."})
    seeupo_variant: str = field(default="paper", metadata={
        "help": "paper (Algorithm 1) | authors (as the authors' code: algorithms/seeupo_authors.py; their run also sets "
                "seeupo_old_policy='turn_start', seeupo_m_clip=[0.8, 1.2], seeupo_max_steps=10)."})
    seeupo_m_alignment: str = field(default="rollout", metadata={
        "help": f"authors: M by trajectory or by row position after balance_batch: one of {M_ALIGNMENTS}."})
    seeupo_max_steps: int | None = field(default=None, metadata={
        "help": "authors: turn pools per step, padding rows included (none: the batch's longest trajectory)."})
    seeupo_balance_world_size: int = field(default=1, metadata={
        "help": "authors, position: ranks balance_batch partitions each pool over (1: no reorder)."})
    seeupo_max_tokens_per_microbatch: int = field(
        default=8192, metadata={"help": "Tokens per forward (and backward) of every SeeUPO pass: bounds activation memory."})
    seeupo_pack_limit: int | None = field(
        default=None, metadata={"help": "Pack sequences into one row only up to this many tokens (none: the budget on GPU, "
                                        "256 on CPU, as the kit's learner)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_options(self, SEEUPO_DEFAULTS)  # refuse at construction, one line each
        kit_config(self)  # SeeUPO's own options too (variant, alignment, clip, order)


# SeeUPO's own fields, given to a plain GRPOConfig at their defaults.
SEEUPO_FIELDS = {spec.name: spec.default for spec in fields(SeeUPOConfig) if spec.name.startswith("seeupo_")}


def seeupo_args(args: GRPOConfig | None, model: Any) -> GRPOConfig:
    """The arguments SeeUPOTrainer runs with: a SeeUPOConfig as given; none: SeeUPOConfig's defaults; a plain
    GRPOConfig: a copy with SeeUPO's fields at their defaults and, where it holds GRPOConfig's default of an
    option SeeUPOConfig changes (SEEUPO_DEFAULTS: beta=0.0, KL off, first), SeeUPO's, said in one warning line
    (SeeUPOConfig(beta=0.0) turns the KL off). Options SeeUPO does not use are refused (`check_options`)."""
    if args is None:
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        return SeeUPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-SeeUPO")
    if isinstance(args, SeeUPOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"SeeUPOTrainer: args must be a SeeUPOConfig or a GRPOConfig, got {type(args).__name__}")
    args = copy.copy(args)  # the caller's object stays as it was
    for name, value in SEEUPO_FIELDS.items():
        setattr(args, name, copy.copy(value))
    changed = []
    for name, ours in SEEUPO_DEFAULTS.items():
        theirs = getattr(args, name)
        if theirs == grpo_default(name) and theirs != ours:
            setattr(args, name, ours)
            if name != "vllm_importance_sampling_correction" or args.use_vllm:  # TRL reads it only with vLLM
                changed.append(f"{name} {theirs!r} -> {ours!r}")
    check_options(args, SEEUPO_DEFAULTS)
    if changed:
        warnings.warn(f"SeeUPOTrainer: a plain GRPOConfig, SeeUPO's defaults applied: {', '.join(changed)} (pass a "
                      "SeeUPOConfig to choose them, e.g. SeeUPOConfig(beta=0.0) to train without the KL term)",
                      UserWarning, stacklevel=3)
    return args


def kit_config(args: SeeUPOConfig) -> KitSeeUPOConfig:
    """The kit's SeeUPO config for these TRL arguments: one optimizer step per turn pool."""
    variant = getattr(args, "seeupo_variant", "paper")
    if variant not in ("paper", "authors"):
        raise ValueError(f"seeupo_variant must be 'paper' or 'authors', got {variant!r}")
    authors = {}
    if variant == "authors":
        authors = dict(m_alignment=args.seeupo_m_alignment, max_steps=args.seeupo_max_steps,
                       balance_world_size=args.seeupo_balance_world_size)
    return (SeeUPOAuthorsConfig if variant == "authors" else KitSeeUPOConfig)(
        **authors,
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


ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "seeupo_rewards", "seeupo_rows")


def generation_rows(inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one (slice of a) TRL generation batch, unpadded, as plain lists: what every process
    gathers. Each: row (its position in the generation batch), prompt, completion, tool mask, sampled
    logprobs (or None) and reward."""
    for key in ROW_KEYS:
        if key not in inputs:
            raise ValueError(f"SeeUPOTrainer: the generation batch has no {key!r}")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    tool_mask = inputs.get("tool_mask")
    sampled = inputs.get("sampling_per_token_logps")
    rewards, positions = inputs["seeupo_rewards"], inputs["seeupo_rows"]
    n = len(completion_ids)
    shapes = [len(prompt_ids), len(prompt_mask), len(completion_mask), len(rewards), len(positions)]
    if any(size != n for size in shapes) or (tool_mask is not None and tuple(tool_mask.shape) != tuple(completion_ids.shape)):
        raise ValueError(f"SeeUPOTrainer: malformed generation batch: {n} completions but row counts {shapes}"
                         + (f", tool_mask {tuple(tool_mask.shape)} vs completions {tuple(completion_ids.shape)}" if tool_mask is not None else ""))
    rows = []
    for i in range(n):
        length = int(completion_mask[i].sum())
        if completion_mask[i][length:].any():
            raise ValueError(f"SeeUPOTrainer: completion {i}'s mask is not a prefix of ones")
        rows.append({
            "row": int(positions[i]),
            "prompt": prompt_ids[i][prompt_mask[i].bool()].tolist(),
            "completion": completion_ids[i][:length].tolist(),
            "tool_mask": tool_mask[i][:length].tolist() if tool_mask is not None else [1] * length,
            "logps": sampled[i][:length].tolist() if sampled is not None else None,
            "reward": float(rewards[i]),
        })
    return rows


def batch_from_rows(rows: Sequence[dict[str, Any]], *, num_generations: int, step: int, eos_ids: Sequence[int],
                    temperature: float) -> RolloutBatch:
    """The kit's records of a generation batch's rows (`generation_rows`), in row order: one trajectory per
    completion, one turn per run of model tokens. Rows whose reward is NaN (every reward function returned
    None) get no turns, so the kit leaves them out (`never_started`); so do completions TRL masked whole
    (`mask_truncated_completions`: the kit's `truncated: mask`)."""
    rows = sorted(rows, key=lambda r: r["row"])
    if len({r["row"] for r in rows}) != len(rows):
        raise ValueError("SeeUPOTrainer: two rows of the generation batch share a position")
    trajectories = []
    for r in rows:
        prompt, completion, logps, reward = r["prompt"], r["completion"], r["logps"], r["reward"]
        turns = []
        if math.isfinite(reward):
            for start, end in turn_spans(r["tool_mask"]):
                turns.append(Turn(prompt + completion[:start], completion[start:end],
                                  logps[start:end] if logps is not None else [0.0] * (end - start),
                                  logprob_temperature=temperature if logps is not None else None))
        truncated = bool(completion) and completion[-1] not in eos_ids
        group = f"{step}-g{r['row'] // num_generations}"
        trajectories.append(Trajectory(group, group, f"{step}-r{r['row']}", turns, reward if math.isfinite(reward) else 0.0,
                                       success=False, truncated=truncated))
    return RolloutBatch(trajectories)


def rollout_batch(inputs: dict[str, Any], *, num_generations: int, step: int, eos_ids: Sequence[int],
                  temperature: float) -> RolloutBatch:
    """The kit's records of one TRL generation batch (the output of `_generate_and_score_completions` with
    SeeUPOTrainer's `seeupo_rewards` / `seeupo_rows`), on one process."""
    return batch_from_rows(generation_rows(inputs), num_generations=num_generations, step=step, eos_ids=eos_ids,
                           temperature=temperature)


# ---------------------------------------------------------------------------------- the learner


class TRLLearner(LLMLearner):
    """The kit's learner (packing, token-budget micro-batches, processes: training/learner.py) over a
    GRPOTrainer's model, reference, accelerator and optimizer, with the optimizer step taken lazily:
    a pool's step (clip at max_grad_norm, step, zero_grad) is taken before the next pass, and the last
    one is left to the Trainer (`pending` says so). `forwards` counts the forward calls per model."""

    def __init__(self, trainer: GRPOTrainer, model: torch.nn.Module, *, pad_token_id: int,
                 max_tokens_per_microbatch: int = 8192, pack_limit: int | None = None) -> None:
        unwrapped = trainer.accelerator.unwrap_model(model)
        # ref_logprobs is TRL's reference (below), never `reference`; the base only asks that one exist.
        reference = trainer.ref_model if trainer.ref_model is not None or hasattr(unwrapped, "disable_adapter") else model
        super().__init__(trainer.accelerator, model, trainer.optimizer, pad_token_id=pad_token_id, reference=reference,
                         max_grad_norm=float(trainer.args.max_grad_norm or 0.0),
                         max_tokens_per_microbatch=max_tokens_per_microbatch, pack_limit=pack_limit,
                         logprob_temperature=float(trainer.temperature), trunk_cache_mib=0)
        self.trainer = trainer
        self.pending = False
        self.steps_taken = 0
        self.grad_norms: list[float] = []
        self.forwards: Counter[str] = Counter()

    # ------------------------------------------------------------------ Learner protocol

    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True) -> TokenLogprobs:
        self.flush()
        return super().logprobs(samples, grad=grad)

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        self.flush()
        self._check_temperature(samples)
        if self.trainer.ref_model is not None:
            return self._frozen(samples, self._scorer(self.trainer.ref_model, "reference"))
        from trl.trainer.grpo_trainer import use_adapter  # a peft policy: the base with the adapter off

        unwrapped = self.accelerator.unwrap_model(self.model)
        if not hasattr(unwrapped, "peft_config"):
            raise RuntimeError("SeeUPOTrainer: KL is on (beta > 0) but TRL built no reference model")
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            return self._frozen(samples, self._scorer(unwrapped, "reference"))

    def minimize(self, samples: Sequence[TurnSample], loss: MicroLoss, *, values: bool = False,
                 entropy: bool = False) -> dict[str, float]:
        if values or entropy:
            raise RuntimeError("SeeUPOTrainer's learner has no value model and no entropy term")
        self.flush()
        return super().minimize(samples, loss)

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        self.flush()
        return super().optimize(loss)

    # ------------------------------------------------------------------ the lazy step

    def _step(self, finite: bool) -> dict[str, float]:
        """The base's step after a gradient pass: here only marked pending (see `flush`)."""
        if not finite:  # every process agrees (the base reduced `finite`)
            self._zero_grad()
            return {"skipped_nonfinite": 1.0}
        self.pending = True
        return {}

    def flush(self) -> None:
        """Take the pending optimizer step as the base learner does (clip, step unless the gradient is
        missing or zero, zero_grad)."""
        if not self.pending:
            return
        self.pending = False
        metrics = LLMLearner._step(self, True)
        self.grad_norms.append(metrics["grad_norm"])
        if not metrics.get("skipped_nonfinite") and not metrics.get("skipped_no_gradient"):
            self.steps_taken += 1

    def settle(self) -> None:
        """Before the Trainer's own step: a pending gradient that is all zero is dropped (set to None), so
        that its optimizer skips the parameters as the kit's learner does (AdamW would still move them)."""
        if self.pending and not any(bool(p.grad.ne(0).any()) for p in self.model.parameters() if p.grad is not None):
            self.pending = False
            self._zero_grad()

    def _scorer(self, model: torch.nn.Module, name: str, entropy: bool = False):
        score = super()._scorer(model, name, entropy)

        def counted(sequences):
            if sequences is not self._dummy:
                self.forwards[name] += 1
            return score(sequences)

        return counted


# ---------------------------------------------------------------------------------- the trainer


class SeeUPOTrainer(GRPOTrainer):
    """GRPOTrainer with SeeUPO's sequential turn-pool update (see the module doc). Takes GRPOTrainer's
    arguments; `args` is a `SeeUPOConfig` (a plain GRPOConfig: see `seeupo_args`)."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        args = copy.copy(seeupo_args(args, model))
        # SeeUPO's loss is its own; "grpo" (unused) keeps TRL from advising it for sequence-level ratios.
        args.loss_type = "grpo"
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        from seeupo_gym.integrations.trl import check_dataset_fills_a_step

        check_dataset_fills_a_step(self.train_dataset, self.args, self.accelerator.num_processes)
        if getattr(self, "aux_loss_enabled", False):
            warnings.warn(f"SeeUPOTrainer: SeeUPO's loss has no router auxiliary loss (router_aux_loss_coef="
                          f"{self.router_aux_loss_coef} is not applied; set it to 0.0 to silence this)", UserWarning, stacklevel=2)
        config = kit_config(self.args)
        self.seeupo = (SeeUPOAuthors if isinstance(config, SeeUPOAuthorsConfig) else SeeUPO)(config)
        # TRL scores the reference in its generation step when beta != 0; SeeUPO scores its own (packed),
        # so TRL's pass is turned off here. The KL coefficient SeeUPO uses stays `args.beta`.
        self.beta = 0.0
        self.seeupo_generator = torch.Generator().manual_seed(self.args.seed)
        self.seeupo_last_batch: RolloutBatch | None = None  # the rollouts of the latest step, for audits and parity
        self.seeupo_last_learner: TRLLearner | None = None
        self._seeupo_rewards: torch.Tensor | None = None

    # ------------------------------------------------------------------ rewards beside the batch

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # Gathered over processes by TRL: groups are consecutive rows of `num_generations` in this order.
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as GRPOTrainer marks it
        self._seeupo_rewards = rewards
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # This process's rewards and positions in the gathered batch travel with each row through
            # TRL's shuffle and split (TRL's own `process_slice`).
            n = len(output["completion_ids"])
            start = self.accelerator.process_index * n
            device = output["completion_ids"].device
            output["seeupo_rewards"] = self._seeupo_rewards[start : start + n].to(device)
            output["seeupo_rows"] = torch.arange(start, start + n, device=device)
        return output

    # ------------------------------------------------------------------ the step

    def training_step(self, model, inputs, num_items_in_batch=None):
        started = time.perf_counter()
        model.train()
        self._prepare_inputs(inputs)  # generates at the start of each generation batch
        position = self._step % self.args.steps_per_generation
        self._step += 1
        if position != self.args.steps_per_generation - 1:
            # An accumulation micro-step before the last: the update waits for the whole batch.
            self._seeupo_step_time = time.perf_counter() - started
            return torch.zeros((), device=self.accelerator.device)
        if not self.accelerator.sync_gradients:
            raise RuntimeError("SeeUPOTrainer: the Trainer did not end its accumulation window on the generation "
                               "batch's last slice; keep steps_per_generation == gradient_accumulation_steps")
        batch = self._whole_batch()
        self.seeupo_last_batch = batch
        learner = TRLLearner(self, model, pad_token_id=self._tokenizer.pad_token_id,
                             max_tokens_per_microbatch=self.args.seeupo_max_tokens_per_microbatch,
                             pack_limit=self.args.seeupo_pack_limit)
        self.seeupo_last_learner = learner
        with self.compute_loss_context_manager():
            metrics = self.seeupo.update(batch, learner, self.seeupo_generator)
        learner.settle()  # the last pool's gradients stay for the Trainer's clip + optimizer + scheduler step
        self._log_step(batch, learner, metrics, time.perf_counter() - started + getattr(self, "_seeupo_step_time", 0.0))
        loss = metrics.get("policy_loss", 0.0)
        return torch.tensor(float(loss) if math.isfinite(loss) else 0.0, device=self.accelerator.device)

    def _whole_batch(self) -> RolloutBatch:
        """Every slice of the generation batch, from every process, in generation order."""
        rows = [row for part in self._buffered_inputs for row in generation_rows(part)]
        if self.accelerator.num_processes > 1:
            rows = gather_object(rows)
        return batch_from_rows(rows, num_generations=self.num_generations, step=self.state.global_step,
                               eos_ids=[*self.eos_token_ids, self._tokenizer.pad_token_id],
                               temperature=float(self.temperature))

    def _log_step(self, batch: RolloutBatch, learner: TRLLearner, metrics: dict[str, float], seconds: float) -> None:
        logged = {
            "pools_updated": float(len(self.seeupo.schedule)),
            "optimizer_steps": float(learner.steps_taken + (1 if learner.pending else 0)),
            "m_mean": metrics.get("m_mean", 0.0),
            "m_abs_max": metrics.get("m_abs_max", 0.0),
            "turns_per_trajectory": float(sum(len(t.turns) for t in batch) / max(len(batch), 1)),
            "forwards_policy": float(learner.forwards["policy"]),
            "forwards_reference": float(learner.forwards["reference"]),
            "tokens_fed_policy": float(learner.tokens_fed["policy"]),
        }
        for key, value in metrics.items():  # the kit's own figures (policy_loss, kl, clipfrac, turn_pools, ...)
            logged.setdefault(key, float(value))
        for key, value in logged.items():
            self._metrics["train"][f"seeupo/{key}"].append(value)
        self._metrics["train"]["step_time"].append(seconds)
