"""A verifiers v1 taskset over an env served by `seeupo-serve` (its OpenEnv WebSocket session).

The env plays the user, as verifiers' own OpenEnv env does: `SeeupoEnv.run` resets a session for the
task, hands the agent the env's system prompt and first user message, sends each reply's whole text
as the env's step (`{"response": text}`: the model's text is never parsed here, the env's own parser
and checks read it), and gives the env's next message back as the next user turn until the env ends
the episode. The reward is the env's return (its rewards summed; ours come at the end), read by the
task's `@vf.reward` from the trace: never recomputed. An episode the agent leaves before the env ends
it (its turn cap, an error) scores 0.0 with `info["seeupo"]["done"]` False.

`SeeupoHarness` is verifiers' null harness (its chat program, unchanged) run by the eval's own
interpreter when the runtime is the local subprocess one, so that no uv environment is made (the
null harness's `uv sync --script` downloads openai, mcp, httpx from PyPI); elsewhere it is the
null harness as is. `--env.player.harness.id null` picks verifiers' own.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import Field

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program
from verifiers.v1.runtimes import SubprocessConfig
from seeupo_serve_client import ServeSession, Step, served_env, user_turn


class SeeupoData(vf.TaskData):
    serve_url: str
    reset: dict[str, Any] = Field(default_factory=dict)


class SeeupoConfig(vf.TasksetConfig):
    serve_url: str = "http://127.0.0.1:8000"
    """The `seeupo-serve` URL (token: $SEEUPO_SERVE_TOKEN, required by the server off loopback)."""
    task_ids: list[str] = Field(default_factory=list)
    """Tasks to play (default: every task the server lists, see the taskset's own filters)."""
    timeout_s: float = Field(600.0, gt=0)
    """One env reset or step."""


class SeeupoTask(vf.Task[SeeupoData]):
    @vf.reward(weight=1.0)
    async def env_reward(self, trace: vf.Trace) -> float:
        """The env's return for the episode, as `SeeupoEnv.run` recorded it (0.0 if it did not end)."""
        seeupo = trace.info.get("seeupo") or {}
        return float(seeupo.get("return", 0.0)) if seeupo.get("done") else 0.0


class SeeupoTaskset(vf.Taskset[SeeupoTask, SeeupoConfig]):
    """Every task the server lists (or `task_ids`), in its order; subclasses filter."""

    ENV_ID: str = ""

    def served(self) -> dict[str, Any]:
        served = served_env(self.config.serve_url)
        if self.ENV_ID and served.get("env_id") != self.ENV_ID:
            raise ValueError(f"{self.config.serve_url} serves {served.get('env_id')!r}, not {self.ENV_ID}: "
                             f"start `seeupo-serve {self.ENV_ID}` for this taskset")
        return served

    def resets(self) -> Iterator[dict[str, Any]]:
        task_ids = self.config.task_ids or self.served().get("task_ids") or []
        for task_id in task_ids:
            yield {"task_id": str(task_id)}

    def load(self) -> Iterator[SeeupoTask]:
        for reset in self.resets():
            name = str(reset.get("task_id", f"seed-{reset.get('seed')}"))
            yield SeeupoTask(SeeupoData(id=name, name=name, prompt=None, serve_url=self.config.serve_url, reset=reset),
                             self.config.task)


class SeeupoHarness(NullHarness):
    """verifiers' null chat program, run by this interpreter on the local subprocess runtime."""

    async def setup(self, runtime: vf.Runtime) -> None:
        if not isinstance(runtime.config, SubprocessConfig):
            await super().setup(runtime)

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if not isinstance(runtime.config, SubprocessConfig):
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        system_prompt, prompt = self.resolve_prompt(data)
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE, self.config, ctx, trace, _ThisInterpreter(runtime), endpoint, secret, mcp_urls,
            system_prompt, prompt,
            extra_args=[f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else ())


class _ThisInterpreter:
    """The runtime, except that a PEP 723 script runs with this interpreter (which has the chat
    program's packages: openai, mcp, httpx, tenacity, certifi) instead of a uv environment."""

    _written: dict[str, asyncio.Lock] = {}  # script path -> its writer's lock (rollouts share one path)

    def __init__(self, runtime: vf.Runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"{self._runtime.scripts_dir}/{hashlib.sha256(data).hexdigest()}.py"
        lock = self._written.setdefault(path, asyncio.Lock())
        async with lock:
            if not getattr(lock, "done", False):
                await self._runtime.write(path, data)
                lock.done = True  # type: ignore[attr-defined]
        return [sys.executable, path]


class SeeupoEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(runtime=SubprocessConfig())


class SeeupoEnv(vf.Env[SeeupoEnvConfig]):
    async def run(self, task, agents):
        data: SeeupoData = task.data
        async with ServeSession(data.serve_url, timeout_s=getattr(self.taskset.config, "timeout_s", 600.0)) as env:
            first: Step = await env.reset(**data.reset)
            messages = first.messages
            system = "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
            played = task.with_data(system_prompt=system or None, prompt=None)
            total, done, last = 0.0, False, first
            async with agents.player.interaction(played) as interaction:
                segment = await interaction.turn(user_turn(messages))
                seen = len(messages)
                while not segment.terminated:
                    last = await env.step(segment.last_reply)
                    total += last.reward
                    if last.done:
                        done = True
                        break
                    messages = last.messages
                    # The env's messages after the response it recorded: the next user turn.
                    segment = await interaction.turn(user_turn(messages[seen + 1:]) or last.text)
                    seen = len(messages)
                interaction.trace.info["seeupo"] = {
                    "return": total, "done": done, "truncated": last.truncated,
                    **{key: last.info[key] for key in ("task_id", "turn", "success", "action_error") if key in last.info}}
