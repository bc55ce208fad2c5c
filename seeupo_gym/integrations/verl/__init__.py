"""Our envs as a verl agent loop (verl 0.9.1, `verl.experimental.agent_loop`).

verl runs one agent loop per dataset row (`agent_name` picks the loop). `SeeupoAgentLoop`, registered
as "seeupo_env", runs one of our envs per row, token-in/token-out through verl's server manager:

- the prompt is the env's own first messages (system + first user), rendered by the chat template
  with the env's tools as `tools=` in the tools format (the row's `prompt` is not used);
- each turn, `server_manager.generate(prompt_ids=prompt + response so far)` samples one response;
  its decoded text (without the final stop token) is the env's action;
- the env's new messages (user or tool) are rendered as the template appends them and tokenized
  once; they join the response with mask 0, the sampled tokens with mask 1 (verl's layout:
  `| model 1..1 | env 0..0 | model 1..1 |`), their logprobs as sampled (0.0 on env tokens);
- each turn's sampled tokens are `extra_fields["turn_spans"]` ([start, end) in the response), SeeUPO's
  turn pools (`seeupo_gym.integrations.verl.seeupo`);
- the env's final reward is the sample's `reward_score`. A sample that fills `response_length`
  before its episode ends, whose first prompt (tools included) exceeds `prompt_length`, whose
  env fails (raises, passes its deadline, or returns a reward that is not finite or is over
  `MAX_ABS_REWARD` in size, or answers what the agent cannot read: `env_info_error`, the same check
  as the vectorized agent's, or messages over `max_observation_chars`), whose server's logprobs are
  not finite, or whose row asks for what only the config may set (another env than the config's, a
  `max_turns` that is not an int within the loop's turn cap), scores 0.0 and ends alone, never the
  batch (`extra_fields["env_end"]` says which, `env_error` why; an overlong prompt is kept as its last
  `prompt_length` tokens, as verl does, with no response). Text is tokenized in a thread, under
  `env_timeout_s`, so a large answer never blocks the worker's event loop.

Rows come from `build_dataset` (or `write_parquet`): `extra_info` holds `task_id`, `env_id` and
`env_kwargs` (JSON), so one registered loop serves every env. Rows are data, not configuration:
a row's `env_kwargs` may set only its env's episode options (`seeupo_gym.integrations.row_kwargs`),
over the loop's own `env_kwargs`; where the env runs (`url`, `workers`) and everything that decides
isolation, paths or credentials come from the loop's config only. In verl's config:

    actor_rollout_ref.rollout.agent.agent_loop_config_path: seeupo_agent_loops.yaml
    # seeupo_agent_loops.yaml:
    # - name: seeupo_env
    #   _target_: seeupo_gym.integrations.verl.SeeupoAgentLoop
    actor_rollout_ref.rollout.agent.agent_loop_manager_class: seeupo_gym.integrations.verl.SeeupoAgentLoopManager

The manager's workers (`SeeupoAgentLoopWorker`) are verl's, except that a row naming an agent loop
nobody registered (verl asserts, and the batch ends) ends that sample alone as `bad_row`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import uuid4

import gymnasium as gym
from verl.experimental.agent_loop.agent_loop import (AgentLoopBase, AgentLoopManager, AgentLoopMetrics, AgentLoopOutput,
                                                     AgentLoopWorker, _agent_loop_registry, register)

import seeupo_gym  # noqa: F401  (registers the Gymnasium ids)
from seeupo_gym.agents.chat import appended_text, render_chat
from seeupo_gym.agents.vector import ChatDelta, EnvAnswerError, checked_env_answer, encode
from seeupo_gym.integrations.row_kwargs import ROW_KWARGS, RowError, row_env_kwargs
from seeupo_gym.integrations.task_prompts import task_prompts
from seeupo_gym.remote import MAX_ABS_REWARD, MAX_TURNS_CAP, env_target

logger = logging.getLogger(__name__)

AGENT_NAME = "seeupo_env"
# The kwarg by which SeeupoAgentLoopWorker hands the loop a row whose agent_name is not registered.
UNKNOWN_AGENT = "seeupo_unknown_agent_name"

END_TERMINATED, END_TRUNCATED = "terminated", "truncated"
END_RESPONSE_LENGTH, END_PROMPT_LENGTH, END_ENV_ERROR = "response_length", "prompt_length", "env_error"
END_BAD_ROW, END_SERVER_ERROR = "bad_row", "server_error"
# The most characters of env text (an answer's messages and tools) one sample takes in: ~256k tokens,
# far over any response_length, and tokenized in well under a second.
MAX_OBSERVATION_CHARS = 1 << 20


class _EnvError(RuntimeError):
    """The env failed (raised, timed out, or answered what the agent cannot read): the sample ends,
    the batch goes on."""


class _ServerError(RuntimeError):
    """The LLM server answered logprobs no trainer can use: the sample ends, the batch goes on."""


@register(AGENT_NAME)
class SeeupoAgentLoop(AgentLoopBase):
    """One episode of a seeupo-gym env per sample.

    Keyword arguments (from the agent loop YAML, the trainer's config):
        env_id: a registered `seeupo/...` id, for rows that do not name one.
        env_kwargs: `gym.make` keyword arguments; a row's `extra_info.env_kwargs` may set the keys
            `ROW_KWARGS` lists for its env over them, nothing else.
        url: a `seeupo-serve` server serving the rows' envs (each sample is a session there); the
            token (`$SEEUPO_SERVE_TOKEN`) goes to this url only.
        workers, worker_options: "ray" runs each env in a Ray actor (`seeupo/Ray-v0`) with these options.
        max_tokens_per_turn: cap of one response (default: what is left of `response_length`).
        env_timeout_s: deadline of one env reset or step (and of tokenizing its answer); a later
            answer is not waited for.
        max_observation_chars: the most characters of messages and tools one env answer may bring.
    """

    def __init__(
        self,
        *args: Any,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        url: str | None = None,
        workers: str = "local",
        worker_options: Mapping[str, Any] | None = None,
        max_tokens_per_turn: int | None = None,
        env_timeout_s: float = 600.0,
        max_observation_chars: int = MAX_OBSERVATION_CHARS,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.url, self.workers, self.worker_options = url, workers, dict(worker_options or {})
        env_target(env_id or "", workers=workers, url=url)  # a bad url/workers pair fails here, not per sample
        self.max_tokens_per_turn = max_tokens_per_turn
        self.env_timeout_s = env_timeout_s
        self.max_observation_chars = max_observation_chars
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.delta = ChatDelta(self.tokenizer)
        self.stop_token_ids = {self.tokenizer.eos_token_id} - {None}
        self.vocab_size = len(self.tokenizer)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        env: gym.Env | None = None
        response_ids: list[int] = []
        response_mask: list[int] = []
        response_logprobs: list[float] = []
        turn_spans: list[list[int]] = []  # [start, end) of each turn's sampled tokens in the response
        prompt_ids: list[int] = []
        messages: list[dict[str, Any]] = []
        reward, success, end, error = 0.0, False, END_RESPONSE_LENGTH, ""
        env_id, task_id = "?", "?"
        try:
            if UNKNOWN_AGENT in kwargs:
                raise RowError(f"the row names agent loop {str(kwargs[UNKNOWN_AGENT])[:80]!r}, which is not registered")
            env_id, env_kwargs, task_id = self._episode_of(kwargs.get("extra_info"))
            target_id, target_kwargs = env_target(env_id, env_kwargs, workers=self.workers, url=self.url,
                                                  worker_options=self.worker_options)
            if target_id == "seeupo/Remote-v0":  # the client's own waits end with the loop's, leaving no thread behind
                target_kwargs.update(timeout_s=self.env_timeout_s, connect_timeout_s=min(self.env_timeout_s, 30.0))
            env = await self._env_call(gym.make, target_id, **target_kwargs)
            _, info = self._answer(await self._env_call(env.reset, options={"task_id": task_id}), "reset")
            messages = [dict(m) for m in info["messages"]]
            tools = list(info.get("tools") or []) or None
            prompt_ids = await self._tokenized(lambda: render_chat(self.tokenizer, messages, add_generation_prompt=True,
                                                                   tools=tools))
            if len(prompt_ids) > self.prompt_length:
                logger.warning("task %s: the prompt has %d tokens, over prompt_length=%d; the sample scores 0.0",
                               task_id, len(prompt_ids), self.prompt_length)
                end, prompt_ids = END_PROMPT_LENGTH, prompt_ids[-self.prompt_length :]
            request_id = uuid4().hex
            while end != END_PROMPT_LENGTH and len(response_ids) < self.response_length:
                left = self.response_length - len(response_ids)
                max_tokens = min(left, self.max_tokens_per_turn or left)
                output = await self.server_manager.generate(
                    request_id=request_id,
                    prompt_ids=prompt_ids + response_ids,
                    sampling_params={**sampling_params, "max_tokens": max_tokens},
                )
                sampled, logprobs = self._checked(output, max_tokens)
                # every turn, an empty one too (a zero-token span), so that later turns keep their index
                turn_spans.append([len(response_ids), len(response_ids) + len(sampled)])
                response_ids += sampled
                response_mask += [1] * len(sampled)
                response_logprobs += logprobs
                stopped = bool(sampled) and sampled[-1] in self.stop_token_ids
                action = self.tokenizer.decode(sampled[:-1] if stopped else sampled, skip_special_tokens=False)
                _, step_reward, terminated, truncated, info = self._answer(await self._env_call(env.step, action), "step")
                if terminated or truncated:
                    reward, success = self._checked_reward(step_reward), bool(info.get("success", False))
                    end = END_TERMINATED if terminated else END_TRUNCATED
                    messages = [dict(m) for m in info.get("messages", messages)]
                    break
                following, messages = self._new_messages(messages, info)
                closed_by = self.tokenizer.decode([sampled[-1]], skip_special_tokens=False) if stopped else ""
                observation = await self._tokenized(lambda: appended_text(self.tokenizer, self.delta.closing, following,
                                                                          closed_by=closed_by))
                response_ids += observation
                response_mask += [0] * len(observation)
                response_logprobs += [0.0] * len(observation)
        except RowError as err:  # a bad row ends its own sample, never the batch
            end, error = END_BAD_ROW, str(err)
            logger.warning("seeupo_env row refused: %s", err)
        except _EnvError as err:
            end, error = END_ENV_ERROR, str(err)
            reward, success = 0.0, False
            logger.warning("seeupo env %s, task %s: %s", env_id, task_id, err)
        except _ServerError as err:
            end, error = END_SERVER_ERROR, str(err)
            reward, success = 0.0, False
            logger.warning("seeupo env %s, task %s: %s", env_id, task_id, err)
        finally:
            if env is not None:
                try:
                    env.close()
                except Exception:  # closing must not hide the sample's own outcome
                    logger.exception("closing env %s failed", env_id)
        cut = self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:cut],
            response_mask=response_mask[:cut],
            response_logprobs=response_logprobs[:cut],
            reward_score=reward,
            num_turns=sum(1 for m in messages if m.get("role") != "system"),
            metrics=AgentLoopMetrics(),
            extra_fields={
                "task_id": task_id,
                "env_end": end,
                "env_error": error,
                "turn_scores": [],
                # SeeUPO's turn pools (integrations/verl/seeupo.py), cut to the response as it is
                "turn_spans": [[a, min(b, cut)] for a, b in turn_spans if a < cut],
                "tool_rewards": [],
                "reward_extra_info": {"success": float(success)},
            },
        )

    # ------------------------------------------------------------------ helpers

    def _episode_of(self, extra_info: Any) -> tuple[str, dict[str, Any], str]:
        """(env_id, env_kwargs, task_id) of a row: the loop's env_kwargs with the row's own episode
        options over them; a malformed row, or one that sets what only the config may, is a `RowError`."""
        extra = extra_info if isinstance(extra_info, Mapping) else {}
        task_id = extra.get("task_id")
        if not isinstance(task_id, str) or not task_id:
            raise RowError(f"a seeupo_env row needs extra_info.task_id (a string); got keys {sorted(map(str, extra))[:20]}")
        row_id = extra.get("env_id")
        if row_id is None or row_id == "":
            if not isinstance(self.env_id, str) or not self.env_id.startswith("seeupo/"):
                raise RowError(f"a seeupo_env row needs a seeupo env id (extra_info.env_id or the loop's env_id), "
                               f"got {self.env_id!r:.80}")
            if not extra.get("env_kwargs"):
                return self.env_id, dict(self.env_kwargs), task_id  # the config's own env, as configured
            row_id = self.env_id
        if not isinstance(row_id, str):
            raise RowError(f"extra_info.env_id must be a string, got {type(row_id).__name__}")
        if self.env_id and row_id != self.env_id:  # the config chose the env: a row may not run another's code
            raise RowError(f"the row names env {row_id[:80]!r}, but this loop runs {self.env_id!r} (its config's env_id)")
        return row_id, {**self.env_kwargs, **row_env_kwargs(row_id, extra.get("env_kwargs"),
                                                            max_turns=self._turn_cap())}, task_id

    def _turn_cap(self) -> int:
        """The most turns a row may ask for: the config's own `max_turns`, else `MAX_TURNS_CAP`."""
        configured = self.env_kwargs.get("max_turns")
        return configured if type(configured) is int and configured >= 1 else MAX_TURNS_CAP

    def _answer(self, outcome: Any, call: str) -> Any:
        """An env's reset or step answer, checked as the vectorized agent checks it (readable info,
        a finite reward) and bounded in size; anything else is this sample's env error."""
        try:
            checked_env_answer(outcome, call)
        except EnvAnswerError as err:
            raise _EnvError(f"{call} answered what the agent cannot read: {err}") from None
        info = outcome[-1]
        try:
            size = sum(len(m.get("content") or "") for m in info.get("messages", []))
            size += len(json.dumps(info.get("tools") or [], default=str))
        except (TypeError, ValueError, RecursionError) as err:
            raise _EnvError(f"{call} answered tools that are not JSON: {type(err).__name__}") from None
        if size > self.max_observation_chars:
            raise _EnvError(f"{call} answered {size} characters of messages and tools, over "
                            f"max_observation_chars={self.max_observation_chars}")
        return outcome

    async def _tokenized(self, render: Any) -> list[int]:
        """The token ids of `render()`'s text, computed in a thread (never on verl's event loop) within
        `env_timeout_s`; past it the sample is an env error."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, lambda: encode(self.tokenizer, render())),
                                          self.env_timeout_s)
        except asyncio.TimeoutError:
            raise _EnvError(f"tokenizing the env's answer took longer than {self.env_timeout_s} s") from None
        except Exception as err:  # noqa: BLE001  the chat template refused what the env sent: this sample only
            raise _EnvError(f"the env's answer could not be rendered: {type(err).__name__}: {err}"[:500]) from None

    async def _env_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` in a thread (envs block), under the env deadline; failures become `_EnvError`."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, lambda: fn(*args, **kwargs)), self.env_timeout_s)
        except asyncio.TimeoutError:
            raise _EnvError(f"{getattr(fn, '__name__', 'env call')} took longer than {self.env_timeout_s} s") from None
        except Exception as err:  # noqa: BLE001  any env failure ends this sample only
            raise _EnvError(f"{getattr(fn, '__name__', 'env call')} failed: {type(err).__name__}: {err}") from err

    @staticmethod
    def _checked_reward(reward: Any) -> float:
        """The env's final reward, refused (the sample's env error) when verl's float32 scores could
        not hold it, or sums of them: not a finite number, or over `MAX_ABS_REWARD` in size."""
        try:
            value = float(reward)
        except (TypeError, ValueError):
            raise _EnvError(f"the env returned reward {reward!r:.60}, not a number") from None
        if not math.isfinite(value) or abs(value) > MAX_ABS_REWARD:
            raise _EnvError(f"the env returned reward {reward!r:.60}; a reward is a finite number of at most "
                            f"{MAX_ABS_REWARD:g} in size")
        return value

    def _checked(self, output: Any, max_tokens: int) -> tuple[list[int], list[float]]:
        """The server's token ids and logprobs, refused when they cannot be what was asked for."""
        ids = list(getattr(output, "token_ids", None) or [])
        if len(ids) > max_tokens:
            raise ValueError(f"the server returned {len(ids)} tokens for max_tokens={max_tokens}")
        if not all(type(i) is int and 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"the server returned token ids outside the tokenizer's vocabulary (size {self.vocab_size})")
        logprobs = getattr(output, "log_probs", None)
        if logprobs is None:
            return ids, [0.0] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"the server returned {len(logprobs)} logprobs for {len(ids)} tokens")
        try:
            values = [float(lp) for lp in logprobs]
        except (TypeError, ValueError):
            raise _ServerError("the server returned logprobs that are not numbers") from None
        if not all(math.isfinite(lp) for lp in values):  # NaN/inf would reach verl's importance ratios
            raise _ServerError(f"the server returned logprobs that are not finite: "
                               f"{[lp for lp in values if not math.isfinite(lp)][:3]}")
        return ids, values

    @staticmethod
    def _new_messages(before: Sequence[dict[str, Any]], info: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The messages the env added after its record of the response, and its whole history."""
        messages = [dict(m) for m in info.get("messages", [])]
        following = messages[len(before) + 1 :]
        if not following or not all(m.get("role") in ("user", "tool") for m in following):
            raise _EnvError(f"the env's new messages are not user or tool messages: {[m.get('role') for m in following]}")
        return following, messages


class SeeupoAgentLoopWorker(AgentLoopWorker):
    """verl's agent-loop worker; a row whose `agent_name` is not registered runs `SeeupoAgentLoop`,
    which ends it alone as `bad_row` (verl's own worker asserts, and the whole batch ends)."""

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                              agent_name: str, trace: bool = True, **kwargs: Any) -> Any:
        if not isinstance(agent_name, str) or agent_name not in _agent_loop_registry:
            kwargs[UNKNOWN_AGENT], agent_name = agent_name, AGENT_NAME
        return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace, **kwargs)


class SeeupoAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager with `SeeupoAgentLoopWorker`s (`agent_loop_manager_class` in verl's config)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        self.agent_loop_workers_class = ray.remote(SeeupoAgentLoopWorker)
        super().__init__(*args, **kwargs)


# ----------------------------------------------------------------------------------- datasets


def build_dataset(
    env_id: str,
    task_ids: Sequence[str] | None = None,
    *,
    agent_name: str = AGENT_NAME,
    **env_kwargs: Any,
) -> list[dict[str, Any]]:
    """verl's rows (RLHFDataset columns) for the tasks of `env_id`.

    task_ids: the tasks (default: the env's own task list, i.e. its split). Each row: `prompt` (the
    env's first messages, which verl uses to filter overlong prompts), `data_source` (the env id),
    `agent_name`, `ability`, `reward_model` (the env scores: no ground truth here) and `extra_info`
    (`split`: the env's split kwarg, default "train"; `index`, `task_id`, `env_id`, `env_kwargs` as JSON).
    A row's `env_kwargs` holds only the kwargs a row may set (`ROW_KWARGS`); the others (AppWorld's
    `data_dir`, say) render the prompts here and belong in the agent loop's `env_kwargs`.
    """
    allowed = ROW_KWARGS.get(env_id, frozenset())
    config_only = sorted(set(env_kwargs) - allowed)
    if config_only:
        logger.warning("build_dataset: %s not written into the rows (rows may not set them); give them in the "
                       "agent loop's env_kwargs", config_only)
    row_kwargs = {key: value for key, value in env_kwargs.items() if key in allowed}
    return [
        {
            "data_source": env_id,
            "agent_name": agent_name,
            "prompt": prompt,
            "ability": "agent",
            "reward_model": {"style": "env", "ground_truth": ""},
            "extra_info": {"split": str(env_kwargs.get("split", "train")), "index": index, "task_id": task_id, "env_id": env_id,
                           "env_kwargs": json.dumps(row_kwargs)},
        }
        for index, (task_id, prompt) in enumerate(task_prompts(env_id, task_ids, **env_kwargs))
    ]


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Rows from `build_dataset` as the parquet file verl's `data.train_files` reads (its folder made if missing)."""
    import pandas as pd

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    pd.DataFrame(list(rows)).to_parquet(path)
