"""`seeupo-serve` driven by openenv-core's own client (GenericEnvClient) and by raw requests,
and the gymnasium client `seeupo/Remote-v0` against the local env (BFCL v4 and TurnBandit;
AppWorld is in test_openenv_serve_appworld.py)."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import httpx
import pytest

pytest.importorskip("openenv.core")
from openenv.core import GenericEnvClient  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.agents.backends import Backend  # noqa: E402
from seeupo_gym.bfcl import get_entry, render_action, render_turn_end  # noqa: E402
from seeupo_gym.remote import RemoteEnv, RemoteEnvError  # noqa: E402
from serve_helpers import serving  # noqa: E402

BFCL_KWARGS = {"max_turns": 12}
BANDIT_KWARGS = {"variant": "mixed", "num_tasks": 8, "max_turns": 4}
BANDIT_ACTIONS = ["A", "<think>maybe</think>\nB", "no idea", "C", "A", "B"]


def bfcl_script(task_id: str) -> list[str]:
    actions = []
    for calls in get_entry(task_id).ground_truth:
        if calls:
            actions.append(render_action(list(calls), thought="these calls do what the user asked"))
        actions.append(render_turn_end("Done.", thought="nothing left to call"))
    return actions


@pytest.fixture(scope="module")
def bfcl_server():
    with serving("seeupo/BFCL-v4-v0", "--max-sessions", "9", "max_turns=12") as served:
        yield served


@pytest.fixture(scope="module")
def bandit_server():
    with serving("seeupo/TurnBandit-v0", "--max-sessions", "4", "variant=mixed", "num_tasks=8", "max_turns=4") as served:
        yield served


def client(url: str):
    return GenericEnvClient(base_url=url).sync()


def play_remote(url: str, task_id: str, actions: list[str], seed: int = 0):
    with client(url) as env:
        result = env.reset(seed=seed, task_id=task_id)
        steps = [result]
        for action in actions:
            result = env.step({"response": action})
            steps.append(result)
            if result.done:
                break
    return steps


def play_local(env_id: str, kwargs: dict, task_id: str | None, actions: list[str], seed: int):
    env = gym.make(env_id, **kwargs)
    try:
        observation, info = env.reset(seed=seed, options={"task_id": task_id} if task_id else None)
        steps = [(observation, 0.0, False, False, info)]
        for action in actions:
            observation, reward, terminated, truncated, info = env.step(action)
            steps.append((observation, reward, terminated, truncated, info))
            if terminated or truncated:
                break
    finally:
        env.close()
    return steps


def test_a_ground_truth_bfcl_episode_scores_one_through_the_openenv_client(bfcl_server):
    steps = play_remote(bfcl_server.url, "multi_turn_base_0", bfcl_script("multi_turn_base_0"))
    first, last = steps[0], steps[-1]
    assert first.done is False and "# How to" in first.observation["text"]
    assert first.observation["info"]["task_id"] == "multi_turn_base_0"
    assert (last.reward, last.done, last.observation["truncated"]) == (1.0, True, False)
    assert last.observation["info"]["success"] is True
    assert last.observation["info"]["turn_results"] == ["passed"] * 4
    assert all(step.reward == 0.0 for step in steps[1:-1])


def test_http_routes_answer_as_openenv_describes(bfcl_server):
    url = bfcl_server.url
    assert httpx.get(f"{url}/health").json() == {"status": "healthy"}
    schema = httpx.get(f"{url}/schema").json()
    assert schema["action"]["properties"]["response"]["type"] == "string"
    assert set(schema["observation"]["properties"]) >= {"text", "truncated", "info", "reward", "done"}
    assert httpx.get(f"{url}/metadata").json()["name"] == "seeupo/BFCL-v4-v0"
    reset = httpx.post(f"{url}/reset", json={"seed": 1, "task_id": "multi_turn_base_3"}).json()
    assert reset["done"] is False and reset["observation"]["info"]["task_id"] == "multi_turn_base_3"
    assert httpx.get(f"{url}/state").json()["step_count"] == 0
    described = httpx.get(f"{url}/seeupo/env").json()
    assert described["env_kwargs"] == BFCL_KWARGS and described["observation_space"]["type"] == "UnicodeText"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_remote_bfcl_env_equals_the_local_env(bfcl_server, seed):
    remote = gym.make("seeupo/Remote-v0", url=bfcl_server.url, env_id="seeupo/BFCL-v4-v0", env_kwargs=BFCL_KWARGS)
    local = gym.make("seeupo/BFCL-v4-v0", **BFCL_KWARGS)
    try:
        assert remote.observation_space == local.observation_space and remote.action_space == local.action_space
        assert remote.unwrapped.task_ids == local.unwrapped.task_ids
        remote_first, local_first = remote.reset(seed=seed), local.reset(seed=seed)  # the env's seeded draw
        assert remote_first == local_first
        task_id = local_first[1]["task_id"]
        actions = bfcl_script(task_id)
        actions.insert(1, "<think>oops</think>\n[not a call(")  # an error turn too
        for action in actions:
            remote_step, local_step = remote.step(action), local.step(action)
            assert remote_step == local_step
            assert [type(v) for v in remote_step[4].values()] == [type(v) for v in local_step[4].values()]
            if local_step[2] or local_step[3]:
                break
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_remote_turnbandit_env_equals_the_local_env(bandit_server, seed):
    remote = gym.make("seeupo/Remote-v0", url=bandit_server.url, env_id="seeupo/TurnBandit-v0",
                      env_kwargs=BANDIT_KWARGS)
    try:
        remote_steps = [remote.reset(seed=seed)]
        for action in BANDIT_ACTIONS:
            remote_steps.append(step := remote.step(action))
            if step[2] or step[3]:
                break
    finally:
        remote.close()
    local_steps = play_local("seeupo/TurnBandit-v0", BANDIT_KWARGS, None, BANDIT_ACTIONS, seed)
    assert remote_steps[0] == local_steps[0][::4]
    assert remote_steps[1:] == local_steps[1:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_remote_envs_run_under_make_vec_as_the_local_ones(bandit_server, mode):
    def run(env_id, **kwargs):
        envs = gym.make_vec(env_id, num_envs=2, vectorization_mode=mode, **kwargs)
        try:
            out = [envs.reset(seed=[5, 6])]
            for action in ["A", "B"]:
                out.append(envs.step([action, action]))
        finally:
            envs.close()
        return json.dumps(out, default=lambda a: a.tolist() if hasattr(a, "tolist") else list(a))

    remote = run("seeupo/Remote-v0", url=bandit_server.url, env_kwargs=BANDIT_KWARGS)
    assert remote == run("seeupo/TurnBandit-v0", **BANDIT_KWARGS)


def test_eight_concurrent_sessions_stay_isolated(bfcl_server):
    tasks = [f"multi_turn_base_{i}" for i in range(8)]

    def episode(task_id):
        actions = bfcl_script(task_id)
        return [(s.observation, s.reward, s.done) for s in play_remote(bfcl_server.url, task_id, actions)]

    with ThreadPoolExecutor(8) as pool:
        remote = list(pool.map(episode, tasks))
    for task_id, steps in zip(tasks, remote):
        local = play_local("seeupo/BFCL-v4-v0", BFCL_KWARGS, task_id, bfcl_script(task_id), seed=0)
        assert [(o["text"], r) for o, r, _ in steps[1:]] == [(s[0], s[1]) for s in local[1:]]
        assert steps[-1][1] == 1.0 and steps[-1][0]["info"]["task_id"] == task_id


def test_sessions_past_max_sessions_are_refused_and_a_freed_slot_is_reused(bandit_server):
    envs = [client(bandit_server.url) for _ in range(4)]
    try:
        for env in envs:
            env.reset(seed=0)
        # The server says why it refuses the session, then closes it.
        with connect(bandit_server.url.replace("http", "ws") + "/ws") as ws:
            refusal = json.loads(ws.recv(timeout=30))
        assert refusal["data"]["code"] == "CAPACITY_REACHED" and "4/4 sessions" in refusal["data"]["message"]
        with pytest.raises(RemoteEnvError, match="at capacity"):
            RemoteEnv(bandit_server.url).reset(seed=0)
        envs.pop().close()
        with client(bandit_server.url) as again:  # a closed session frees its slot
            assert again.reset(seed=0).done is False
    finally:
        for env in envs:
            env.close()


def test_bad_requests_get_clear_errors_and_the_server_goes_on(bfcl_server):
    url = bfcl_server.url
    ws_url = url.replace("http", "ws") + "/ws"
    bystander = client(url)  # another session, mid-episode while the bad requests come in
    bystander_actions = bfcl_script("multi_turn_base_2")
    bystander.reset(seed=0, task_id="multi_turn_base_2")
    bystander.step({"response": bystander_actions[0]})
    with connect(ws_url) as ws:
        def ask(raw: str) -> dict:
            ws.send(raw)
            return json.loads(ws.recv(timeout=30))

        assert ask("{not json")["data"]["code"] == "INVALID_JSON"
        assert ask(json.dumps({"type": "dance"}))["data"]["code"] == "UNKNOWN_TYPE"
        no_episode = ask(json.dumps({"type": "step", "data": {"response": "hi"}}))["data"]
        assert "no episode is running" in no_episode["message"]
        bad_seed = ask(json.dumps({"type": "reset", "data": {"seed": "seven"}}))["data"]
        assert "seed must be a non-negative integer" in bad_seed["message"]
        bad_task = ask(json.dumps({"type": "reset", "data": {"task_id": 5}}))["data"]
        assert "task_id must be a task name" in bad_task["message"]
        unknown_task = ask(json.dumps({"type": "reset", "data": {"task_id": "multi_turn_base_99999"}}))["data"]
        assert unknown_task["code"] == "EXECUTION_ERROR" and "multi_turn_base_99999" in unknown_task["message"]
        unknown_option = ask(json.dumps({"type": "reset", "data": {"taskid": "multi_turn_base_0"}}))["data"]
        assert "unknown option(s) ['taskid']" in unknown_option["message"]
        assert ask(json.dumps({"type": "reset", "data": {"seed": 0, "task_id": "multi_turn_base_0"}}))["type"] == "observation"
        wrong_type = ask(json.dumps({"type": "step", "data": {"response": 5}}))["data"]
        # openenv answers a pydantic error with a bare "Invalid message"; ours names the field.
        assert "`response` must be a string" in wrong_type["message"]
        wrong_field = ask(json.dumps({"type": "step", "data": {"text": "hi"}}))["data"]
        assert "the field `response` is missing" in wrong_field["message"]
        # The session survived all of it: the episode still plays to 1.0.
        for action in bfcl_script("multi_turn_base_0"):
            answer = ask(json.dumps({"type": "step", "data": {"response": action}}))
        assert answer["type"] == "observation", answer
        assert answer["data"]["reward"] == 1.0 and answer["data"]["done"] is True
    stateless = httpx.post(f"{url}/step", json={"action": {"response": "hi"}})
    assert stateless.status_code == 409 and "WebSocket session at /ws" in stateless.json()["detail"]
    assert httpx.post(f"{url}/step", json={"action": {"response": 5}}).status_code == 422
    assert httpx.post(f"{url}/reset", content=b"{oops", headers={"content-type": "application/json"}).status_code == 422
    assert httpx.post(f"{url}/reset", json={"seed": 0, "task_id": 5}).status_code == 400
    huge = httpx.post(f"{url}/reset", json={"seed": 0, "task_id": "x" * (2 << 20)})
    assert huge.status_code == 413
    with connect(ws_url, max_size=None) as ws:  # a message over the bound closes that connection only
        ws.send(json.dumps({"type": "step", "data": {"response": "x" * (2 << 20)}}))
        with pytest.raises(Exception):
            ws.recv(timeout=30)
    assert play_remote(url, "multi_turn_base_1", bfcl_script("multi_turn_base_1"))[-1].reward == 1.0
    assert httpx.get(f"{url}/health").status_code == 200
    with bystander:  # untouched by all of it
        results = [bystander.step({"response": action}) for action in bystander_actions[1:]]
    assert results[-1].reward == 1.0 and results[-1].done


def test_idle_sessions_are_reaped_and_then_answer_with_a_clear_error():
    with serving("seeupo/TurnBandit-v0", "--idle-timeout", "5") as served:
        env = client(served.url)
        try:
            env.reset(seed=0)
            assert httpx.get(f"{served.url}/seeupo/env").json()["live_envs"] == 1
            deadline = 30
            import time

            start = time.monotonic()
            while httpx.get(f"{served.url}/seeupo/env").json()["live_envs"] and time.monotonic() - start < deadline:
                time.sleep(0.5)
            assert httpx.get(f"{served.url}/seeupo/env").json()["live_envs"] == 0
            with pytest.raises(RuntimeError, match="session is closed"):
                env.step({"response": "A"})
        finally:
            env.close()


def test_a_token_guards_every_route_but_health(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with serving("seeupo/TurnBandit-v0", "--token-file", str(token_file)) as served:
        url = served.url
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/schema").status_code == 401
        assert httpx.get(f"{url}/schema", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/schema", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(ConnectionError, match="HTTP 403"):
            client(url).reset(seed=0)
        # openenv's client sends a URL's credentials as basic auth: the token is the password.
        with client(url.replace("http://", "http://seeupo:s3cret@")) as env:
            assert env.reset(seed=0).done is False
        with pytest.raises(RemoteEnvError):
            RemoteEnv(url)
        remote = RemoteEnv(url, token="s3cret")
        try:
            assert remote.reset(seed=0)[1]["turn"] == 0
        finally:
            remote.close()


def test_a_non_loopback_address_without_a_token_is_refused_before_binding():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "seeupo_gym.integrations.openenv_cli", "seeupo/TurnBandit-v0", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0 and "give a token" in result.stderr


def test_a_dead_server_or_a_lost_session_is_a_clear_error():
    with serving("seeupo/TurnBandit-v0") as served:
        remote = RemoteEnv(served.url)
        remote.reset(seed=0)
        served.stop(signal.SIGKILL)
        with pytest.raises(RemoteEnvError, match="lost the session"):
            remote.step("A")
        with pytest.raises(RemoteEnvError, match="cannot open a session"):
            remote.reset(seed=0)
        remote.close()
        with pytest.raises(RemoteEnvError, match="cannot reach the env server"):
            RemoteEnv(served.url)


def test_a_client_naming_another_env_or_other_kwargs_is_refused(bandit_server):
    with pytest.raises(ValueError, match="serves 'seeupo/TurnBandit-v0', not 'seeupo/BFCL-v4-v0'"):
        RemoteEnv(bandit_server.url, env_id="seeupo/BFCL-v4-v0")
    with pytest.raises(ValueError, match="start it with the same key=value pairs"):
        RemoteEnv(bandit_server.url, env_id="seeupo/TurnBandit-v0", env_kwargs={"variant": "easy"})


# ----------------------------------------------------------------------------- in collection


def test_the_vector_agent_on_a_server_collects_the_local_batch(bandit_server, tiny, one_torch_thread):
    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import VectorAgent

    model, tokenizer = tiny

    def run(**where):
        with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                         env_kwargs=BANDIT_KWARGS, sampling=SamplingParams(max_new_tokens=4), **where) as agent:
            assert all(isinstance(env.unwrapped, RemoteEnv) == bool(where) for env in agent.envs)
            batch = agent.collect([None, "mixed-0-3"], group_size=2, seed=3)
        return [(t.rollout_id, t.reward, t.info["end"], t.info["messages"], [x.response_ids for x in t.turns])
                for t in batch]

    remote = run(url=bandit_server.url)
    assert remote == run() and "env_error" not in [t[2] for t in remote]


class DropsASession(Backend):
    """Wraps the real backend; before its second call it drops env slot 0's connection (a lost session)."""

    def __init__(self, backend):
        self.backend, self.agent, self.calls = backend, None, 0

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == 2:
            self.agent.envs[0].unwrapped._ws.close()
        return self.backend.generate(prompts, sampling)

    def update_weights(self, state_dict_or_model):
        self.backend.update_weights(state_dict_or_model)


def test_a_lost_session_ends_its_episode_as_an_env_error_and_the_env_is_replaced(bandit_server, tiny,
                                                                                 one_torch_thread):
    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent

    model, tokenizer = tiny
    backend = DropsASession(HFBackend(model, tokenizer))
    with VectorAgent("seeupo/TurnBandit-v0", backend, tokenizer, num_envs=2, env_kwargs=BANDIT_KWARGS,
                     sampling=SamplingParams(max_new_tokens=4), url=bandit_server.url) as agent:
        backend.agent = agent
        first = agent.envs[0]
        batch = agent.collect(["mixed-0-1", "mixed-0-2"], group_size=1, seed=0).trajectories
        assert batch[0].info["end"] == END_ENV_ERROR and "lost the session" in batch[0].info["error"]
        assert batch[1].info["end"] != END_ENV_ERROR and agent.envs[0] is not first
        again = agent.collect(["mixed-0-1", "mixed-0-2"], group_size=1, seed=0).trajectories
        assert END_ENV_ERROR not in [t.info["end"] for t in again]


def test_a_dead_server_fails_collection_with_a_clear_error_after_the_retries(tiny, one_torch_thread):
    from types import SimpleNamespace

    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import VectorAgent
    from seeupo_gym.training.collection import RolloutError, collect

    model, tokenizer = tiny
    with serving("seeupo/TurnBandit-v0") as served:
        with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                         sampling=SamplingParams(max_new_tokens=4), url=served.url) as agent:
            served.stop(signal.SIGKILL)
            # every episode an env error: its env's session lost, and no new env made (VectorAgent keeps going)
            with pytest.raises(RolloutError, match="every episode hit an env error.*(cannot open a session with|cannot "
                                                   "reach) the env server"):
                collect(SimpleNamespace(num_processes=1, process_index=0), agent, ["mixed-0-1"], 1,
                        seed=0, retries=1, what="step 1")


# Slow suite: two training runs, ~50 s; the remote env's equality with the local one stays.
@pytest.mark.slow
def test_seeupo_train_with_env_url_trains_on_the_served_env_as_on_the_local_one(tmp_path, one_torch_thread):
    from seeupo_gym.training.cli import train_main

    metrics = {}
    with serving("seeupo/TurnBandit-v0", "variant=easy", "num_tasks=8", "max_turns=2") as served:
        for where, overrides in (("local", []), ("served", [f"env.url={served.url}"])):
            out = tmp_path / where
            code = train_main(["--config", "tiny-turnbandit", f"log.output_dir={out}", "train.steps=1",
                               "log.progress_bars=false", *overrides])
            assert code == 0
            metrics[where] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    local = {k: v for k, v in metrics["local"].items() if k.startswith(("rollout/", "update/"))}
    assert local["rollout/trajectories"] == 4.0 and local["rollout/env_errors"] == 0.0
    # Sampled logprobs carry the decode batch's shape in their last bits (per-episode joins rows as
    # they come), hence approx.
    assert {k: metrics["served"][k] for k in local} == pytest.approx(local, rel=1e-6)


def test_state_over_a_session_names_its_episode_and_turn(bandit_server):
    ws_url = bandit_server.url.replace("http", "ws") + "/ws"
    with connect(ws_url) as ws:
        def send(message):
            ws.send(json.dumps(message))
            return json.loads(ws.recv(timeout=60))["data"]

        send({"type": "reset", "data": {"seed": 0}})
        first = send({"type": "state"})
        assert isinstance(first["episode_id"], str) and len(first["episode_id"]) == 32 and first["turn"] == 0
        send({"type": "step", "data": {"response": "A"}})
        assert send({"type": "state"})["turn"] == 1
        send({"type": "reset", "data": {"seed": 1, "episode_id": "mine"}})
        named = send({"type": "state"})
        assert named["episode_id"] == "mine" and named["turn"] == 0 and named["done"] is False
        send({"type": "reset", "data": {"seed": 2}})
        assert send({"type": "state"})["episode_id"] not in (first["episode_id"], "mine")
