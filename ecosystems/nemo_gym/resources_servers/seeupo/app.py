"""NeMo Gym resource server for seeupo-gym's envs (BFCL v4 multi-turn, AppWorld, TurnBandit), each
served by `seeupo-serve` and reached over its OpenEnv WebSocket session (`seeupo_serve_client`).

A `GymnasiumServer` for NeMo Gym's `gymnasium_agent`: `/reset` opens one seeupo-serve session per
NeMo Gym session and starts the row's task (`task_id`, `seed`); `/step` sends the model's output
text as the turn's whole response. Rewards and episode ends are the env's own, passed through
unchanged (the agent sums step rewards; ours are 0 until the end). The model's text is never
parsed here: the env's own parser and checks read it, so hostile text is an invalid action of the
env (reward 0), never something this server runs.

Rows carry the env's system prompt as `responses_create_params.input` (written by
`prepare_data.py` from the served env) and its sha256 as `prompt_sha256`; a row made for another
env or other env kwargs is refused at reset.

Each NeMo Gym session holds one seeupo-serve session, and a reset without a session cookie makes a
new NeMo Gym session: so sessions are reaped here, not left to seeupo-serve's idle timeout
(`seeupo_sessions.py`): at each reset, sessions unused for `session_idle_s` are closed, then, at the cap,
the least recently used finished episode; a live episode is never closed for another (with every
slot live the reset is refused). The cap is `max_sessions`, at most seeupo-serve's own (read from
its description), so this front refuses before seeupo-serve does.

When seeupo-serve has a token (`$SEEUPO_SERVE_TOKEN`), so does this front: every request, from
loopback too, must carry it (`Authorization: Bearer <token>`), as seeupo-serve itself asks. NeMo
Gym's own servers send no such header: a run whose agent reaches this front without it must say so
(`front_requires_token: false`), and keep the front's port to itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any, Dict, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from nemo_gym.base_resources_server import BaseResourcesServerConfig
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.server_utils import SESSION_ID_KEY
from resources_servers.gymnasium import GymnasiumServer, extract_text
from seeupo_serve_client import ServeError, ServeSession, Step, served_env, system_messages, user_turn
from seeupo_sessions import Session, SessionsFull, credential_refusal, effective_cap, to_close

# Info keys passed back per step: small and JSON-safe (the chat itself is in the rollout).
INFO_KEYS = ("turn", "task_id", "user_turn", "action_error", "end", "success", "category", "num_user_turns")
TOKEN_ENV = "SEEUPO_SERVE_TOKEN"
# The largest reward passed on (as seeupo_gym.remote.MAX_ABS_REWARD): ours score in [-1, 1]; a served
# 1e300 is finite but inf in any float32 table downstream.
MAX_ABS_REWARD = 1e6


def prompt_sha256(system: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(system, sort_keys=True).encode()).hexdigest()


def small_info(step: Step) -> dict[str, Any]:
    return {key: step.info[key] for key in INFO_KEYS if key in step.info}


def checked_reward(reward: float) -> float:
    """The served step's reward (seeupo_serve_client has checked it is a finite number), refused
    when it is over `MAX_ABS_REWARD` in size."""
    if not abs(reward) <= MAX_ABS_REWARD:
        raise ServeError(f"the served env sent reward {reward:.3g}; a reward is at most {MAX_ABS_REWARD:g} in size")
    return reward


class SeeupoResourcesServerConfig(BaseResourcesServerConfig):
    serve_url: str = Field(description="the seeupo-serve URL, e.g. http://127.0.0.1:8000 (token: $SEEUPO_SERVE_TOKEN)")
    timeout_s: float = Field(600.0, gt=0, description="one env reset or step")
    max_sessions: Optional[int] = Field(None, gt=0, description="open sessions at most (null: seeupo-serve's "
                                        "max_sessions; never more than it); a live episode is never closed for another")
    session_idle_s: float = Field(300.0, gt=0, description="a session unused this long is closed at the next reset")
    front_requires_token: bool = Field(True, description="with $SEEUPO_SERVE_TOKEN set, ask every peer for it")


class SeeupoServer(GymnasiumServer):
    ray_enabled = False
    config: SeeupoResourcesServerConfig
    sessions: Dict[str, Any] = Field(default_factory=dict)  # NeMo Gym session id -> Session
    session_cap: Optional[int] = None  # effective_cap, once seeupo-serve has described itself

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/close")(self._close_endpoint)
        token = (os.environ.get(TOKEN_ENV) or None) if self.config.front_requires_token else None

        @app.middleware("http")
        async def require_credential(request: Request, call_next):
            refusal = credential_refusal(token, request.headers.get("authorization"))
            if refusal:
                return JSONResponse({"detail": refusal}, status_code=401)
            return await call_next(request)

        return app

    async def _close_endpoint(self, request: Request) -> dict:
        await self.close_session(request.session.get(SESSION_ID_KEY))
        return {}

    async def reap(self) -> None:
        """Close what `seeupo_sessions.to_close` picks so that one more session fits under the cap; a
        reset with only live episodes in the slots is refused."""
        if self.session_cap is None:
            served = await asyncio.to_thread(served_env, self.config.serve_url, timeout_s=min(self.config.timeout_s, 60.0))
            self.session_cap = effective_cap(self.config.max_sessions, served.get("max_sessions"))
        try:
            closing = to_close(self.sessions, cap=self.session_cap, idle_s=self.config.session_idle_s,
                               now=time.monotonic())
        except SessionsFull as error:
            raise ServeError(str(error)) from None
        for session_id in closing:
            await self.close_session(session_id)

    async def reset(self, metadata: dict, session_id: Optional[str] = None) -> tuple[Optional[str], dict]:
        await self.close_session(session_id)
        await self.reap()
        options = {key: metadata[key] for key in ("task_id", "seed") if metadata.get(key) is not None}
        session = ServeSession(self.config.serve_url, timeout_s=self.config.timeout_s)
        try:
            first = await session.reset(**options)
            expected = metadata.get("prompt_sha256")
            if expected is not None and expected != prompt_sha256(system_messages(first.messages)):
                raise ServeError("this row's system prompt is not the served env's (another env, or other env kwargs): "
                                 "write the rows again with prepare_data.py against this server")
        except BaseException:
            await session.close()
            raise
        messages = first.messages
        entry = self.sessions[session_id] = Session(session)
        entry.seen = len(messages)
        return user_turn(messages), {**small_info(first), "supports_explicit_close": True}

    async def step(self, action: NeMoGymResponse, metadata: dict, session_id: Optional[str] = None
                   ) -> tuple[Optional[str], float, bool, bool, dict]:
        if session_id not in self.sessions:
            raise ServeError("no episode in this session: /reset first")
        entry = self.sessions[session_id]
        entry.busy += 1
        try:
            result = await entry.serve.step(extract_text(action))
        finally:
            entry.busy -= 1
            entry.last_used = time.monotonic()
        try:
            checked_reward(result.reward)
        except ServeError:
            await self.close_session(session_id)  # that episode ends here; the others go on
            raise
        entry.done = result.done
        messages = result.messages
        # The new messages after the response the env recorded: the next user turn or tool results.
        observation = None if result.done else user_turn(messages[entry.seen + 1:]) or result.text
        entry.seen = len(messages)
        return observation, result.reward, result.done and not result.truncated, result.truncated, small_info(result)

    async def close_session(self, session_id: Optional[str]) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is not None:
            await entry.serve.close()
        self._cleanup_session(session_id)


if __name__ == "__main__":
    SeeupoServer.run_webserver()
