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
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional

from fastapi import Request
from pydantic import Field

from nemo_gym.base_resources_server import BaseResourcesServerConfig
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.server_utils import SESSION_ID_KEY
from resources_servers.gymnasium import GymnasiumServer, extract_text
from seeupo_serve_client import ServeError, ServeSession, Step, system_messages, user_turn

# Info keys passed back per step: small and JSON-safe (the chat itself is in the rollout).
INFO_KEYS = ("turn", "task_id", "user_turn", "action_error", "end", "success", "category", "num_user_turns")


def prompt_sha256(system: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(system, sort_keys=True).encode()).hexdigest()


def small_info(step: Step) -> dict[str, Any]:
    return {key: step.info[key] for key in INFO_KEYS if key in step.info}


class SeeupoResourcesServerConfig(BaseResourcesServerConfig):
    serve_url: str = Field(description="the seeupo-serve URL, e.g. http://127.0.0.1:8000 (token: $SEEUPO_SERVE_TOKEN)")
    timeout_s: float = Field(600.0, gt=0, description="one env reset or step")


class SeeupoServer(GymnasiumServer):
    ray_enabled = False
    config: SeeupoResourcesServerConfig
    sessions: Dict[str, Any] = Field(default_factory=dict)  # NeMo Gym session id -> [ServeSession, messages seen]

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/close")(self._close_endpoint)
        return app

    async def _close_endpoint(self, request: Request) -> dict:
        await self.close_session(request.session.get(SESSION_ID_KEY))
        return {}

    async def reset(self, metadata: dict, session_id: Optional[str] = None) -> tuple[Optional[str], dict]:
        await self.close_session(session_id)
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
        self.sessions[session_id] = [session, len(messages)]
        return user_turn(messages), {**small_info(first), "supports_explicit_close": True}

    async def step(self, action: NeMoGymResponse, metadata: dict, session_id: Optional[str] = None
                   ) -> tuple[Optional[str], float, bool, bool, dict]:
        if session_id not in self.sessions:
            raise ServeError("no episode in this session: /reset first")
        entry = self.sessions[session_id]
        session, seen = entry
        result = await session.step(extract_text(action))
        messages = result.messages
        # The new messages after the response the env recorded: the next user turn or tool results.
        observation = None if result.done else user_turn(messages[seen + 1:]) or result.text
        entry[1] = len(messages)
        return observation, result.reward, result.done and not result.truncated, result.truncated, small_info(result)

    async def close_session(self, session_id: Optional[str]) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is not None:
            await entry[0].close()
        self._cleanup_session(session_id)


if __name__ == "__main__":
    SeeupoServer.run_webserver()
