"""The one evaluation of the project: avg@k and pass@k of a policy on an env's tasks.

Used by the trainer, `seeupo-eval` and `seeupo-compare`. Every task gets n >= k sampled
rollouts (n defaults to k). avg@k is the mean task score over a task's rollouts; pass@k is
the unbiased estimator 1 - C(n-c, k) / C(n, k) (c strict successes), equal to "any of the k
succeeded" when n == k. Both are reported per category (the env's `info["category"]` when it
gives one) and overall.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from seeupo_gym.agents.backends.progress import TurnProgress
from seeupo_gym.training.metrics import Outcome, format_table, pass_at_k, summarize

logger = logging.getLogger(__name__)

DEFAULT_CATEGORY = "all"

# --------------------------------------------------------------------------- how long it may take

# Tokens a CPU process generates per second, times the model's parameter count: the embedded
# 0.5B model decodes ~0.9 token per CPU-second, the tiny one ~30 (its 152k-entry LM head
# dominates), both measured by scripts/bench_rollout.py; 3e8 / parameters errs on the slow side.
CPU_TOKEN_RATE = 3e8
# Parameters of the named models, to estimate before loading them.
KNOWN_PARAMETERS = {"tiny": 9.8e6, "embedded": 4.94e8}
# A run estimated past this many seconds on a CPU gets a one-line warning.
LONG_RUN_S = 600.0
# Turns per episode when the env kwargs do not say (the envs' own default).
DEFAULT_MAX_TURNS = 10


def token_budget(episodes: int, max_turns: int, max_new_tokens: int) -> int:
    """The most tokens `episodes` episodes can generate: every turn uses its whole budget."""
    return episodes * max_turns * max_new_tokens


def episode_turns(env_kwargs: dict[str, Any]) -> int:
    turns = env_kwargs.get("max_turns")
    return turns if isinstance(turns, int) and turns > 0 else DEFAULT_MAX_TURNS


def cpu_tokens_per_second(parameters: float) -> float:
    return CPU_TOKEN_RATE / max(parameters, 1.0)


def long_run_warning(what: str, tokens: int, tokens_per_second: float, *, on_cpu: bool, hint: str) -> str | None:
    """One line when generating `tokens` at `tokens_per_second` on a CPU may pass LONG_RUN_S; else None."""
    seconds = tokens / tokens_per_second
    if not on_cpu or seconds <= LONG_RUN_S:
        return None
    return (f"{what}: warning: up to ~{_duration(seconds)} on this CPU ({tokens:,} tokens at most, if every turn "
            f"uses its whole budget, at ~{tokens_per_second:.3g} tokens/s); {hint}")


def pace_warning(what: str, done: int, total: int, elapsed_s: float) -> str | None:
    """One line when the tasks left, at the pace of the `done` first ones, may pass LONG_RUN_S; else None.
    A measured estimate, unlike the token-budget bound (most responses end before their budget)."""
    if done <= 0 or done >= total:
        return None
    left = elapsed_s / done * (total - done)
    if left <= LONG_RUN_S:
        return None
    return f"{what}: warning: at the pace of the first {done} of {total} tasks, about {_duration(left)} more"


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


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
    # Episodes a remote model server ended (no usable reply after retries), scored as failures:
    # how many, and "<rollout id>: <error>" for each.
    backend_errors: int = 0
    backend_error_episodes: list[str] = field(default_factory=list)
    # Tool calls a chat server sent to an env in the ReAct format, which reads only the text.
    dropped_tool_calls: int = 0

    @property
    def all_failed_on_the_server(self) -> bool:
        """Every episode ended because the model server did not answer: the scores measure nothing."""
        return bool(self.outcomes) and self.backend_errors == len(self.outcomes)

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
            "backend_errors": self.backend_errors,
            "backend_error_episodes": self.backend_error_episodes,
            "dropped_tool_calls": self.dropped_tool_calls,
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
    agent_options: dict[str, Any] | None = None,
    warn_slow: str | None = None,
) -> EvalResult:
    """n rollouts of every task with `backend` (a `agents.backends` Backend); avg@k and pass@k.

    Tasks are collected in chunks of about four env-loads of episodes so a progress bar can
    move; a chunk's seed is derived from (seed, chunk index), so the same arguments give the
    same rollouts. `agent_options`: more VectorAgent keyword arguments (vectorization, schedule,
    workers, url, worker_options; `training.tasks.agent_options` of a config). `warn_slow`: a
    program name; after the first chunk, a `pace_warning` under that name when the rest looks long.
    """
    from tqdm.auto import tqdm

    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.seeding import derive_seed
    from seeupo_gym.agents.vector import VectorAgent

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
    backend_errors: list[str] = []
    dropped = [0]

    def record(batch: Any) -> None:
        for trajectory in batch:
            category = trajectory_category(trajectory)
            outcomes.append(Outcome(trajectory.task_id, float(trajectory.reward), bool(trajectory.success), category))
            dropped[0] += int(trajectory.info.get("dropped_tool_calls", 0))
            if trajectory.info.get("end") == "backend_error":
                backend_errors.append(f"{trajectory.rollout_id}: {trajectory.info.get('error', 'no reply')}")
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

    def after_chunk(index: int, done: int) -> None:
        bar.set_postfix_str(f"{done}/{len(tasks)} tasks done")
        warning = pace_warning(warn_slow, done, len(tasks), time.perf_counter() - started) if warn_slow and index == 0 else None
        if warning:
            tqdm.write(warning, file=sys.stderr)

    chat = getattr(backend, "mode", None) == "chat"
    # Token backends: the bar counts tokens against the budget, so it moves every turn and its ETA
    # (the budget left at the pace so far) bounds the time left; the unused budget of episodes that
    # ended early is counted when their chunk ends. Chat backends: episodes.
    per_episode = 1 if chat else token_budget(1, episode_turns(env_kwargs), max_new_tokens)
    bar = tqdm(total=len(tasks) * n * per_episode, desc=desc, unit="episode" if chat else "tok", unit_scale=not chat,
               disable=not progress, leave=False, dynamic_ncols=True)
    if chat:  # a model behind a chat API: messages, not tokens
        from seeupo_gym.agents.chat_agent import collect_chat

        replies = 0

        def on_turn(reply: Any) -> None:
            nonlocal replies
            replies += 1
            # Redrawn now: a chat episode can take minutes of replies before the bar's count moves.
            bar.set_postfix_str("1 reply" if replies == 1 else f"{replies} replies")

        with bar:
            for index, begin in enumerate(range(0, len(tasks), chunk)):
                part = tasks[begin : begin + chunk]
                record(collect_chat(backend, env_id, part, n, seed=derive_seed(seed, index), sampling=sampling,
                                    env_kwargs=env_kwargs, concurrency=num_envs, on_turn=on_turn,
                                    on_episode=lambda trajectory: bar.update(1)))  # per episode, not per chunk
                after_chunk(index, begin + len(part))
    else:
        with bar, VectorAgent(
            env_id,
            TurnProgress(backend, bar) if progress else backend,
            tokenizer,
            num_envs=num_envs,
            sampling=sampling,
            max_context_tokens=max_context_tokens,
            env_kwargs=env_kwargs,
            **(agent_options or {}),
        ) as agent:
            for index, begin in enumerate(range(0, len(tasks), chunk)):
                part = tasks[begin : begin + chunk]
                record(agent.collect(part, n, seed=derive_seed(seed, index)))
                tokens += agent.last_stats.generated_tokens
                bar.update(max(0, len(part) * n * per_episode - agent.last_stats.generated_tokens))
                after_chunk(index, begin + len(part))
    if backend_errors:
        shown = "; ".join(backend_errors[:3]) + (f"; and {len(backend_errors) - 3} more" if len(backend_errors) > 3 else "")
        logger.warning("%d of %d episodes ended with backend_error, the model server giving no usable reply "
                       "(scored 0): %s", len(backend_errors), len(outcomes), shown)
    if dropped[0]:
        logger.warning("%d tool calls from the model server were dropped: the env's ReAct format reads the reply's "
                       "text only; evaluate a chat server with env kwargs {\"action_format\": \"tools\"}", dropped[0])
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
        backend_errors=len(backend_errors),
        backend_error_episodes=backend_errors,
        dropped_tool_calls=dropped[0],
    )


def eval_record(result: EvalResult, step: int) -> dict[str, float]:
    """The metrics record of an evaluation at `step`: eval/avg@k, eval/pass@k, per category too."""
    k = result.k
    record = {
        "step": float(step),
        f"eval/avg@{k}": result.avg_at_k,
        f"eval/pass@{k}": result.pass_at_k,
        "eval/tasks": float(len(result.tasks)),
        "eval/rollouts_per_task": float(result.n),
        "time/eval_s": result.wall_seconds,
    }
    for category, row in result.summary.items():
        if category not in ("overall", DEFAULT_CATEGORY):
            record[f"eval/{category}/avg@{k}"] = row[f"avg@{k}"]
            record[f"eval/{category}/pass@{k}"] = row[f"pass@{k}"]
    return record
