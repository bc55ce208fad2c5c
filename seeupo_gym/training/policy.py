"""The trainable side of a run: model (+ LoRA), reference, optional value model, optimizers, learner."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from seeupo_gym.training.config import Config, ConfigError
from seeupo_gym.training.learner import LLMLearner, ValueModel, frozen_copy, lm_backbone


@dataclasses.dataclass
class Policy:
    model: Any  # accelerate-prepared
    tokenizer: Any
    optimizer: Any
    value_model: Any
    value_optimizer: Any
    learner: LLMLearner


def build_policy(config: Config, accelerator: Any, *, needs_value_model: bool) -> Policy:
    """Load the configured model, wrap it for accelerate, and build the learner over it."""
    from seeupo_gym.agents.models import load_model

    cfg, acc = config, accelerator
    lora = dataclasses.asdict(cfg.model.lora) if cfg.model.lora is not None else None
    model, tokenizer = load_model(
        cfg.model.name_or_path, dtype=cfg.model.dtype, device=str(acc.device), lora=lora, seed=cfg.train.seed
    )
    disable_dropout(model)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
        if lora is not None:  # the frozen embeddings' output must carry grad into the checkpointed layers
            model.enable_input_require_grads()
    # transformers checkpoints activations only in train mode; with dropout disabled above,
    # train mode changes nothing else, so every pass stays deterministic either way.
    model.train(cfg.model.gradient_checkpointing)
    # With LoRA the reference is the base with the adapter disabled: no copy.
    reference = None if lora is not None else frozen_copy(model)
    optimizer = _optimizer(config, model, cfg.optim.lr)

    value_model = value_optimizer = None
    if needs_value_model:
        critic_lm, _ = load_model(
            cfg.model.name_or_path, dtype=cfg.model.dtype, device=str(acc.device), lora=lora, seed=cfg.train.seed
        )
        disable_dropout(critic_lm)
        value_model = ValueModel(lm_backbone(critic_lm), critic_lm.config.hidden_size).to(acc.device)
        value_model.eval()
        value_optimizer = _optimizer(config, value_model, cfg.optim.value_lr)
        model, optimizer, value_model, value_optimizer = acc.prepare(model, optimizer, value_model, value_optimizer)
    else:
        model, optimizer = acc.prepare(model, optimizer)

    learner = LLMLearner(
        acc,
        model,
        optimizer,
        pad_token_id=tokenizer.pad_token_id,
        reference=reference,
        value_model=value_model,
        value_optimizer=value_optimizer,
        max_grad_norm=cfg.optim.max_grad_norm,
        max_tokens_per_microbatch=cfg.model.max_tokens_per_microbatch,
        logprob_temperature=cfg.sampling.learner_temperature(),
        trunk_cache_mib=cfg.model.trunk_cache_mib,
    )
    return Policy(model, tokenizer, optimizer, value_model, value_optimizer, learner)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in its backward (non-reentrant: works with frozen
    inputs and keyword arguments); transformers >= 5.2x calls it activation checkpointing."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_dropout(model: torch.nn.Module) -> None:
    """Make every pass deterministic, in train mode too: every dropout layer and every dropout
    probability a module reads from its config at forward time (attention dropout) set to 0.

    Ratios compare two passes of the same weights (old vs new, M's factors); dropout noise would
    make them differ where nothing changed. Covers the reference as well: it is a copy of this
    model or the same model with its adapter disabled.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if "dropout" in name and isinstance(value, float):
                    setattr(config, name, 0.0)


def _optimizer(config: Config, module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (check model.lora.target_modules)")
    o = config.optim
    return torch.optim.AdamW(params, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
