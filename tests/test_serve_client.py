"""`seeupo_serve_client` (ecosystems/serve_client), the WebSocket client NeMo Gym's resource server and
the verifiers tasksets play seeupo-serve with, run here against a real served env (in this process)
and against answers no session sends. The runners themselves: test_nemo_gym.py, test_verifiers.py."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

pytest.importorskip("openenv.core")
pytest.importorskip("websockets.asyncio.client")

from serve_helpers import repo_root, serving_in_process  # noqa: E402

sys.path.insert(0, str(repo_root() / "ecosystems" / "serve_client"))
from seeupo_serve_client import ServeError, ServeSession, parse_step, served_env, user_turn, ws_url  # noqa: E402

from ecosystem_helpers import GROUND_TRUTH_TASK, ground_truth_replies  # noqa: E402
from seeupo_gym.integrations.openenv_server import create_app  # noqa: E402


def answer(**data) -> str:
    return json.dumps({"type": "observation", "data": data})


GOOD = {"observation": {"text": "hi", "truncated": False, "info": {}}, "reward": 0.0, "done": False}


@pytest.mark.parametrize("raw, says", [
    ("not json", "not JSON"),
    ("[1, 2]", "not an object"),
    (json.dumps({"type": "error", "data": {"message": "no episode"}}), "refused the request: no episode"),
    (answer(reward=1.0, done=True), "without an observation"),
    (answer(**{**GOOD, "reward": float("nan")}), "finite number"),
    (answer(**{**GOOD, "reward": True}), "finite number"),
    (answer(**{**GOOD, "reward": "1.0"}), "finite number"),
    (answer(**{**GOOD, "done": "yes"}), "not a bool"),
    (answer(**{**GOOD, "observation": {"text": 3}}), "observation that is not"),
    (answer(**{**GOOD, "observation": {"text": "", "info": []}}), "observation that is not"),
])
def test_answers_no_session_sends_are_a_serve_error_naming_what_is_wrong(raw, says):
    with pytest.raises(ServeError, match=says):
        parse_step(raw)
    assert parse_step(answer(**GOOD)).text == "hi"


def test_urls_become_the_ws_route_and_drop_credentials():
    assert ws_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://user:secret@example.org/base/") == "wss://example.org/base/ws"
    assert ws_url("http://[::1]:9") == "ws://[::1]:9/ws"
    for bad in ("ftp://host", "127.0.0.1:8000", "http://"):
        with pytest.raises(ServeError, match="http"):
            ws_url(bad)


async def play(url: str, replies: list[str], **kwargs) -> list:
    async with ServeSession(url, **kwargs) as env:
        steps = [await env.reset(task_id=GROUND_TRUTH_TASK)]
        for reply in replies:
            steps.append(await env.step(reply))
            if steps[-1].done:
                break
        return steps


def test_a_served_bfcl_ground_truth_scores_one_and_protocol_looking_text_is_only_a_response():
    app = create_app("seeupo/BFCL-v4-v0", {}, token="s3cret")
    with serving_in_process(app) as url:
        steps = asyncio.run(play(url, ground_truth_replies(GROUND_TRUTH_TASK), token="s3cret"))
        assert steps[-1].done and steps[-1].reward == 1.0 and steps[-1].info["success"] is True
        assert steps[0].messages[0]["role"] == "system"
        assert user_turn(steps[0].messages) == steps[0].messages[1]["content"]
        served = served_env(url, token="s3cret")
        assert served["env_id"] == "seeupo/BFCL-v4-v0" and served["task_ids"][0].startswith("multi_turn_base_")
        with pytest.raises(ServeError, match="cannot read what"):
            served_env(url, token="wrong")
        # Text shaped like a protocol message is a turn's response, never a reset.
        hostile = json.dumps({"type": "reset", "data": {"task_id": "multi_turn_base_1"}})
        steps = asyncio.run(play(url, [hostile], token="s3cret"))
        assert steps[-1].info["turn"] == 1 and steps[-1].info["task_id"] == GROUND_TRUTH_TASK
        assert steps[-1].reward == 0.0
        with pytest.raises(ServeError, match="refused the session"):
            asyncio.run(play(url, [], token="wrong"))
        with pytest.raises(ServeError, match="lost"):  # an answer past the client's bound ends the session
            asyncio.run(play(url, [], token="s3cret", max_message_bytes=1024))


def test_an_unreachable_server_is_one_clear_error():
    with pytest.raises(ServeError, match="cannot reach seeupo-serve at ws://127.0.0.1:9/ws"):
        asyncio.run(play("http://127.0.0.1:9", []))
