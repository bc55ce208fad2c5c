"""One trainer for every algorithm: rollout -> update -> eval -> log -> checkpoint.

The trainer owns the policy (model, optional LoRA, reference, optional value model, optimizers;
see `policy.py`), the generation backend and the vectorized agent; the algorithm is looked up
by name and owns the whole update step. Nothing here knows which algorithm runs.

Distribution comes from accelerate's own configuration (`accelerate launch`): each process
collects its share of the step's tasks, the trajectories are gathered so every process holds
the whole batch (`collection.py`), and the algorithm runs the same update everywhere while the
learner splits the forward work (`learner.py`). Batch-level statistics such as batch
normalization of advantages are therefore over the global batch, exactly as in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.algorithms.base import Algorithm, UpdateSelection, algorithm_class, load_plugin
from seeupo_gym.algorithms.budget import CountingLearner
from seeupo_gym.training import checkpoint as ckpt
from seeupo_gym.training.collection import RolloutError, collect, rollout_metrics
from seeupo_gym.training.config import (
    Config,
    ConfigError,
    check_group_size,
    config_from_dict,
    load_config,
    parse_dataclass,
    save_config,
)
from seeupo_gym.training.interrupts import Interrupts
from seeupo_gym.training.memory_plan import check_device_request, device_check
from seeupo_gym.training.overlap import OverlappedCollection, drop_stale, staleness_metrics
from seeupo_gym.training.rollouts import RolloutLog
from seeupo_gym.training.run_files import open_run_file, write_run_text
from seeupo_gym.training.tasks import agent_options, eval_env_kwargs, eval_task_ids, train_task_ids

logger = logging.getLogger(__name__)

__all__ = ["RolloutError", "Trainer", "TrainerState", "build_algorithm", "check_trackers"]

# Purposes mixed into derive_seed(seed, step, purpose): independent streams per step.
_ROLLOUT, _UPDATE, _EVAL = 0, 1, 2


@dataclasses.dataclass
class TrainerState:
    """The trainer's own part of a checkpoint, in its trainer_state.json (accelerate saves weights,
    optimizers and RNGs)."""

    step: int = 0
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "config": self.config, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.config = dict(state.get("config", {}))
        self.run_id = state.get("run_id")


def _sharded(accelerator: Any) -> bool:
    """Whether the policy's weights are split over the processes (FSDP, DeepSpeed)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


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
        cls = algorithm_class(config.algorithm.name)
    except ValueError as error:
        hint = " (an algorithm of your own: load the file that registers it with --plugin FILE, or list it under plugins:)"
        raise ConfigError(f"algorithm: {error}{hint}") from error
    check_group_size(config, cls)
    # The options typed like the rest of the config: `algorithm.kl_coef=1e-3` is a float.
    selection = UpdateSelection(truncated=config.train.truncated, drop_flat_groups=config.train.drop_flat_groups)
    return cls(parse_dataclass(cls.config_class, config.algorithm.options, "algorithm"), selection=selection)


def check_trackers(trackers: Sequence[str]) -> None:
    """Every tracker in log.trackers is one accelerate knows and is installed.

    accelerate itself drops an uninstalled tracker with a debug message: a run would log nothing
    to it, silently.
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    installed = {str(t) for t in get_available_trackers()}
    for name in trackers:
        if name == "all":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ConfigError(f"log.trackers: unknown tracker {name!r}; accelerate knows {sorted(LOGGER_TYPE_TO_CLASS)}")
        if name not in installed:
            raise ConfigError(
                f"log.trackers: {name!r} is not installed in this environment; install it (pip install {name}) "
                "or leave it out (log.trackers=[] logs to metrics.jsonl only)"
            )


class Trainer:
    """Train a policy on an env with a registered algorithm.

    >>> Trainer("tiny-cpu").train()                                    # doctest: +SKIP
    >>> Trainer(load_config("tiny-cpu", ["algorithm.name=grpo"])).train()  # doctest: +SKIP
    """

    def __init__(self, config: Config | dict[str, Any] | str | Path, *, accelerator: Any = None) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed

        import seeupo_gym  # noqa: F401  (registers the env ids; cheap)

        from seeupo_gym.training.policy import build_policy

        self.config = config = _as_config(config)
        self.algorithm = build_algorithm(config)
        check_trackers(config.log.trackers)
        self.output_dir = Path(config.log.output_dir)
        # The device and engine the config needs, before anything is built (one line if missing).
        check_device_request(config)

        if accelerator is None:
            accelerator = Accelerator(
                # Launched as several processes (`accelerate launch --multi_gpu`, torchrun) on a
                # machine without GPUs: accelerate runs them as MULTI_CPU (gloo) only when told cpu.
                cpu=config.train.device == "cpu" or (bool(os.environ.get("LOCAL_RANK")) and not torch.cuda.is_available()),
                log_with=list(config.log.trackers) or None,
                project_config=ProjectConfiguration(project_dir=str(self.output_dir), logging_dir=str(self.output_dir / "logs")),
                # The models have no trained buffers: broadcasting them would add a collective
                # to every forward for nothing.
                kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
            )
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        if self.is_main:
            logger.info("accelerate: %s, %d process(es), device %s", accelerator.distributed_type,
                        accelerator.num_processes, accelerator.device)
        # Does the learner fit this device? Refused in one line before any weight loads, and before
        # a run folder is made (memory_plan.py).
        device_check(config, device=accelerator.device.type, index=accelerator.device.index,
                     processes=accelerator.num_processes, sharded=_sharded(accelerator),
                     needs_value_model=self.algorithm.needs_value_model)
        set_seed(config.train.seed)
        run_id, self._resume_path = self._open_run_folder()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.output_dir / "config.yaml")

        env = config.env
        self.train_tasks = train_task_ids(env)
        self.eval_tasks = eval_task_ids(env)

        policy = build_policy(config, accelerator, needs_value_model=self.algorithm.needs_value_model)
        self.model, self.tokenizer, self.learner = policy.model, policy.tokenizer, policy.learner
        # Saved beside accelerate's state as JSON (`checkpoint.py`), never registered with accelerate (a pickle).
        self.state = TrainerState(step=0, config=config.to_dict(), run_id=run_id)
        if config.log.trackers:
            accelerator.init_trackers(config.log.project_name, config=_flat_hparams(config.to_dict()))

        self.last_checkpoint: Path | None = None  # the newest checkpoint this trainer wrote
        self._interrupts: Interrupts | None = None  # while train() runs
        self.backend = self._make_backend()
        self.agent: Any = None
        try:
            self.agent = self._make_agent(env.kwargs)
            self.last_env_errors = 0
            self._overlap: OverlappedCollection | None = None  # train.max_staleness > 0: started at the first step
            self.metrics_path = self.output_dir / ckpt.METRICS_FILE
            self.rollout_log = RolloutLog(self.output_dir, self.tokenizer) if self.is_main and config.log.rollouts else None
            if self._resume_path is not None:
                self.resume(self._resume_path)
            elif config.resume_from is not None:
                logger.info("resume_from=latest: no checkpoint under %s, starting at step 0", self.checkpoint_root)
        except BaseException:
            # No `with` will close what is built so far (e.g. the server generation.serve started).
            if self.agent is not None:
                self.agent.close()
            self.backend.close()
            raise

    def _open_run_folder(self) -> tuple[str, Path | None]:
        """The run id and the checkpoint to resume (`checkpoint.open_run_folder`, which refuses to mix
        runs), decided by the main process and written to the folder's run_id.json."""
        from accelerate.utils import broadcast_object_list

        outcome: list[Any] = [None]
        if self.is_main:
            try:
                run_id, path = ckpt.open_run_folder(self.output_dir, self.config.resume_from)
                previous = ckpt.run_id_of(path) if path is not None else None
                ckpt.write_run_file(self.output_dir, run_id, **({"forked_from": str(path)} if previous not in (None, run_id) else {}))
                outcome = [(run_id, None if path is None else str(path))]
            except ConfigError as error:
                outcome = [error]
        if self.accelerator.num_processes > 1:
            outcome = broadcast_object_list(outcome)
        if isinstance(outcome[0], ConfigError):
            raise outcome[0]
        run_id, path = outcome[0]
        return run_id, None if path is None else Path(path)

    # ------------------------------------------------------------------ construction

    def _make_backend(self) -> Any:
        """The generation engine of `generation.backend`, built by its class from the run's
        settings and holding the learner's current weights."""
        from seeupo_gym.agents.backends import TrainingSetup, backend_class

        config, acc = self.config, self.accelerator
        setup = TrainingSetup(
            model_name=config.model.name_or_path,
            dtype=config.model.dtype,
            seed=config.train.seed,
            lora_rank=config.model.lora.r if config.model.lora is not None else None,
            max_context_tokens=config.env.max_context_tokens,
            processes=acc.num_processes,
            sharded=_sharded(acc),
            # output_dir: the run folder, for the backend's own files (e.g. the log of a server it starts).
            options={**dataclasses.asdict(config.generation), "output_dir": str(self.output_dir)},
        )
        try:
            return backend_class(config.generation.backend).for_training(acc.unwrap_model(self.model), self.tokenizer, setup)
        except ValueError as error:
            raise ConfigError(f"generation.backend={config.generation.backend}: {error}") from error

    def _make_agent(self, env_kwargs: dict[str, Any]) -> Any:
        from seeupo_gym.agents.backends.base import SamplingParams
        from seeupo_gym.agents.vector import VectorAgent

        env, s = self.config.env, self.config.sampling
        try:
            return VectorAgent(
                env.id,
                self.backend,
                self.tokenizer,
                num_envs=env.num_envs,
                sampling=SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p),
                max_context_tokens=env.max_context_tokens,
                env_kwargs=dict(env_kwargs),
                **agent_options(env),
            )
        except Exception as error:
            raise ConfigError(f"env {env.id!r} with kwargs {env_kwargs}: cannot start the agent's envs: {error}") from error

    # ------------------------------------------------------------------ the loop

    def train(
        self, on_step: Callable[["Trainer", dict[str, float]], None] | None = None, *, save_at_end: bool = True
    ) -> list[dict[str, float]]:
        """Run to `train.steps`; returns this run's metric records (train and eval).

        on_step(trainer, record) runs after every step's own eval and checkpoint (e.g. to evaluate
        a comparison's way); an exception there ends the run like any other, after a checkpoint.
        save_at_end=False skips the final checkpoint (seeupo-compare keeps none unless asked);
        a failure still saves one.
        """
        cfg = self.config.train
        records: list[dict[str, float]] = []
        bar = tqdm(
            total=cfg.steps,
            initial=self.state.step,
            desc=f"train {self.algorithm.name}",
            disable=not (self.is_main and self.config.log.progress_bars),
        )
        saved_at = -1
        interrupts = self._interrupts = Interrupts()
        try:
            with interrupts:
                while self.state.step < cfg.steps:
                    record = self.train_step()
                    records.append(record)
                    bar.update(1)
                    bar.set_postfix(reward=f"{record.get('rollout/reward_mean', float('nan')):.3f}")
                    step = self.state.step
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        records.append(self.evaluate())
                    if (cfg.save_every and step % cfg.save_every == 0) or (save_at_end and step == cfg.steps):
                        with interrupts.held():
                            self.save_checkpoint()
                            saved_at = step
                    if on_step is not None:
                        on_step(self, record)
        except Exception:
            # Keep the steps done so far: the run resumes from here once the cause is fixed.
            if self.state.step > 0 and saved_at != self.state.step:
                self.save_checkpoint()
            raise
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM (`interrupts.py`): the step in progress is dropped, the last finished
            # one kept, whatever train.save_every says; further signals wait for the checkpoint.
            # With several processes the others may be inside a collective: no checkpoint then.
            if self.state.step > 0 and saved_at != self.state.step and self.accelerator.num_processes == 1:
                with Interrupts() as waiting, waiting.ignored():
                    self.save_checkpoint()
            raise
        finally:
            self._interrupts = None
            bar.close()
        return records

    def train_step(self) -> dict[str, float]:
        """Collect one batch, update once, sync weights, log. Returns the step's metrics."""
        cfg = self.config.train
        step = self.state.step + 1
        started = time.perf_counter()
        overlapped = cfg.max_staleness > 0
        try:
            if overlapped:
                if self._overlap is None:
                    self._overlap = self._start_overlap()
                collected, _ = self._overlap.take(step)
            else:
                collected = self._collect_step(step)
        except RolloutError as error:
            raise RolloutError(
                f"{error} (env {self.config.env.id}). The last checkpoint under {self.checkpoint_root} is intact; "
                f"fix the env and resume with resume_from=latest."
            ) from error
        failed = [t for t in collected.batch if t.info.get("end") == "backend_error"]
        if failed and len(failed) == len(collected.batch):  # nothing to learn from: a dead server, not a bad policy
            raise RolloutError(f"step {step}: every episode ({len(failed)}) ended with backend_error, the model server "
                               f"giving no usable reply; first: {failed[0].info.get('error')}")
        # From here the step changes the weights: a signal waits for the step to end (`interrupts.py`).
        with self._interrupts.held() if self._interrupts is not None else contextlib.nullcontext():
            return self._learn_step(step, collected, started)

    def _learn_step(self, step: int, collected: Any, started: float) -> dict[str, float]:
        """The update, weight sync and logging of a collected step."""
        cfg = self.config.train
        overlapped = cfg.max_staleness > 0
        batch, self.last_env_errors = collected.batch, collected.env_errors
        self.algorithm.schedule = []  # what this step's update does with each episode, for the rollout log
        collected_at = time.perf_counter()

        record: dict[str, float] = {"step": float(step), **rollout_metrics(batch, prefix="rollout")}
        record["rollout/env_errors"] = float(self.last_env_errors)
        if overlapped:
            record.update(staleness_metrics(batch, step - 1, prefix="rollout"))
            batch, dropped = drop_stale(batch, step - 1, cfg.max_staleness)  # never older than the bound
            record["rollout/stale_dropped"] = float(dropped)
        # The algorithm leaves out what it must not learn from (never-started episodes, train.truncated,
        # train.drop_flat_groups) and counts it in its metrics.
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, step, _UPDATE))
        if not overlapped:  # an overlapped collection keeps sampling through the update
            self._release_generation_memory()
        counted = CountingLearner(self.learner)  # what the update spent, whichever algorithm it is
        metrics = self.algorithm.update(batch, counted, generator)
        record.update({f"update/{k}": float(v) for k, v in metrics.items()})
        record.update({f"budget/{k}": v for k, v in counted.budget().as_metrics().items()})
        record["budget/skipped_steps"] = float(counted.skipped_steps)
        if metrics.get("skipped_empty_batch"):
            logger.warning("step %d: no trajectories to learn from; skipping the update", step)
        elif not overlapped:
            self.sync_weights()
        if overlapped:
            assert self._overlap is not None
            self._overlap.publish(step, self._weights_snapshot())
        record["time/rollout_s"] = collected_at - started
        record["time/update_s"] = time.perf_counter() - collected_at
        if self.rollout_log is not None:
            self.rollout_log.write(collected.batch, step=step, schedule=self.algorithm.schedule)
        self.state.step = step
        self.log(record)
        return record

    def _collect_step(self, step: int) -> Any:
        cfg = self.config.train
        return collect(
            self.accelerator, self.agent, self.tasks_for_step(step), cfg.group_size,
            seed=derive_seed(cfg.seed, step, _ROLLOUT), retries=cfg.rollout_retries, what=f"step {step}",
        )

    def _start_overlap(self) -> OverlappedCollection:
        """The collector thread of `train.max_staleness` > 0 (see `overlap.py`), with its own sampler."""
        cfg, generation = self.config.train, self.config.generation
        if self.accelerator.num_processes > 1:
            raise ConfigError("train.max_staleness > 0 runs in one training process; set it to 0 with several")
        if cfg.importance_cap <= 0:
            raise ConfigError(f"train.importance_cap must be > 0, got {cfg.importance_cap}")
        try:
            sampler = self.backend.overlapped_sampler()
        except (NotImplementedError, ValueError) as error:
            raise ConfigError(f"train.max_staleness > 0 with generation.backend={generation.backend}: {error}") from error
        self.agent.backend = sampler
        self.learner.behaviour_cap = cfg.importance_cap

        def collect_step(step: int, version: int) -> Any:
            self.agent.policy_version = version
            return self._collect_step(step)

        overlap = OverlappedCollection(
            collect_step, sampler.update_weights, max_staleness=cfg.max_staleness,
            first_step=self.state.step + 1, last_step=cfg.steps, start_version=self.state.step,
        )
        overlap.publish(self.state.step, self._weights_snapshot())  # to reload after a shared engine evaluated
        return overlap

    def _weights_snapshot(self) -> dict[str, torch.Tensor]:
        # A copy: the learner goes on changing its own tensors while the sampler loads these.
        return {k: v.detach().clone() for k, v in self.accelerator.unwrap_model(self.model).state_dict().items()}

    def sync_weights(self) -> None:
        """Push the learner's weights (or LoRA adapter) into the generation backend; runs after every update."""
        self.backend.update_weights(self.accelerator.unwrap_model(self.model))

    def _release_generation_memory(self) -> None:
        # A colocated engine may sleep through the update; the next generate or sync wakes it.
        self.backend.release_memory()

    def evaluate(
        self,
        tasks: Sequence[str] | None = None,
        *,
        k: int = 1,
        n: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
        progress: bool = False,
    ) -> dict[str, float]:
        """avg@k / pass@k with the current weights (`evaluation.evaluate_policy`), logged under eval/.

        Defaults: the config's eval tasks (`train.eval_tasks_per_eval` of them), one rollout each at
        `train.eval_temperature`, in the eval env (`env.eval_kwargs`). Runs on the main process.
        """
        from accelerate.utils import broadcast_object_list

        from seeupo_gym.training.evaluation import eval_record, evaluate_policy

        cfg, env, sampling = self.config.train, self.config.env, self.config.sampling
        record: dict[str, float] | None = None
        # An engine shared with an overlapped collection (the sampler is the backend itself) evaluates
        # between two collections.
        shared = self._overlap is not None and self.agent.backend is self.backend
        if self.is_main:
            with self._overlap.paused(reload=True) if shared else contextlib.nullcontext():  # type: ignore[union-attr]
                if shared:
                    self.sync_weights()  # the learner's weights; the collector reloads its own afterwards
                result = evaluate_policy(
                    self.backend,
                    self.tokenizer,
                    env.id,
                    list(tasks) if tasks is not None else self.eval_tasks[: cfg.eval_tasks_per_eval],
                    k=k,
                    n=n,
                    temperature=cfg.eval_temperature if temperature is None else temperature,
                    top_p=sampling.top_p,
                    max_new_tokens=sampling.max_new_tokens,
                    seed=derive_seed(cfg.seed, self.state.step, _EVAL) if seed is None else seed,
                    num_envs=env.num_envs,
                    max_context_tokens=env.max_context_tokens,
                    env_kwargs=eval_env_kwargs(env, env_kwargs),
                    agent_options=agent_options(env),
                    progress=progress,
                    desc=f"eval step {self.state.step}",
                )
            record = eval_record(result, self.state.step)
        if self.accelerator.num_processes > 1:
            record = broadcast_object_list([record])[0]
        assert record is not None
        self.log(record)
        return record

    def tasks_for_step(self, step: int) -> list[str]:
        """The step's B tasks: a function of (seed, step) alone, so a resumed run draws the same."""
        rng = np.random.default_rng([self.config.train.seed, step])
        count = self.config.train.tasks_per_step
        replace = count > len(self.train_tasks)
        picks = rng.choice(len(self.train_tasks), size=count, replace=replace)
        return [self.train_tasks[i] for i in picks]

    # ------------------------------------------------------------------ logging

    def log(self, record: dict[str, float]) -> None:
        step = int(record["step"])
        if self.config.log.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self.is_main:
            with open_run_file(self.metrics_path, "a") as f:
                f.write(json.dumps({**record, "run_id": self.state.run_id}) + "\n")

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / ckpt.CHECKPOINTS_FOLDER

    def save_checkpoint(self) -> Path:
        """See `checkpoint.py`: resumable state plus a folder in Hugging Face form (peft adapters too)."""
        self.last_checkpoint = ckpt.save_checkpoint(
            self.accelerator, self.model, self.tokenizer, self.config, self.checkpoint_root, self.state.step,
            run_id=self.state.run_id,
            # The algorithm's own state: e.g. the adaptive KL coefficient of use_kl_in_reward.
            trainer_state={"trainer": self.state.state_dict(), "algorithm": self.algorithm.state_dict()},
        )
        return self.last_checkpoint

    def resume(self, path: Path) -> None:
        """Load a checkpoint folder (chosen and checked by `_open_run_folder`); the run keeps its own id."""
        run_id = self.state.run_id
        saved = ckpt.load_checkpoint(self.accelerator, path)
        try:
            self.state.load_state_dict(saved["trainer"])
            if saved.get("algorithm"):
                self.algorithm.load_state_dict(saved["algorithm"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigError(f"checkpoint {str(path)!r}: {ckpt.TRAINER_STATE_FILE} does not fit this trainer: "
                              f"{type(error).__name__}: {error}") from error
        self.state.run_id = run_id
        self.sync_weights()
        saved_section = self.state.config.get("algorithm")
        saved_algorithm = saved_section.get("name") if isinstance(saved_section, dict) else None
        if saved_algorithm and saved_algorithm != self.algorithm.name:
            logger.warning("resuming a %s checkpoint with algorithm %s", saved_algorithm, self.algorithm.name)
        if self.is_main and self.metrics_path.exists():
            # Records past the checkpoint belong to the lost part of the run: drop them.
            kept = [line for line in self.metrics_path.read_text().splitlines() if _record_step(line) <= self.state.step]
            write_run_text(self.metrics_path, "".join(line + "\n" for line in kept))
        if self.rollout_log is not None:
            self.rollout_log.truncate(self.state.step)
        logger.info("resumed from %s at step %d", path, self.state.step)

    def close(self) -> None:
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None
        self.agent.close()
        self.backend.close()
        if self.config.log.trackers:
            self.accelerator.end_training()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf (dropped on resume) for a blank or damaged one."""
    try:
        record = json.loads(line)
        return float(record.get("step", 0)) if isinstance(record, dict) else math.inf
    except (ValueError, TypeError):
        return math.inf


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
