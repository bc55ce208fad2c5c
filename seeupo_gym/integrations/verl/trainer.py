"""SeeUPO as a verl 0.9.1 trainer, through verl's own registries (no fork, no patch of its internals).

- `SeeUPOTrainer` is verl's synchronous v1 trainer (`PPOTrainerSync`) registered as
  `trainer.v1.trainer_mode=seeupo`. Everything before the actor update is verl's: rollouts (any agent
  loop), rewards, old and reference log-probs, KL in the reward. Its `_update_actor` reads the batch
  from verl's TransferQueue and runs `seeupo_step` (`seeupo.py`) over the actor worker group, so
  every verl engine (FSDP, Megatron) serves the pools unchanged.
- `seeupo_advantages`, registered as `algorithm.adv_estimator=seeupo`: each trajectory's initial M
  (GRAE, `algorithm.seeupo.normalization`) on its sampled tokens, what verl logs as advantages.

`SeeUPOTrainer` logs one warning line at start naming the verl options it accepts and does not read
(`UNUSED_OPTIONS`: `ppo_mini_batch_size`, ...). `register()` installs both; the launcher (`python -m seeupo_gym.integrations.verl`) runs it in every
Ray worker through Ray's `worker_process_setup_hook`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.seeupo_authors import authors_advantages
from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, WorkerGroupActor, step_for

logger = logging.getLogger(__name__)

# verl options a SeeUPO run accepts (verl's config needs them) and does not read, with why.
UNUSED_OPTIONS = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": "each turn pool is one mini-batch",
    "actor_rollout_ref.actor.shuffle": "one mini-batch per pool, nothing to shuffle",
    "actor_rollout_ref.actor.clip_ratio_c": "verl's gspo loss has no dual clip",
    "actor_rollout_ref.actor.loss_scale_factor": "only seq-mean-token-sum-norm reads it",
    "algorithm.gamma": "SeeUPO's M is the trajectory's GRAE advantage",
    "algorithm.lam": "SeeUPO's M is the trajectory's GRAE advantage",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.seeupo.normalization decides",
}

# What the step reads from the TransferQueue of each row (verl's v1 layout: unpadded per row).
TQ_FIELDS = ("prompts", "responses", "response_mask", "old_log_probs", "ref_log_prob", "rm_scores", "uid", "extra_fields")


@core_algos.register_adv_est("seeupo")
def seeupo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray | None = None,
                      config: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial M_i = GRAE(R_i) of each row, on its response tokens (advantages = returns)."""
    if index is None:
        raise ValueError("algorithm.adv_estimator=seeupo needs the rows' uid groups")
    options = VerlSeeUPOConfig.from_mapping(_seeupo_section(config))
    names: dict[str, int] = {}
    groups = torch.tensor([names.setdefault(str(u), len(names)) for u in index])
    rewards = token_level_rewards.sum(-1).to(torch.float64)
    if options.variant == "authors":  # group mean, batch z-score, clamp (algorithms/seeupo_authors.py)
        scores = authors_advantages(rewards, groups).to(token_level_rewards.dtype)
    else:
        scores = core.group_advantages(rewards, groups, options.normalization).to(token_level_rewards.dtype)
    advantages = scores[:, None] * response_mask
    return advantages, advantages


def unused_options_line(config: Any) -> str:
    """One line naming every option of `config` that SeeUPO accepts and does not read, its value and why."""
    from omegaconf import OmegaConf

    parts = []
    for key, why in UNUSED_OPTIONS.items():
        value = OmegaConf.select(config, key, default="<absent>")
        if value != "<absent>":
            parts.append(f"{key}={value} ({why})")
    return "seeupo verl: accepted and not used by SeeUPO: " + "; ".join(parts) if parts else ""


def warn_unused_options(config: Any) -> None:
    line = unused_options_line(config)
    if line:
        logger.warning(line)


def _seeupo_section(algorithm_config: Any) -> dict[str, Any]:
    if algorithm_config is None:
        return {}
    section = algorithm_config.get("seeupo", None) if hasattr(algorithm_config, "get") else getattr(algorithm_config, "seeupo", None)
    if section is None:
        return {}
    try:
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(section, resolve=True)) if OmegaConf.is_config(section) else dict(section)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return dict(section)


def dataproto_from_rows(rows: Any, keys: list[str], pad_token_id: int) -> DataProto:
    """verl's v1 TransferQueue rows (a TensorDict of per-row, unpadded fields: `TQ_FIELDS`) as the padded
    DataProto `seeupo_step` takes: prompts left-padded, responses right-padded, as verl's v0 layout.

    One row per trajectory: a session (`{uid}_{session}_{index}` key) with several outputs is refused."""
    sessions = [key.rsplit("_", 1)[0] for key in keys]
    if len(set(sessions)) != len(sessions):
        raise ValueError("SeeUPO needs one output per episode; an agent loop returned several outputs for one session")
    prompts = [torch.as_tensor(p) for p in _unbind(rows["prompts"])]
    responses = [torch.as_tensor(r) for r in _unbind(rows["responses"])]
    masks = [torch.as_tensor(m) for m in _unbind(rows["response_mask"])]
    for i, (response, mask) in enumerate(zip(responses, masks)):
        if response.ndim != 1 or mask.shape != response.shape:
            raise ValueError(f"row {i}: response and response_mask differ in shape ({tuple(response.shape)} vs {tuple(mask.shape)})")
    tensors = padded_tensors(prompts, responses, masks, pad_token_id)
    width = tensors["responses"].shape[1]
    for name, target in (("old_log_probs", "old_log_probs"), ("ref_log_prob", "ref_log_prob"), ("rm_scores", "token_level_scores"),
                         ("token_level_rewards", "token_level_rewards")):
        if name in rows.keys():
            tensors[target] = right_padded([torch.as_tensor(x).float() for x in _unbind(rows[name])], width)
    extra = _values(rows["extra_fields"]) if "extra_fields" in rows.keys() else [{}] * len(keys)
    spans = [e.get("turn_spans") if isinstance(e, dict) else None for e in extra]
    non_tensors = {"uid": np.array([str(u) for u in _values(rows["uid"])], dtype=object)}
    if all(s is not None for s in spans):
        non_tensors["turn_spans"] = np.array(spans + [None], dtype=object)[:-1]
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def padded_tensors(prompts: list[torch.Tensor], responses: list[torch.Tensor], masks: list[torch.Tensor], pad_token_id: int
                   ) -> dict[str, torch.Tensor]:
    """verl's padded layout of rows: `| pad.. prompt | response ..pad |`, with attention and positions."""
    n, width_p, width_r = len(prompts), max(len(p) for p in prompts), max(max(len(r) for r in responses), 1)
    prompt_ids = torch.full((n, width_p), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros(n, width_p, dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            prompt_ids[i, width_p - len(p):] = p
            prompt_attention[i, width_p - len(p):] = 1
    response_ids = right_padded(responses, width_r, pad_token_id).long()
    response_mask = right_padded(masks, width_r).long()
    response_attention = (torch.arange(width_r)[None] < torch.tensor([len(r) for r in responses])[:, None]).long()
    attention = torch.cat([prompt_attention, response_attention], 1)
    return {"prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask}


def right_padded(rows: list[torch.Tensor], width: int, value: float = 0) -> torch.Tensor:
    dtype = rows[0].dtype if rows else torch.float32
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row[:width]
    return out


def _values(field: Any) -> list[Any]:
    """A non-tensor column (verl stores them as tensordict's NonTensorStack) as a list."""
    return list(field.tolist()) if hasattr(field, "tolist") else list(field)


def _unbind(field: Any) -> list[Any]:
    return list(field.unbind(0)) if isinstance(field, torch.Tensor) else list(field)


def _trainer_base() -> type:
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    return PPOTrainerSync


class _Lazy:
    """`SeeUPOTrainer` is built on first use: verl's v1 trainer imports TransferQueue and Ray."""

    cls: type | None = None


def seeupo_trainer_class() -> type:
    if _Lazy.cls is not None:
        return _Lazy.cls
    import transfer_queue as tq
    from verl.trainer.ppo.v1.trainer_base import register_trainer

    base = _trainer_base()

    class SeeUPOTrainer(base):  # type: ignore[misc, valid-type]
        """verl's sync v1 trainer whose actor update is SeeUPO's pools (module doc)."""

        def __init__(self, config: Any) -> None:
            from omegaconf import open_dict

            # verl picked this class by `trainer_mode=seeupo`; from here on it is verl's sync mode
            # (its replay buffer and refill rules key on the mode's name).
            with open_dict(config):
                config.trainer.v1.trainer_mode = "sync"
            VerlSeeUPOConfig.from_mapping(_seeupo_section(config.algorithm))  # refused before any worker starts
            warn_unused_options(config)
            super().__init__(config)

        def _update_actor(self, batch: Any, metrics: dict) -> Any:
            config = self.config
            options = VerlSeeUPOConfig.from_mapping(_seeupo_section(config.algorithm))
            if not hasattr(self, "_seeupo_generator"):
                self._seeupo_generator = torch.Generator().manual_seed(options.seed)
            fields = [f for f in TQ_FIELDS if f != "ref_log_prob" or self.use_reference_policy]
            if config.algorithm.use_kl_in_reward:
                fields.append("token_level_rewards")
            rows = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            data = dataproto_from_rows(rows, list(batch.keys), self.tokenizer.pad_token_id)
            actor_config = config.actor_rollout_ref.actor
            actor = WorkerGroupActor(  # padded to the world size, a multiple of any data-parallel size
                self.actor_rollout_wg, dp_size=self.actor_rollout_wg.world_size,
                temperature=config.actor_rollout_ref.rollout.temperature,
                calculate_entropy=actor_config.calculate_entropy or actor_config.entropy_coeff != 0.0,
                seed=actor_config.data_loader_seed)
            metrics.update(step_for(options)(data, actor, options, self._seeupo_generator))
            return batch

    register_trainer("seeupo")(SeeUPOTrainer)
    _Lazy.cls = SeeUPOTrainer
    return SeeUPOTrainer


def register() -> None:
    """Install SeeUPO's trainer and advantage estimator in verl's registries (idempotent). Ray runs it
    in every worker process (`worker_process_setup_hook`); the estimator registers on import."""
    seeupo_trainer_class()
