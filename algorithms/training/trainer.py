"""One trainer for every algorithm (DESIGN section 6).

The loop is rollout -> update -> eval -> log -> checkpoint. The trainer owns the model (with
an optional LoRA adapter), the reference policy, the optional value model, the optimizers,
the generation backend and the vectorized agent; the algorithm is looked up by name and
owns the whole update step. Nothing here knows which algorithm runs.

Distribution comes from accelerate's own configuration (`accelerate launch`): each process
collects its share of the step's tasks, the trajectories are gathered so every process
holds the whole batch, and the algorithm runs the same update everywhere while the learner
splits the forward work (see `algorithms/learner.py`). Batch-level statistics such as batch
normalization of advantages are therefore over the global batch, exactly as in one process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from algorithms.base import Algorithm, load_plugin, make_algorithm
from algorithms.config import Config, ConfigError, config_from_dict, load_config, save_config
from algorithms.rollout import RolloutBatch, Trajectory

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
# VectorAgent's `info["end"]` for an episode an env exception ended (agents/vector.py).
ENV_ERROR = "env_error"


class RolloutError(RuntimeError):
    """Collecting a step's rollouts failed on some process, after the configured retries."""


@dataclasses.dataclass
class TrainerState:
    """The trainer's own part of a checkpoint (accelerate saves weights, optimizers and RNGs)."""

    step: int = 0
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "config": self.config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.config = dict(state.get("config", {}))


def _as_config(config: Config | dict[str, Any] | str | Path) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    return load_config(config)


def build_algorithm(config: Config) -> Algorithm:
    """Import the plug-ins, then build the configured algorithm; config errors name the key."""
    for plugin in config.plugins:
        try:
            load_plugin(plugin)
        except Exception as error:  # a user's file: report which one and why
            raise ConfigError(f"plugins: loading {plugin!r} failed: {type(error).__name__}: {error}") from error
    try:
        return make_algorithm(config.algorithm.name, config.algorithm.options)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"algorithm ({config.algorithm.name}): {error}") from error


def env_task_ids(env_id: str, env_kwargs: dict[str, Any]) -> list[str]:
    """The task ids an env offers (its `task_ids`), for configs that do not list them."""
    import gymnasium as gym

    import seeupo_gym  # noqa: F401  (registers the ids)

    try:
        env = gym.make(env_id, **env_kwargs)
    except Exception as error:
        raise ConfigError(f"env.id {env_id!r} with env.kwargs {env_kwargs}: cannot make the env: {error}") from error
    try:
        ids = getattr(env.unwrapped, "task_ids", None)
        if callable(ids):
            ids = ids()
    finally:
        env.close()
    if not ids:
        raise ConfigError(f"env {env_id!r} does not list its tasks (no `task_ids`); set env.train_tasks")
    return [str(task) for task in ids]


class Trainer:
    """Train a policy on an env with a registered algorithm.

    >>> Trainer("configs/tiny-cpu.yaml").train()                     # doctest: +SKIP
    >>> Trainer(load_config("configs/tiny-cpu.yaml", ["algorithm.name=grpo"])).train()  # doctest: +SKIP
    """

    def __init__(self, config: Config | dict[str, Any] | str | Path, *, accelerator: Any = None) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed

        import seeupo_gym  # noqa: F401  (registers the env ids; cheap)

        self.config = config = _as_config(config)
        self.algorithm = build_algorithm(config)
        self.output_dir = Path(config.log.output_dir)

        if accelerator is None:
            accelerator = Accelerator(
                # Launched as several processes (`accelerate launch --multi_gpu`, torchrun) on a
                # machine without GPUs: accelerate runs them as MULTI_CPU (gloo) only when told cpu.
                cpu=bool(os.environ.get("LOCAL_RANK")) and not torch.cuda.is_available(),
                log_with=list(config.log.trackers) or None,
                project_config=ProjectConfiguration(project_dir=str(self.output_dir), logging_dir=str(self.output_dir / "logs")),
                # Forward passes differ in number across processes (each scores its own share),
                # so buffers must not be broadcast in forward (a collective per call).
                kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
            )
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        if self.is_main:
            logger.info("accelerate: %s, %d process(es), device %s", accelerator.distributed_type,
                        accelerator.num_processes, accelerator.device)
        set_seed(config.train.seed)
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.output_dir / "config.yaml")

        env = config.env
        self.train_tasks = list(env.train_tasks or env_task_ids(env.id, env.kwargs))
        if env.eval_tasks:
            self.eval_tasks = list(env.eval_tasks)
        elif env.eval_kwargs is not None:
            self.eval_tasks = env_task_ids(env.id, {**env.kwargs, **env.eval_kwargs})
        else:
            self.eval_tasks = list(self.train_tasks)

        self._build_models()
        self.state = TrainerState(step=0, config=config.to_dict())
        accelerator.register_for_checkpointing(self.state)
        if config.log.trackers:
            accelerator.init_trackers(config.log.project_name, config=_flat_hparams(config.to_dict()))

        self.backend = self._make_backend()
        self.agent = self._make_agent(env.kwargs)
        self._eval_agent: Any = None
        self.last_env_errors = 0
        self.metrics_path = self.output_dir / "metrics.jsonl"
        if config.resume_from is not None:
            self.resume(config.resume_from)

    # ------------------------------------------------------------------ construction

    def _build_models(self) -> None:
        from agents.models import load_model

        from algorithms.learner import LLMLearner, ValueModel, frozen_copy, lm_backbone

        cfg, acc = self.config, self.accelerator
        lora = dataclasses.asdict(cfg.model.lora) if cfg.model.lora is not None else None
        model, self.tokenizer = load_model(
            cfg.model.name_or_path, dtype=cfg.model.dtype, device=str(acc.device), lora=lora, seed=cfg.train.seed
        )
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora is not None:
                model.enable_input_require_grads()
        # Ratios must be exact, so no dropout in any pass: eval mode throughout, except that
        # transformers only checkpoints activations in train mode (then keep dropout at 0).
        model.train(cfg.model.gradient_checkpointing)
        reference = None if lora is not None else frozen_copy(model)
        optimizer = self._optimizer(model, cfg.optim.lr)

        value_model = value_optimizer = None
        if self.algorithm.needs_value_model:
            critic_lm, _ = load_model(
                cfg.model.name_or_path, dtype=cfg.model.dtype, device=str(acc.device), lora=lora, seed=cfg.train.seed
            )
            value_model = ValueModel(lm_backbone(critic_lm), critic_lm.config.hidden_size).to(acc.device)
            value_model.eval()
            value_optimizer = self._optimizer(value_model, cfg.optim.value_lr)
            model, optimizer, value_model, value_optimizer = acc.prepare(model, optimizer, value_model, value_optimizer)
        else:
            model, optimizer = acc.prepare(model, optimizer)

        self.model, self.optimizer = model, optimizer
        self.value_model, self.value_optimizer = value_model, value_optimizer
        self.learner = LLMLearner(
            acc,
            model,
            optimizer,
            pad_token_id=self.tokenizer.pad_token_id,
            reference=reference,
            value_model=value_model,
            value_optimizer=value_optimizer,
            max_grad_norm=cfg.optim.max_grad_norm,
            forward_batch_size=cfg.model.forward_batch_size,
        )

    def _optimizer(self, module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters (check model.lora.target_modules)")
        o = self.config.optim
        return torch.optim.AdamW(params, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)

    def _sampling(self, temperature: float) -> Any:
        from agents.backends.base import SamplingParams

        s = self.config.sampling
        return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=temperature, top_p=s.top_p)

    def _make_backend(self) -> Any:
        from agents.backends.hf import HFBackend

        # The HF backend generates with the very module being trained: syncing is a no-op.
        return HFBackend(self.accelerator.unwrap_model(self.model), self.tokenizer)

    def _make_agent(self, env_kwargs: dict[str, Any]) -> Any:
        from agents.vector import VectorAgent

        env = self.config.env
        try:
            return VectorAgent(
                env.id,
                self.backend,
                self.tokenizer,
                num_envs=env.num_envs,
                sampling=self._sampling(self.config.sampling.temperature),
                max_context_tokens=env.max_context_tokens,
                env_kwargs=dict(env_kwargs),
                vectorization=env.vectorization,
            )
        except Exception as error:
            raise ConfigError(f"env {env.id!r} with kwargs {env_kwargs}: cannot start the agent's envs: {error}") from error

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, float]]:
        """Run to `train.steps`; returns this run's metric records (train and eval)."""
        cfg = self.config.train
        records: list[dict[str, float]] = []
        bar = tqdm(
            total=cfg.steps,
            initial=self.state.step,
            desc=f"train {self.algorithm.name}",
            disable=not (self.is_main and self.config.log.progress_bars),
        )
        saved_at = -1
        try:
            while self.state.step < cfg.steps:
                record = self.train_step()
                records.append(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record.get('rollout/reward_mean', float('nan')):.3f}")
                step = self.state.step
                if cfg.eval_every and step % cfg.eval_every == 0:
                    records.append(self.evaluate())
                if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                    self.save_checkpoint()
                    saved_at = step
        except RolloutError:
            # Keep the steps done so far: the run resumes from here once the env is fixed.
            if self.state.step > 0 and saved_at != self.state.step:
                self.save_checkpoint()
            raise
        finally:
            bar.close()
        return records

    def train_step(self) -> dict[str, float]:
        """Collect one batch, update once, sync weights, log. Returns the step's metrics."""
        cfg = self.config.train
        step = self.state.step + 1
        started = time.perf_counter()
        tasks = self.tasks_for_step(step)
        batch = self.collect(tasks, cfg.group_size, seed=_mix(cfg.seed, step), what=f"step {step}")
        collected = time.perf_counter()

        record: dict[str, float] = {"step": float(step), **rollout_metrics(batch, prefix="rollout")}
        record["rollout/env_errors"] = float(self.last_env_errors)
        if len(batch) == 0:
            logger.warning("step %d: no trajectories were collected; skipping the update", step)
            record["update/skipped_empty_batch"] = 1.0
        else:
            generator = torch.Generator().manual_seed(_mix(cfg.seed, step, 1))
            metrics = self.algorithm.update(batch, self.learner, generator)
            record.update({f"update/{k}": float(v) for k, v in metrics.items()})
            self.sync_weights()
        record["time/rollout_s"] = collected - started
        record["time/update_s"] = time.perf_counter() - collected
        self.state.step = step
        self.log(record)
        return record

    def sync_weights(self) -> None:
        self.backend.update_weights(self.accelerator.unwrap_model(self.model))

    def evaluate(self) -> dict[str, float]:
        """One rollout per eval task at `train.eval_temperature`; logged under eval/."""
        cfg, env = self.config.train, self.config.env
        if env.eval_kwargs is not None and self._eval_agent is None:
            self._eval_agent = self._make_agent({**env.kwargs, **env.eval_kwargs})
        agent = self._eval_agent or self.agent
        train_sampling = agent.sampling
        agent.sampling = dataclasses.replace(train_sampling, temperature=cfg.eval_temperature)
        try:
            tasks = self.eval_tasks[: cfg.eval_tasks_per_eval]
            batch = self.collect(tasks, 1, seed=_mix(cfg.seed, self.state.step, 2), what="eval", agent=agent)
        finally:
            agent.sampling = train_sampling
        record = {"step": float(self.state.step), **rollout_metrics(batch, prefix="eval")}
        self.log(record)
        return record

    def tasks_for_step(self, step: int) -> list[str]:
        """The step's B tasks: a function of (seed, step) alone, so a resumed run draws the same."""
        rng = np.random.default_rng([self.config.train.seed, step])
        count = self.config.train.tasks_per_step
        replace = count > len(self.train_tasks)
        picks = rng.choice(len(self.train_tasks), size=count, replace=replace)
        return [self.train_tasks[i] for i in picks]

    def collect(
        self, tasks: Sequence[str], group_size: int, *, seed: int, what: str, agent: Any = None
    ) -> RolloutBatch:
        """This process collects its contiguous share of `tasks`; returns the gathered batch."""
        from accelerate.utils import gather_object

        agent = agent or self.agent
        acc = self.accelerator
        world, rank = acc.num_processes, acc.process_index
        share = math.ceil(len(tasks) / world)
        mine = list(tasks[rank * share : (rank + 1) * share])
        trajectories: list[Trajectory] = []
        error: str | None = None
        if mine:
            for attempt in range(self.config.train.rollout_retries + 1):
                try:
                    trajectories = list(agent.collect(mine, group_size, seed=_mix(seed, rank)).trajectories)
                    error = None
                    break
                except Exception as exc:  # an env or the agent failed; retried, then reported
                    error = f"process {rank}: {type(exc).__name__}: {exc}"
                    logger.warning("%s: rollout attempt %d failed on tasks %s: %s", what, attempt + 1, mine, error)
        if world > 1:
            errors = [e for e in gather_object([error]) if e]
            gathered = gather_object(trajectories)
        else:
            errors = [error] if error else []
            gathered = trajectories
        if not errors:
            failed = [t for t in gathered if t.info.get("end") == ENV_ERROR]
            if failed:
                logger.warning(
                    "%s: %d of %d episodes hit an env error and are left out of the batch, e.g. task %s: %s",
                    what, len(failed), len(gathered), failed[0].task_id, failed[0].info.get("error"),
                )
                if len(failed) == len(gathered):
                    errors = [f"every episode hit an env error, e.g. task {failed[0].task_id}: {failed[0].info.get('error')}"]
                gathered = [t for t in gathered if t.info.get("end") != ENV_ERROR]
            self.last_env_errors = len(failed)
        if errors:
            raise RolloutError(
                f"{what}: collecting rollouts on {self.config.env.id} failed after "
                f"{self.config.train.rollout_retries + 1} attempt(s): {'; '.join(errors)}. "
                f"The last checkpoint under {self.output_dir / 'checkpoints'} is intact; "
                f"fix the env and resume with resume_from=latest."
            )
        if world > 1:
            # rollout ids are unique per process; make them unique in the gathered batch.
            per_rank = gather_object([len(trajectories)])
            owners = [r for r, count in enumerate(per_rank) for _ in range(count)]
            gathered = [dataclasses.replace(t, rollout_id=f"p{r}/{t.rollout_id}", group_id=f"p{r}/{t.group_id}")
                        for r, t in zip(owners, gathered)]
        return RolloutBatch(gathered)

    # ------------------------------------------------------------------ logging

    def log(self, record: dict[str, float]) -> None:
        step = int(record["step"])
        if self.config.log.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Weights / adapter, optimizers, RNG states (accelerate) + step and config (ours)."""
        acc = self.accelerator
        final = self.checkpoint_root / f"{CHECKPOINT_PREFIX}{self.state.step}"
        partial = final.with_name(final.name + ".partial")
        if self.is_main and partial.exists():
            shutil.rmtree(partial)
        acc.wait_for_everyone()
        acc.save_state(str(partial))
        acc.wait_for_everyone()  # every process's RNG file is in `partial` before it is renamed
        if self.is_main:
            unwrapped = acc.unwrap_model(self.model)
            if hasattr(unwrapped, "peft_config"):
                unwrapped.save_pretrained(partial / "adapter")
            save_config(self.config, partial / "config.yaml")
            if final.exists():
                shutil.rmtree(final)
            # Renamed only when complete: a run killed while saving leaves the previous one intact.
            partial.rename(final)
            for old in checkpoints(self.checkpoint_root)[: -self.config.train.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def resume(self, where: str) -> None:
        """Load a checkpoint folder, or the newest one under the run folder for "latest"."""
        if where == "latest":
            found = checkpoints(self.checkpoint_root)
            if not found:
                logger.info("resume_from=latest: no checkpoint under %s, starting at step 0", self.checkpoint_root)
                return
            path = found[-1]
        else:
            path = Path(where)
            if not path.is_dir():
                raise ConfigError(f"resume_from {where!r} is not a checkpoint folder")
        self.accelerator.load_state(str(path))
        self.sync_weights()
        saved_algorithm = self.state.config.get("algorithm", {}).get("name")
        if saved_algorithm and saved_algorithm != self.algorithm.name:
            logger.warning("resuming a %s checkpoint with algorithm %s", saved_algorithm, self.algorithm.name)
        if self.is_main and self.metrics_path.exists():
            # Records past the checkpoint belong to the lost part of the run: drop them.
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= self.state.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        logger.info("resumed from %s at step %d", path, self.state.step)

    def close(self) -> None:
        for agent in (self.agent, self._eval_agent):
            if agent is not None:
                agent.close()
        if self.config.log.trackers:
            self.accelerator.end_training()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def rollout_metrics(batch: RolloutBatch, prefix: str) -> dict[str, float]:
    trajectories = batch.trajectories
    n = len(trajectories)
    if n == 0:
        return {f"{prefix}/trajectories": 0.0}
    turns = [t.num_turns for t in trajectories]
    tokens = [turn.num_response_tokens for t in trajectories for turn in t.turns]
    return {
        f"{prefix}/trajectories": float(n),
        f"{prefix}/reward_mean": float(np.mean([t.reward for t in trajectories])),
        f"{prefix}/success_rate": float(np.mean([t.success for t in trajectories])),
        f"{prefix}/truncated_rate": float(np.mean([t.truncated for t in trajectories])),
        f"{prefix}/turns_mean": float(np.mean(turns)),
        f"{prefix}/response_tokens_mean": float(np.mean(tokens)) if tokens else 0.0,
    }


def _mix(*values: int) -> int:
    """A 31-bit seed from several integers (stable across runs and processes)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1)[0] & 0x7FFFFFFF)


def _flat_hparams(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    # Trackers take flat scalars; lists and None become strings.
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_hparams(value, name + "."))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
