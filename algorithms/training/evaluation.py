"""`seeupo-eval`: avg@k and pass@k of a model or a training checkpoint on an env's tasks.

Every task gets n >= k sampled rollouts (n defaults to k). avg@k is the mean task score
over a task's rollouts; pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (c strict
successes), equal to "any of the k succeeded" when n == k. Both are reported per category
(the env's `info["category"]` when it gives one) and overall, as a markdown table on stdout
and, with --out, as JSON.

Examples:
    seeupo-eval --model embedded --env seeupo/TurnBandit-v0 --env-kwargs '{"variant": "easy"}' -k 4
    seeupo-eval --checkpoint runs/demo/seeupo/seed-0/checkpoints/step-8 -k 4 -n 8 --out eval.json
    seeupo-eval --config configs/bfcl-seeupo.yaml --split test --max-tasks 50 -k 1
    seeupo-eval --model tiny --env seeupo/TurnBandit-v0 sampling.max_new_tokens=16   # dotted overrides

Model, env and sampling settings come from (later wins): the defaults, the checkpoint's own
config.yaml or --config, dotted overrides, then the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from algorithms.config import Config, ConfigError, config_from_dict, load_config
from algorithms.metrics import Outcome, format_table, pass_at_k, summarize

logger = logging.getLogger(__name__)

DEFAULT_CATEGORY = "all"


@dataclass
class TaskResult:
    """The n rollouts of one task, reduced."""

    task_id: str
    category: str
    rollouts: int
    successes: int
    mean_score: float
    pass_at_k: float


@dataclass
class EvalResult:
    """What one evaluation measured; `summary` is `algorithms.metrics.summarize`'s table."""

    env_id: str
    env_kwargs: dict[str, Any]
    k: int
    n: int
    temperature: float
    seed: int
    summary: dict[str, dict[str, float]]
    tasks: list[TaskResult]
    outcomes: list[Outcome]
    wall_seconds: float
    generated_tokens: int
    model: str = ""
    checkpoint: str | None = None
    rollouts: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def avg_at_k(self) -> float:
        return self.summary["overall"][f"avg@{self.k}"]

    @property
    def pass_at_k(self) -> float:
        return self.summary["overall"][f"pass@{self.k}"]

    def table(self) -> str:
        return format_table(self.summary)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "checkpoint": self.checkpoint,
            "env": self.env_id,
            "env_kwargs": self.env_kwargs,
            "k": self.k,
            "n": self.n,
            "temperature": self.temperature,
            "seed": self.seed,
            "summary": self.summary,
            "tasks": [dataclasses.asdict(task) for task in self.tasks],
            "wall_seconds": self.wall_seconds,
            "generated_tokens": self.generated_tokens,
        }


# --------------------------------------------------------------------------- tasks and outcomes


def trajectory_category(trajectory: Any) -> str:
    """The category the env reported for the episode (BFCL: base, miss_func, ...), else "all"."""
    env_info = trajectory.info.get("env_info") or {}
    category = env_info.get("category")
    return str(category) if category else DEFAULT_CATEGORY


def reduce_tasks(outcomes: Sequence[Outcome], k: int) -> list[TaskResult]:
    by_task: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_task.setdefault(outcome.task_id, []).append(outcome)
    return [
        TaskResult(
            task_id=task_id,
            category=rollouts[0].category,
            rollouts=len(rollouts),
            successes=sum(o.success for o in rollouts),
            mean_score=sum(o.score for o in rollouts) / len(rollouts),
            pass_at_k=pass_at_k(len(rollouts), sum(o.success for o in rollouts), k),
        )
        for task_id, rollouts in by_task.items()
    ]


# --------------------------------------------------------------------------- evaluation


def evaluate_policy(
    backend: Any,
    tokenizer: Any,
    env_id: str,
    task_ids: Sequence[str],
    *,
    k: int,
    n: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    seed: int = 0,
    num_envs: int = 8,
    max_context_tokens: int = 8192,
    env_kwargs: dict[str, Any] | None = None,
    progress: bool = False,
    keep_rollouts: bool = False,
    desc: str = "eval",
) -> EvalResult:
    """n rollouts of every task with `backend` (a `agents.backends` Backend); avg@k and pass@k.

    Tasks are collected in chunks of about four env-loads of episodes so a progress bar can
    move; a chunk's seed is derived from (seed, chunk index), so the same arguments give the
    same rollouts.
    """
    from tqdm.auto import tqdm

    from agents.backends import SamplingParams
    from agents.vector import VectorAgent, derive_seed

    n = k if n is None else n
    if k < 1 or n < k:
        raise ValueError(f"need 1 <= k <= n rollouts per task, got k={k}, n={n}")
    tasks = list(task_ids)
    if not tasks:
        raise ValueError("no tasks to evaluate")
    env_kwargs = dict(env_kwargs or {})
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    chunk = max(1, math.ceil(4 * num_envs / n))
    outcomes: list[Outcome] = []
    rollouts: list[dict[str, Any]] = []
    tokens = 0
    started = time.perf_counter()
    with VectorAgent(
        env_id,
        backend,
        tokenizer,
        num_envs=num_envs,
        sampling=sampling,
        max_context_tokens=max_context_tokens,
        env_kwargs=env_kwargs,
    ) as agent, tqdm(total=len(tasks), desc=desc, unit="task", disable=not progress, leave=False) as bar:
        for index, begin in enumerate(range(0, len(tasks), chunk)):
            part = tasks[begin : begin + chunk]
            batch = agent.collect(part, n, seed=derive_seed(seed, index))
            tokens += agent.last_stats.generated_tokens
            for trajectory in batch:
                category = trajectory_category(trajectory)
                outcomes.append(Outcome(trajectory.task_id, float(trajectory.reward), bool(trajectory.success), category))
                if keep_rollouts:
                    rollouts.append(
                        {
                            "task_id": trajectory.task_id,
                            "rollout_id": trajectory.rollout_id,
                            "category": category,
                            "reward": float(trajectory.reward),
                            "success": bool(trajectory.success),
                            "truncated": bool(trajectory.truncated),
                            "turns": trajectory.num_turns,
                            "end": trajectory.info.get("end"),
                            "actions": trajectory.info.get("actions", []),
                        }
                    )
            bar.update(len(part))
    return EvalResult(
        env_id=env_id,
        env_kwargs=env_kwargs,
        k=k,
        n=n,
        temperature=temperature,
        seed=seed,
        summary=summarize(outcomes, k),
        tasks=reduce_tasks(outcomes, k),
        outcomes=outcomes,
        wall_seconds=time.perf_counter() - started,
        generated_tokens=tokens,
        rollouts=rollouts,
    )


def load_policy(config: Config, checkpoint: str | Path | None = None) -> tuple[Any, Any]:
    """The config's model, with a checkpoint's weights when given (LoRA adapter or full weights)."""
    import torch

    from agents.models import load_model

    model, tokenizer = load_model(config.model.name_or_path, dtype=config.model.dtype, seed=config.train.seed)
    if checkpoint is None:
        return model, tokenizer
    folder = Path(checkpoint)
    if (folder / "adapter").is_dir():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder / "adapter")
        model.eval()
        return model, tokenizer
    weights = folder / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"checkpoint {str(folder)!r} holds neither adapter/ nor model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; every other missing or extra key means the wrong model.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(
            f"checkpoint {str(folder)!r} does not fit model {config.model.name_or_path!r}: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if tied:
        model.tie_weights()
    model.eval()
    return model, tokenizer


def resolve_config(
    config_path: str | None, checkpoint: str | None, overrides: Sequence[str]
) -> Config:
    """Defaults < checkpoint's config.yaml (or --config) < dotted overrides."""
    if checkpoint is not None:
        saved = Path(checkpoint) / "config.yaml"
        if not Path(checkpoint).is_dir():
            raise ConfigError(f"checkpoint {checkpoint!r} is not a folder (expected e.g. runs/x/checkpoints/step-10)")
        if config_path is None and saved.is_file():
            config_path = str(saved)
    config = load_config(config_path, overrides)
    # A checkpoint's config may carry resume_from; evaluation never resumes training.
    config.resume_from = None
    return config


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-eval",
        description="avg@k and unbiased pass@k of a model or checkpoint on an env's tasks, per category.",
    )
    source = parser.add_argument_group("what to evaluate")
    source.add_argument("--checkpoint", help="a trainer checkpoint folder (runs/<run>/checkpoints/step-N)")
    source.add_argument("--config", help="YAML trainer config for the model / env / sampling settings")
    source.add_argument("--model", help="'embedded', 'tiny', a Hugging Face id or a local path (model.name_or_path)")
    source.add_argument("--env", help="env id, e.g. seeupo/TurnBandit-v0 (env.id)")
    source.add_argument("--env-kwargs", type=json.loads, default=None, help="JSON merged into env.kwargs, e.g. '{\"split\": \"test\"}'")
    source.add_argument("--split", help="the env's task split, e.g. test (sets env.kwargs.split; BFCL, AppWorld)")
    source.add_argument("--tasks", help="comma-separated task ids (default: env.eval_tasks, else all of the env's tasks)")
    source.add_argument("--max-tasks", type=int, help="evaluate only the first N tasks")
    metric = parser.add_argument_group("how")
    metric.add_argument("-k", type=int, default=1, help="k of avg@k / pass@k (default 1)")
    metric.add_argument("-n", type=int, help="rollouts per task, >= k (default k); n > k lowers the variance of pass@k")
    metric.add_argument("--temperature", type=float, help="sampling temperature (default: sampling.temperature)")
    metric.add_argument("--max-new-tokens", type=int, help="tokens per response (default: sampling.max_new_tokens)")
    metric.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    metric.add_argument("--num-envs", type=int, help="envs stepped together (default: env.num_envs)")
    output = parser.add_argument_group("output")
    output.add_argument("--out", help="write the result as JSON to this file")
    output.add_argument("--rollouts", help="write one JSON line per rollout (task, reward, actions) to this file")
    output.add_argument("--json", action="store_true", help="print JSON instead of the table")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. env.kwargs.variant=easy")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = resolve_config(args.config, args.checkpoint, args.overrides)
        if args.model:
            config.model.name_or_path = args.model
        if args.env:
            config.env.id = args.env
        if args.env_kwargs is not None:
            if not isinstance(args.env_kwargs, dict):
                raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
            config.env.kwargs = {**config.env.kwargs, **args.env_kwargs}
        if args.split:
            config.env.kwargs = {**config.env.kwargs, "split": args.split}
        config = config_from_dict(config.to_dict())  # re-check the values the flags set
        if args.tasks:
            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        else:
            from algorithms.trainer import env_task_ids

            tasks = list(config.env.eval_tasks or env_task_ids(config.env.id, config.env.kwargs))
        if args.max_tasks is not None:
            if args.max_tasks < 1:
                raise ConfigError(f"--max-tasks must be >= 1, got {args.max_tasks}")
            tasks = tasks[: args.max_tasks]
        n = args.n if args.n is not None else args.k
        if args.k < 1 or n < args.k:
            raise ConfigError(f"need 1 <= k <= n, got k={args.k}, n={n}")
        model, tokenizer = load_policy(config, args.checkpoint)
    except ConfigError as error:
        print(f"seeupo-eval: {error}", file=sys.stderr)
        return 2
    from agents.backends import HFBackend

    result = evaluate_policy(
        HFBackend(model, tokenizer),
        tokenizer,
        config.env.id,
        tasks,
        k=args.k,
        n=n,
        temperature=config.sampling.temperature if args.temperature is None else args.temperature,
        top_p=config.sampling.top_p,
        max_new_tokens=args.max_new_tokens or config.sampling.max_new_tokens,
        seed=args.seed,
        num_envs=args.num_envs or config.env.num_envs,
        max_context_tokens=config.env.max_context_tokens,
        env_kwargs=config.env.kwargs,
        progress=not args.no_progress,
        keep_rollouts=bool(args.rollouts),
    )
    result.model = config.model.name_or_path
    result.checkpoint = args.checkpoint
    data = result.to_dict()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2, default=str) + "\n")
    if args.rollouts:
        Path(args.rollouts).parent.mkdir(parents=True, exist_ok=True)
        with open(args.rollouts, "w") as f:
            for record in result.rollouts:
                f.write(json.dumps(record, default=str) + "\n")
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(f"{result.model}{' @ ' + args.checkpoint if args.checkpoint else ''} on {result.env_id} "
              f"{result.env_kwargs}: {len(result.tasks)} tasks x {n} rollouts, T={result.temperature}, "
              f"{result.wall_seconds:.1f} s")
        print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
