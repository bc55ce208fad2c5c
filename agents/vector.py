"""The vectorized agent: B tasks x G rollouts over N env instances, token-in/token-out.

Two schedules (`schedule=`):

- "per_episode" (the default): no episode waits for another. Each episode's request goes to
  the backend the moment its context is ready (`submit`, see `backends/engine.py`; HF and vLLM
  batch whatever is in flight, continuously); as soon as its completion returns, its env steps
  (in a thread pool with `vectorization="async"`, else in this thread) while the others
  generate, and its next request follows at once. Request seeds are per (episode, turn), so
  the same seed gives the same rollouts whatever the timing.
- "lockstep": each step, every episode that waits for a response is put into ONE backend call;
  the envs are then stepped (in this thread, or concurrently in a thread pool); the step lasts
  as long as its longest response and its slowest env. Kept for comparison, and for runs
  whose seeded rollouts must match earlier lockstep runs: it seeds each call, so its rollouts
  differ from per-episode's (except with `sampling_for`, where it seeds each request alike).

In both, finished episodes are recorded and their env slots take the next pending episode.

Token-in/token-out (docs/architecture.md). An episode's context is a list of token ids:

- turn 1: the chat template applied to the env's `info["messages"]` (system + first user
  message) with the generation prompt, tokenized once;
- after turn t: context_t + response_t (the sampled ids, as sampled) + the observation delta:
  the tokens that close the assistant turn (minus the stop token already sampled) and open
  the next user message with the env's reply and the next generation prompt. The delta is
  rendered by the tokenizer's own chat template (see `ChatDelta`) and tokenized once.

Text the agent already holds is never re-tokenized. When the env's reported history differs
from what was sent (e.g. `keep_think=False` strips earlier `<think>` blocks), the context of
the next turn is rebuilt from `info["messages"]` instead, and the turn record stores exactly
those ids (what the model was conditioned on). `context_mode="rebuild"` always rebuilds.

Context budget: before each turn, an episode whose context plus `sampling.max_new_tokens`
would exceed `max_context_tokens` ends there as truncated (reward 0.0, success False,
`info["end"] == "context_budget"`); no context is ever cut.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import gymnasium as gym

from seeupo_gym.agents.chat import appended_text, render_chat, sampled_assistant_message
from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.backends.base import FINISH_STOP, Backend, Completion, RequestError, SamplingParams
from seeupo_gym.agents.backends.engine import engine_for
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.remote import env_target

logger = logging.getLogger(__name__)

END_TERMINATED = "terminated"
END_TRUNCATED = "truncated"
END_CONTEXT_BUDGET = "context_budget"
END_ENV_ERROR = "env_error"
END_BACKEND_ERROR = "backend_error"

SCHEDULES = ("per_episode", "lockstep")
# Purposes mixed into derive_seed(seed, purpose, ...): lockstep seeds each backend call, per-episode
# each request (episode, turn).
_LOCKSTEP_CALL, _EPISODE_TURN = 2, 3

class EnvAnswerError(ValueError):
    """An env's reset or step answered with an info the agent cannot read (the message says what)."""


class _UnmadeEnv:
    """Holds a slot whose failed env could not be made again (its server gone, or stalling past its
    deadline): the slot's episodes end as env errors, and each one tries to make the env again."""

    def __init__(self, error: Exception) -> None:
        self.error = f"the env could not be made again after a failure: {type(error).__name__}: {error}"

    def reset(self, **kwargs: Any) -> Any:
        raise RuntimeError(self.error)

    def step(self, action: Any) -> Any:
        raise RuntimeError(self.error)

    def close(self) -> None:
        pass


def env_info_error(info: Any, *, at_reset: bool = True) -> str | None:
    """What is wrong with an env's `info` for the agent, or None: a dict whose `messages` is a list
    of messages (dicts with a string role, string or null content, a list of dict tool calls), whose
    `tools` is a list of dicts and `tool_parser` a string when present. An env served by someone
    else may send anything; what it sends must end its episode, never the collection. A step's
    info may leave `messages` out (read as none)."""
    if not isinstance(info, dict):
        return f"the env's info is a {type(info).__name__}, not a dict"
    messages = info.get("messages", None if at_reset else [])
    if not isinstance(messages, list):
        return f"the env's info['messages'] is a {type(messages).__name__}, not a list of messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"the env's message {index} is a {type(message).__name__}, not a dict"
        if not isinstance(message.get("role"), str):
            return f"the env's message {index} has no string role"
        if not isinstance(message.get("content", ""), (str, type(None))):
            return f"the env's message {index} has {type(message['content']).__name__} content, not text"
        calls = message.get("tool_calls", [])
        if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
            return f"the env's message {index} has tool_calls that are not a list of dicts"
    tools = info.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools)):
        return "the env's info['tools'] is not a list of dicts"
    if not isinstance(info.get("tool_parser", ""), (str, type(None))):
        return "the env's info['tool_parser'] is not a string"
    return None


def checked_env_answer(outcome: Any, call: Literal["reset", "step"]) -> Any:
    """An env's reset or step answer, or EnvAnswerError saying what the agent cannot read in it."""
    wrong = _answer_error(outcome, 2 if call == "reset" else 5, call) or env_info_error(outcome[-1], at_reset=call == "reset")
    if wrong is not None:
        raise EnvAnswerError(wrong)
    return outcome


def _answer_error(outcome: Any, length: int, call: str) -> str | None:
    if not isinstance(outcome, (tuple, list)) or len(outcome) != length:
        return f"the env's {call} returned a {type(outcome).__name__}, not a {length}-tuple"
    if length == 5 and not (isinstance(outcome[1], numbers.Real) and math.isfinite(outcome[1])):
        return f"the env's step returned the reward {str(outcome[1])[:40]!r}, not a finite number"
    return None


_ASSISTANT_SENTINEL = "\x00ASSISTANT\x00"
_USER_SENTINEL = "\x00USER\x00"


class ChatDelta:
    """Renders the chat template's text around a new user message, once per tokenizer.

    For a conversation that ends with an assistant message, the template renders
    `... <assistant content><closing><user_prefix><user content><user_suffix>` where
    `closing` ends the assistant turn and `user_suffix` ends the user turn and opens the
    next assistant turn (the generation prompt). Found by rendering a short fixed
    conversation with sentinels; raises if the template does not render appended messages
    as a suffix (then the agent has to rebuild contexts from messages).
    """

    def __init__(self, tokenizer: Any) -> None:
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        with_assistant = base + [{"role": "assistant", "content": _ASSISTANT_SENTINEL}]
        with_user = with_assistant + [{"role": "user", "content": _USER_SENTINEL}]
        before = render_chat(tokenizer, with_assistant, add_generation_prompt=False)
        after = render_chat(tokenizer, with_user, add_generation_prompt=True)
        if not after.startswith(before) or before.count(_ASSISTANT_SENTINEL) != 1:
            raise ValueError(
                "the tokenizer's chat template does not render a new user message as a suffix of the "
                "conversation; use VectorAgent(..., context_mode='rebuild')"
            )
        self.closing = before.split(_ASSISTANT_SENTINEL, 1)[1]
        self.user_prefix, self.user_suffix = after[len(before) :].split(_USER_SENTINEL)

    def text(self, content: str, *, closed_by: str = "") -> str:
        """Text appended after a response for a new user message `content`.

        closed_by: the decoded stop token that ended the response; when it is the start of
        the template's closing text, it is not repeated.
        """
        closing = self.closing
        if closed_by and closing.startswith(closed_by):
            closing = closing[len(closed_by) :]
        return closing + self.user_prefix + content + self.user_suffix


def encode(tokenizer: Any, text: str) -> list[int]:
    """Tokenize rendered template text; its special tokens are written out in it, add none."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class CollectStats:
    """Figures of the last `collect`."""

    episodes: int = 0
    turns: int = 0
    generated_tokens: int = 0
    # lockstep: batched `generate` calls; per_episode: requests submitted.
    backend_calls: int = 0
    # lockstep: time inside `generate`; per_episode: the requests' latencies summed (they overlap).
    generate_seconds: float = 0.0
    # Time in env resets and steps, summed over envs (steps overlap in a thread pool).
    env_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0


@dataclass
class _Episode:
    index: int
    task_id: str
    group_id: str
    rollout_id: str
    reset_seed: int
    context: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # the env's info["tools"] (tools format)
    tool_parser: str = "hermes"  # the env's info["tool_parser"]
    turns: list[Turn] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    result: Trajectory | None = None


@dataclass
class _Waiting:
    """What a per-episode future in flight is for."""

    kind: Literal["reset", "generate", "step"]
    slot: int
    episode: _Episode
    completion: Completion | None = None
    action: str | None = None
    started: float = 0.0


class VectorAgent:
    """Drives `num_envs` instances of `env_id` with one backend.

    Args:
        env_id: a registered Gymnasium id (its envs follow the env contract in docs/architecture.md: `info["messages"]`,
            `info["task_id"]`, `info["success"]`).
        backend: a `Backend`; tokenizer: the policy's tokenizer (chat template + decoding).
        num_envs: env instances; at most that many episodes run at once.
        sampling: sampling parameters of every turn (each backend call gets its own seed).
        max_context_tokens: the context budget (see the module docstring).
        env_kwargs: passed to `gym.make`.
        vectorization: "sync" steps the envs one after another in this thread; "async" steps
            them concurrently in a thread pool (for envs that wait on servers, e.g. AppWorld).
        context_mode: "auto" appends tokens and rebuilds only when the env's history differs
            from what was sent; "rebuild" renders every turn's context from `info["messages"]`.
        workers: "local" makes the envs here; "ray" makes each a Ray actor (`seeupo/Ray-v0`).
        url: a `seeupo-serve` server serving `env_id` with `env_kwargs` (`seeupo/Remote-v0`).
        worker_options: Ray's actor options for each env worker.
        schedule: "per_episode" or "lockstep" (see the module docstring).
        sampling_for: optional (episode index, turn) -> SamplingParams of that turn (its seed is
            replaced); default `sampling` for every turn. The context budget counts
            `sampling.max_new_tokens`. With lockstep, each step's requests then go through the
            backend's `submit`, seeded per (episode, turn) as in the per-episode schedule, and the
            step waits for all of them: both schedules sample the same rollouts (benchmarks).
    """

    def __init__(
        self,
        env_id: str,
        backend: Backend,
        tokenizer: Any,
        *,
        num_envs: int,
        sampling: SamplingParams,
        max_context_tokens: int = 8192,
        env_kwargs: dict[str, Any] | None = None,
        vectorization: Literal["sync", "async"] = "sync",
        context_mode: Literal["auto", "rebuild"] = "auto",
        env_factory: Callable[[], gym.Env] | None = None,
        workers: Literal["local", "ray"] = "local",
        url: str | None = None,
        worker_options: dict[str, Any] | None = None,
        schedule: Literal["per_episode", "lockstep"] = "per_episode",
        sampling_for: Callable[[int, int], SamplingParams] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, got {num_envs}")
        if vectorization not in ("sync", "async"):
            raise ValueError(f"vectorization must be 'sync' or 'async', got {vectorization!r}")
        if context_mode not in ("auto", "rebuild"):
            raise ValueError(f"context_mode must be 'auto' or 'rebuild', got {context_mode!r}")
        if max_context_tokens <= sampling.max_new_tokens:
            raise ValueError(
                f"max_context_tokens ({max_context_tokens}) must exceed sampling.max_new_tokens "
                f"({sampling.max_new_tokens})"
            )
        self.env_id = env_id
        self.backend = backend
        self.tokenizer = tokenizer
        self.num_envs = num_envs
        self.sampling = sampling
        self.max_context_tokens = max_context_tokens
        self.env_kwargs = dict(env_kwargs or {})
        self.vectorization = vectorization
        self.context_mode = context_mode
        self.schedule = schedule
        self.sampling_for = sampling_for
        # Recorded on every Turn sampled from now on (the trainer bumps it after each weight push).
        self.policy_version = 0
        # Where each env runs: here, in a Ray actor, or behind a seeupo-serve url (seeupo_gym.remote).
        target_id, target_kwargs = env_target(env_id, self.env_kwargs, workers=workers, url=url,
                                              worker_options=worker_options)
        self._env_factory = env_factory or (lambda: gym.make(target_id, **target_kwargs))
        self.delta = ChatDelta(tokenizer) if context_mode == "auto" else None
        self.stop_token_ids = set(sampling.stop_token_ids or backend.default_stop_token_ids)
        if not self.stop_token_ids and tokenizer.eos_token_id is not None:
            self.stop_token_ids = {tokenizer.eos_token_id}
        self.envs: list[gym.Env] = [self._env_factory() for _ in range(num_envs)]
        self._pool = ThreadPoolExecutor(max_workers=num_envs) if vectorization == "async" else None
        self.last_stats = CollectStats()

    # ------------------------------------------------------------------ public

    def collect(self, task_ids: Sequence[str | None], group_size: int, seed: int, *, progress: bool = False) -> RolloutBatch:
        """G = group_size rollouts of each task; a None task is drawn by the env (seeded).

        Trajectories come back in task order, rollouts of a task together. group_id is
        "<b>:<task_id>" (b = position in task_ids), rollout_id "<b>:<task_id>:<g>".
        progress: a bar on stderr that moves with every response (tokens generated).
        """
        if progress:
            from tqdm.auto import tqdm

            from seeupo_gym.agents.backends.progress import TurnProgress

            backend = self.backend
            with tqdm(desc="collect", unit="tok", unit_scale=True, leave=False, dynamic_ncols=True) as bar:
                self.backend = TurnProgress(backend, bar)
                try:
                    return self.collect(task_ids, group_size, seed)
                finally:
                    self.backend = backend
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        start = time.perf_counter()
        stats = CollectStats()
        resolved = [self._resolve_task(task_id, seed, b) for b, task_id in enumerate(task_ids)]
        episodes = [
            _Episode(
                index=b * group_size + g,
                task_id=task_id,
                group_id=f"{b}:{task_id}",
                rollout_id=f"{b}:{task_id}:{g}",
                reset_seed=derive_seed(seed, 1, b, g),
            )
            for b, task_id in enumerate(resolved)
            for g in range(group_size)
        ]
        if self.schedule == "per_episode":
            self._collect_per_episode(episodes, seed, stats)
        else:
            self._collect_lockstep(episodes, seed, stats)
        stats.episodes = len(episodes)
        stats.wall_seconds = time.perf_counter() - start
        self.last_stats = stats
        trajectories = [episode.result for episode in episodes]
        assert all(t is not None for t in trajectories)
        return RolloutBatch(trajectories)  # type: ignore[arg-type]

    def _collect_lockstep(self, episodes: list[_Episode], seed: int, stats: CollectStats) -> None:
        pending = deque(episodes)
        running: dict[int, _Episode] = {}
        call_index = 0
        while pending or running:
            self._start_episodes(pending, running, stats)
            if not running:
                continue
            slots = sorted(running)
            prompts = [running[slot].context for slot in slots]
            tick = time.perf_counter()
            if self.sampling_for is None:
                call_seed = derive_seed(seed, _LOCKSTEP_CALL, call_index)
                completions = self.backend.generate(prompts, replace(self.sampling, seed=call_seed))
            else:
                completions = self._generate_each([running[slot] for slot in slots], seed)
            stats.generate_seconds += time.perf_counter() - tick
            stats.backend_calls += 1
            call_index += 1
            if len(completions) != len(prompts):
                raise RuntimeError(f"backend returned {len(completions)} completions for {len(prompts)} prompts")
            actions = [self.response_text(c.token_ids, c.finish_reason) for c in completions]
            tick = time.perf_counter()
            outcomes = self._map(lambda slot, action: self._step(slot, action), list(zip(slots, actions)))
            stats.env_seconds += time.perf_counter() - tick
            for slot, completion, action, outcome in zip(slots, completions, actions, outcomes):
                episode = running[slot]
                self._record_turn(episode, completion, action, stats)
                if self._advance(slot, episode, completion, action, outcome):
                    del running[slot]

    def _generate_each(self, episodes: list[_Episode], seed: int) -> list[Completion]:
        """One lockstep call whose rows have their own sampling params: submitted together, awaited
        together, each seeded as the per-episode schedule seeds it (so both sample the same rollouts)."""
        engine, owned = engine_for(self.backend)
        try:
            futures = [engine.submit(e.context, self._request_sampling(e, seed)) for e in episodes]
            return [future.result() for future in futures]
        finally:
            if owned:
                engine.close()

    def _collect_per_episode(self, episodes: list[_Episode], seed: int, stats: CollectStats) -> None:
        engine, owned = engine_for(self.backend)
        pending = deque(episodes)
        free = deque(range(self.num_envs))
        waiting: dict[Future, _Waiting] = {}

        def on_env(work: _Waiting, fn: Callable[..., Any], *args: Any) -> None:
            work.started = time.perf_counter()
            if self._pool is None:
                future: Future = Future()
                future.set_result(fn(*args))  # _reset and _step return errors, never raise
            else:
                future = self._pool.submit(fn, *args)
            waiting[future] = work

        def start_episodes() -> None:
            while free and pending:
                slot, episode = free.popleft(), pending.popleft()
                on_env(_Waiting("reset", slot, episode), self._reset, slot, episode)

        def request(slot: int, episode: _Episode) -> None:
            work = _Waiting("generate", slot, episode, started=time.perf_counter())
            waiting[engine.submit(episode.context, self._request_sampling(episode, seed))] = work
            stats.backend_calls += 1

        try:
            start_episodes()
            while waiting:
                done, _ = wait(list(waiting), return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: waiting[f].episode.index):
                    work = waiting.pop(future)
                    slot, episode = work.slot, work.episode
                    elapsed = time.perf_counter() - work.started
                    if work.kind == "generate":
                        stats.generate_seconds += elapsed
                        try:
                            completion = future.result()  # a failing backend fails the collection, as in lockstep
                        except RequestError as error:  # one request a remote server did not serve: its episode ends
                            logger.warning("ending an episode of task %s: %s", episode.task_id, error)
                            self._finish(episode, END_BACKEND_ERROR, reward=0.0, success=False, truncated=True, error=error)
                            free.append(slot)
                            start_episodes()
                            continue
                        action = self.response_text(completion.token_ids, completion.finish_reason)
                        self._record_turn(episode, completion, action, stats)
                        on_env(_Waiting("step", slot, episode, completion, action), self._step, slot, action)
                        continue
                    stats.env_seconds += elapsed
                    if work.kind == "reset":
                        over = not self._begin(episode, future.result())
                    else:
                        assert work.completion is not None and work.action is not None
                        over = self._advance(slot, episode, work.completion, work.action, future.result())
                    if over:
                        free.append(slot)
                        start_episodes()
                    else:
                        request(slot, episode)
        finally:
            # On an error, no env may still be stepping when the caller retries with these envs.
            wait([f for f, work in waiting.items() if work.kind != "generate"])
            if owned:
                engine.close()

    def response_text(self, token_ids: Sequence[int], finish_reason: str = FINISH_STOP) -> str:
        """The text the env receives: the decoded response without its final stop token."""
        ids = list(token_ids)
        if finish_reason == FINISH_STOP and ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def initial_context(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return encode(self.tokenizer, render_chat(self.tokenizer, messages, add_generation_prompt=True, tools=tools))

    def observation_delta(self, content: str, response_ids: Sequence[int], finish_reason: str) -> list[int]:
        """Tokens appended after a response for the env's reply `content` (one tokenization)."""
        assert self.delta is not None
        closed_by = ""
        if finish_reason == FINISH_STOP and response_ids and response_ids[-1] in self.stop_token_ids:
            closed_by = self.tokenizer.decode([response_ids[-1]], skip_special_tokens=False)
        return encode(self.tokenizer, self.delta.text(content, closed_by=closed_by))

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # closing must not hide the caller's own error
                logger.exception("closing an env failed")
        self.envs = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "VectorAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _map(self, fn: Callable[..., Any], args: list[tuple[Any, ...]]) -> list[Any]:
        if self._pool is None or len(args) <= 1:
            return [fn(*a) for a in args]
        return list(self._pool.map(lambda a: fn(*a), args))

    def _resolve_task(self, task_id: str | None, seed: int, b: int) -> str:
        """A None task becomes the env's seeded draw, so all G rollouts share one task."""
        if task_id is not None:
            return task_id
        _, info = self.envs[0].reset(seed=derive_seed(seed, 0, b))
        return str(info["task_id"])

    def _start_episodes(self, pending: deque[_Episode], running: dict[int, _Episode], stats: CollectStats) -> None:
        free = [slot for slot in range(self.num_envs) if slot not in running]
        starting = []
        while free and pending:
            starting.append((free.pop(0), pending.popleft()))
        tick = time.perf_counter()
        outcomes = self._map(self._reset, starting)
        stats.env_seconds += time.perf_counter() - tick
        for (slot, episode), outcome in zip(starting, outcomes):
            if self._begin(episode, outcome):
                running[slot] = episode

    def _begin(self, episode: _Episode, outcome: Any) -> bool:
        """Take the env's reset; return True when the episode goes on to its first turn."""
        if isinstance(outcome, BaseException):
            self._finish(episode, END_ENV_ERROR, reward=0.0, success=False, truncated=True, error=outcome)
            return False
        wrong = _answer_error(outcome, 2, "reset") or env_info_error(outcome[1])
        if wrong is not None:
            logger.warning("ending an episode of task %s at its reset: %s", episode.task_id, wrong)
            self._finish(episode, END_ENV_ERROR, reward=0.0, success=False, truncated=True, error=EnvAnswerError(wrong))
            return False
        _, info = outcome
        episode.messages = [dict(m) for m in info["messages"]]
        episode.tools = list(info.get("tools") or [])
        episode.tool_parser = info.get("tool_parser") or "hermes"
        context = self._encode_or_end(episode, lambda: self.initial_context(episode.messages, episode.tools))
        if context is None:
            return False
        episode.context = context
        if self._over_budget(episode):
            self._finish(episode, END_CONTEXT_BUDGET, reward=0.0, success=False, truncated=True)
            return False
        return True

    def _request_sampling(self, episode: _Episode, seed: int) -> SamplingParams:
        """The sampling of the episode's next turn, seeded by (collection seed, episode, turn)."""
        turn = len(episode.turns) + 1
        sampling = self.sampling if self.sampling_for is None else self.sampling_for(episode.index, turn)
        return replace(sampling, seed=derive_seed(seed, _EPISODE_TURN, episode.index, turn))

    def _record_turn(self, episode: _Episode, completion: Completion, action: str, stats: CollectStats) -> None:
        turn = len(episode.turns) + 1
        sampling = self.sampling if self.sampling_for is None else self.sampling_for(episode.index, turn)
        episode.turns.append(
            Turn(
                context_ids=list(episode.context),
                response_ids=list(completion.token_ids),
                sample_logprobs=list(completion.logprobs),
                finish_reason=completion.finish_reason,
                policy_version=self.policy_version,
                # Backends record greedy turns' logprobs at temperature 1.
                logprob_temperature=sampling.temperature or 1.0,
            )
        )
        episode.actions.append(action)
        stats.turns += 1
        stats.generated_tokens += len(completion.token_ids)

    def _reset(self, slot: int, episode: _Episode) -> Any:
        try:
            return self.envs[slot].reset(seed=episode.reset_seed, options={"task_id": episode.task_id})
        except Exception as error:  # a broken env must not end the whole collection
            logger.exception("env reset failed for task %s", episode.task_id)
            self._replace_env(slot)
            return error

    def _step(self, slot: int, action: str) -> Any:
        try:
            return self.envs[slot].step(action)
        except Exception as error:
            logger.exception("env step failed")
            self._replace_env(slot)
            return error

    def _replace_env(self, slot: int) -> None:
        try:
            self.envs[slot].close()
        except Exception:
            logger.exception("closing a failed env raised")
        try:
            self.envs[slot] = self._env_factory()
        except Exception as error:  # noqa: BLE001  a server that failed once may stall or refuse the next env too
            logger.warning("making a new env for slot %d failed: %s: %s", slot, type(error).__name__, error)
            self.envs[slot] = _UnmadeEnv(error)  # type: ignore[assignment]

    def _advance(self, slot: int, episode: _Episode, completion: Completion, action: str, outcome: Any) -> bool:
        """Record the env's answer; return True when the episode is over."""
        if isinstance(outcome, BaseException):
            self._finish(episode, END_ENV_ERROR, reward=0.0, success=False, truncated=True, error=outcome)
            return True
        wrong = _answer_error(outcome, 5, "step") or env_info_error(outcome[4], at_reset=False)
        if wrong is not None:
            logger.warning("ending an episode of task %s at a step: %s", episode.task_id, wrong)
            self._finish(episode, END_ENV_ERROR, reward=0.0, success=False, truncated=True, error=EnvAnswerError(wrong))
            return True
        observation, reward, terminated, truncated, info = outcome
        messages = [dict(m) for m in info.get("messages", [])]
        if terminated or truncated:
            episode.messages = messages
            self._finish(
                episode,
                END_TERMINATED if terminated else END_TRUNCATED,
                reward=float(reward),
                success=bool(info.get("success", False)),
                truncated=bool(truncated and not terminated),
                info=info,
            )
            return True
        context = self._encode_or_end(episode, lambda: self._next_context(episode, completion, action, messages), info)
        if context is None:
            return True
        episode.context = context
        episode.messages = messages
        if self._over_budget(episode):
            self._finish(episode, END_CONTEXT_BUDGET, reward=0.0, success=False, truncated=True, info=info)
            return True
        return False

    def _encode_or_end(
        self, episode: _Episode, encode: Callable[[], list[int]], info: dict[str, Any] | None = None
    ) -> list[int] | None:
        """`encode()`'s tokens; or None, with the episode ended as an env error, when the
        tokenizer refuses the env's text (envs hand out valid Unicode, but one that does not
        must cost its episode only, never the collection)."""
        try:
            return encode()
        except Exception as error:  # noqa: BLE001  tokenizers raise TypeError, ValueError, ...
            logger.warning("ending an episode of task %s: its env's text cannot be tokenized (%s)",
                           episode.task_id, error)
            self._finish(episode, END_ENV_ERROR, reward=0.0, success=False, truncated=True, info=info, error=error)
            return None

    def _next_context(
        self, episode: _Episode, completion: Completion, action: str, messages: list[dict[str, Any]]
    ) -> list[int]:
        """The episode's context after `completion`: the sampled tokens plus the env's new messages,
        or rebuilt from `messages` when the env's history is not the conversation as sampled."""
        delta = self._appended_ids(episode, completion, action, messages)
        if delta is None:
            return self.initial_context(messages, episode.tools)
        return episode.context + list(completion.token_ids) + delta

    def _appended_ids(
        self, episode: _Episode, completion: Completion, action: str, messages: list[dict[str, Any]]
    ) -> list[int] | None:
        """The tokens after the sampled response for the env's new messages (user or tool), or None
        when the env's history is not the conversation as sampled plus those messages."""
        done = len(episode.messages)
        following = messages[done + 1 :]
        if (
            self.delta is None
            or messages[:done] != episode.messages
            or len(messages) <= done + 1
            or messages[done] != sampled_assistant_message(action, episode.tools, episode.tool_parser)
            or not all(m.get("role") in ("user", "tool") for m in following)
        ):
            return None
        if len(following) == 1 and following[0]["role"] == "user":  # ReAct: the precomputed delta
            return self.observation_delta(following[0]["content"], completion.token_ids, completion.finish_reason)
        closed_by = ""
        if completion.finish_reason == FINISH_STOP and completion.token_ids and completion.token_ids[-1] in self.stop_token_ids:
            closed_by = self.tokenizer.decode([completion.token_ids[-1]], skip_special_tokens=False)
        try:
            return encode(self.tokenizer, appended_text(self.tokenizer, self.delta.closing, following, closed_by=closed_by))
        except ValueError:
            return None

    def _over_budget(self, episode: _Episode) -> bool:
        return len(episode.context) + self.sampling.max_new_tokens > self.max_context_tokens

    def _finish(
        self,
        episode: _Episode,
        end: str,
        *,
        reward: float,
        success: bool,
        truncated: bool,
        info: dict[str, Any] | None = None,
        error: BaseException | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "end": end,
            "messages": episode.messages,
            "actions": list(episode.actions),
            "context_tokens": len(episode.context),
        }
        if info is not None:
            # Everything the env reported at the end, except what is already stored above.
            record["env_info"] = {k: v for k, v in info.items() if k != "messages"}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        episode.result = Trajectory(
            task_id=episode.task_id,
            group_id=episode.group_id,
            rollout_id=episode.rollout_id,
            turns=episode.turns,
            reward=reward,
            success=success,
            truncated=truncated,
            info=record,
        )
