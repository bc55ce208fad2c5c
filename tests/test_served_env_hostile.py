"""A served env cannot stop a trainer: against tests/hostile_env_server.py (a real process on
127.0.0.1) a reset the server refuses, an episode it never ends, a description it drips one byte per
1.5 s and a reward of 1e300 each end their own episode, within a deadline, in `seeupo/Remote-v0`,
TRL's environment adapter (what SeeUPOTrainer and GRPOTrainer step), VectorAgent (what
`seeupo-eval` and the trainer collect with) and verl's agent loop. Each test has the honest
server's run as its control."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import pytest

pytest.importorskip("websockets")

import seeupo_gym  # noqa: E402,F401
from seeupo_gym.remote import MAX_ABS_REWARD, RemoteEnv, RemoteEnvError  # noqa: E402

SCRIPT = Path(__file__).with_name("hostile_env_server.py")
TASKS = ["mixed-0-1", "mixed-0-2"]


@pytest.fixture(scope="module")
def hostile():
    """`hostile(mode)`: the URL at which the hostile server plays `mode`."""
    process = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"at (http://\S+)", line)
        assert match, f"the hostile server did not start: {line!r}"
        yield lambda mode: f"{match.group(1)}/{mode}"
    finally:
        process.kill()
        process.wait(timeout=30)


# ------------------------------------------------------------------------------ the client itself


def test_a_dripped_description_ends_at_connect_timeout_in_all(hostile):
    start = time.monotonic()
    with pytest.raises(RemoteEnvError, match=r"did not describe its env within connect_timeout_s=2 s"):
        RemoteEnv(hostile("drip_description"), connect_timeout_s=2)
    assert time.monotonic() - start < 4  # 1.5 x 2 s at most; before: ~1.5 s per byte of a ~2 kB body, per-read timeouts only
    RemoteEnv(hostile("honest"), connect_timeout_s=2).close()  # control: the same deadline suffices


@pytest.mark.parametrize("mode", ["drip_status", "drip_headers", "endless_continue"])
def test_a_description_whose_status_line_or_headers_drip_ends_at_connect_timeout_in_all(hostile, mode):
    start = time.monotonic()
    with pytest.raises(RemoteEnvError, match=r"did not describe its env within connect_timeout_s=2 s"):
        gym.make("seeupo/Remote-v0", url=hostile(mode), connect_timeout_s=2)
    assert time.monotonic() - start < 3  # 1.5 x; before: 25 s and more (each byte within the per-read timeout)


class Recorder:
    """A loopback listener that records whatever reaches it (standing in for a proxy) and answers nothing."""

    def __init__(self) -> None:
        import socket
        import threading

        self.received: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    pass


@pytest.fixture
def proxy(monkeypatch):
    """Every proxy variable names a recording listener (and nothing is exempt from it)."""
    recorder = Recorder()
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, recorder.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield recorder
    recorder.sock.close()


def test_the_token_goes_to_the_env_server_never_to_a_proxy(hostile, proxy):
    import urllib.request

    env = RemoteEnv(hostile("honest"), token="serve-secret", connect_timeout_s=5)
    env.reset(options={"task_id": TASKS[0]})
    env.step("A")
    env.close()
    assert proxy.received == []
    # control: a client that reads the proxy variables does reach the recorder
    with pytest.raises(OSError):
        # a fresh opener reads the proxy variables now (`urlopen` keeps the first opener of the process)
        urllib.request.build_opener().open(hostile("honest") + "/seeupo/env", timeout=3)
    assert proxy.received and b"/honest/seeupo/env" in proxy.received[0]


def test_openenv_clients_refuse_a_token_their_connect_would_send_through_a_proxy(proxy, monkeypatch):
    pytest.importorskip("openenv")
    from websockets.proxy import get_proxy
    from websockets.uri import parse_uri

    from seeupo_gym.integrations.openenv_client import SeeupoEnv, SeeupoToolSessionFactory

    remote = "http://192.0.2.7:8000"  # TEST-NET-1: never reached, construction alone is under test
    # control: OpenEnv's connect (websockets) would route this URL through the recording proxy
    assert get_proxy(parse_uri("ws://192.0.2.7:8000/ws")) == proxy.url
    token = {"Authorization": "Bearer serve-secret"}
    with pytest.raises(ValueError, match="through the proxy.*NO_PROXY"):
        SeeupoEnv(base_url=remote, headers=token)
    with pytest.raises(ValueError, match="through the proxy"):
        SeeupoToolSessionFactory(remote, headers=token).create(task={"task_id": "x"})
    assert proxy.received == []
    SeeupoEnv(base_url=remote)  # no credentials: nothing to leak
    SeeupoEnv(base_url="http://127.0.0.1:8000", headers=token)  # loopback: OpenEnv bypasses proxies
    monkeypatch.setenv("NO_PROXY", "192.0.2.7")
    SeeupoEnv(base_url=remote, headers=token)  # exempted by the user


def test_a_declared_turn_limit_is_capped_by_the_local_turn_cap(hostile):
    from seeupo_gym.remote import MAX_TURNS_CAP

    env = RemoteEnv(hostile("declared_turns"))
    assert env.max_turns == MAX_TURNS_CAP  # the server declares 10**9
    env.close()
    assert RemoteEnv(hostile("honest")).max_turns == 10  # the honest declaration, under the cap, stands


def test_trl_closing_steps_of_a_server_declaring_a_billion_turns_stop_at_the_local_turn_cap(hostile):
    from seeupo_gym.remote import MAX_TURNS_CAP

    environment = trl_environment(hostile("declared_turns"))
    environment.reset(task_id=TASKS[0])
    assert environment._final_reward() == 0.0  # before: 43,862 closing steps in 20 s, and on
    assert len(environment.steps) <= MAX_TURNS_CAP
    environment._close()


def test_an_episode_the_server_never_ends_is_ended_at_the_envs_own_turn_limit(hostile):
    env = RemoteEnv(hostile("never_done"))
    assert env.max_turns == 10  # the served TurnBandit's default, from its description
    env.reset(options={"task_id": TASKS[0]})
    for _ in range(9):
        assert env.step("nonsense")[2:4] == (False, False)
    with pytest.raises(RemoteEnvError, match=r"did not end the episode at its turn limit \(max_turns=10\)"):
        env.step("nonsense")
    env.close()
    control = RemoteEnv(hostile("honest"))  # the honest env truncates at the same step
    control.reset(options={"task_id": TASKS[0]})
    ends = [control.step("nonsense")[2:4] for _ in range(10)]
    assert ends[-1] == (False, True) and ends[:-1] == [(False, False)] * 9
    control.close()


def test_a_finite_but_huge_reward_is_refused_at_the_door(hostile):
    env = RemoteEnv(hostile("huge_reward"))
    env.reset(options={"task_id": TASKS[0]})
    with pytest.raises(RemoteEnvError, match=r"sent reward 1e\+300; a reward is at most 1e\+06 in size"):
        env.step("A")
    env.close()
    assert MAX_ABS_REWARD == 1e6  # 1e300 would be inf in a float32 table (verl's scores)


def test_a_refused_reset_is_a_remote_env_error(hostile):
    env = RemoteEnv(hostile("refuse_reset"))
    with pytest.raises(RemoteEnvError, match="refused reset: reset failed: no such luck"):
        env.reset(options={"task_id": TASKS[0]})
    env.close()


# ------------------------------------------------------------------------------ TRL's environments


def trl_environment(url):
    pytest.importorskip("trl")
    from seeupo_gym.integrations.trl import TurnBanditEnvironment

    cls = type("Served", (TurnBanditEnvironment,), {"env_kwargs": {}, "url": url})
    return cls()


def test_trl_a_refused_reset_ends_that_rollout_only(hostile):
    environment = trl_environment(hostile("refuse_reset"))
    first = environment.reset(task_id=TASKS[0])  # before: RemoteEnvError out of TRL's reset, the trainer gone
    assert first.startswith("Error: the episode could not start (RemoteEnvError")
    assert environment.answer("A") == "The episode is over."
    assert environment._final_reward() == 0.0
    environment._close()


def test_trl_final_reward_of_a_never_ending_episode_stops_at_the_turn_limit(hostile):
    environment = trl_environment(hostile("never_done"))
    environment.reset(task_id=TASKS[0])
    start = time.monotonic()
    assert environment._final_reward() == 0.0  # before: closing steps forever
    assert len(environment.steps) == 10 and time.monotonic() - start < 30
    environment._close()


def test_trl_a_huge_reward_scores_zero_and_the_honest_control_scores_the_env(hostile):
    scores = {}
    for mode in ("huge_reward", "honest"):
        environment = trl_environment(hostile(mode))
        environment.reset(task_id=TASKS[0])
        scores[mode] = environment._final_reward()
        environment._close()
    assert scores["huge_reward"] == 0.0 and math.isfinite(scores["honest"]) and abs(scores["honest"]) <= 1.0


# ------------------------------------------------------------------------------ VectorAgent


@pytest.mark.parametrize("mode", ["refuse_reset", "never_done", "huge_reward"])
def test_the_vector_agent_ends_each_hostile_episode_as_an_env_error(hostile, tiny, one_torch_thread, mode):
    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent

    model, tokenizer = tiny
    start = time.monotonic()
    with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                     sampling=SamplingParams(max_new_tokens=2), url=hostile(mode)) as agent:
        batch = agent.collect(TASKS, group_size=1, seed=0).trajectories
    assert [t.info["end"] for t in batch] == [END_ENV_ERROR] * 2
    assert all("RemoteEnvError" in t.info["error"] and t.reward == 0.0 for t in batch)
    assert all(len(t.turns) <= 10 for t in batch) and time.monotonic() - start < 120


# ------------------------------------------------------------------------------ seeupo-eval


@pytest.mark.slow  # a CLI process per mode (torch and the tiny model load each time): ~30-50 s each
@pytest.mark.parametrize("mode", ["refuse_reset", "never_done", "huge_reward"])
def test_seeupo_eval_ends_each_hostile_episode_as_an_env_error_and_reports(hostile, tmp_path, mode):
    import json

    start = time.monotonic()
    command = [str(Path(sys.executable).with_name("seeupo-eval")), "--model", "tiny", "--env", "seeupo/TurnBandit-v0",
               "--tasks", ",".join(TASKS), "-k", "1", "--json", "--no-progress", "--rollouts", str(tmp_path / "r.jsonl"),
               f"env.url={hostile(mode)}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 240
    rollouts = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["end"] for r in rollouts] == ["env_error"] * 2 and all(r["reward"] == 0.0 for r in rollouts)
    assert all(r["turns"] <= 10 for r in rollouts)


# ------------------------------------------------------------------------------ SeeUPOTrainer


def done_generate(tokenizer):
    """INJECTED generation, a stand-in for `model.generate`: every completion is "Done." (no tool
    call), so each rollout's reward comes from `_final_reward`'s closing steps."""
    import torch

    reply = tokenizer("Done.", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(input_ids, attention_mask=None, **kwargs):
        return torch.cat([input_ids, torch.tensor([reply] * len(input_ids), dtype=input_ids.dtype)], dim=1)

    return generate


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["refuse_reset",  # one real SeeUPOTrainer step with the tiny model: ~15 s each
                                  pytest.param("never_done", marks=pytest.mark.slow),
                                  pytest.param("huge_reward", marks=pytest.mark.slow)])
def test_seeupo_trainer_trains_its_step_through_a_hostile_served_env(hostile, tmp_path, one_torch_thread, mode):
    """Before: a refused reset raised out of `trainer.train()` (TRL resets outside any try), and a
    never-ending episode looped TRL's reward function forever."""
    pytest.importorskip("trl")
    import importlib.util

    spec = importlib.util.spec_from_file_location("seeupo_in_trl", Path(__file__).resolve().parents[1] / "scripts" /
                                                  "seeupo_in_trl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model_dir = script.save_tiny(tmp_path / "tiny")
    start = time.monotonic()
    trainer = script.train_in_trl(model_dir, tmp_path / "out", "reverse", 0.002, generate=done_generate,
                                  env={"url": hostile(mode)})
    assert trainer.state.global_step == 1 and time.monotonic() - start < 600
    assert all(environment._done and environment._reward == 0.0 for environment in trainer.environments)
    assert all(len(environment.steps) <= 10 for environment in trainer.environments)


def test_the_vector_agent_goes_on_when_a_failed_env_cannot_be_made_again_with_a_stand_in_factory(tiny, one_torch_thread):
    """STAND-IN env factory: its first envs refuse every reset, and every later env fails to be made
    (as a server that refuses a reset and then drips its description until connect_timeout_s).
    Before: the factory's error left `collect` and ended the collection."""
    import gymnasium as gym

    from seeupo_gym.agents.backends import HFBackend, SamplingParams
    from seeupo_gym.agents.vector import END_ENV_ERROR, VectorAgent

    made = []

    class RefusesResets(gym.Wrapper):
        def reset(self, **kwargs):
            raise RemoteEnvError("refused reset")

    def factory():
        made.append(1)
        if len(made) > 2:
            raise RemoteEnvError("did not describe its env within connect_timeout_s=30 s")
        return RefusesResets(gym.make("seeupo/TurnBandit-v0"))

    model, tokenizer = tiny
    with VectorAgent("seeupo/TurnBandit-v0", HFBackend(model, tokenizer), tokenizer, num_envs=2,
                     sampling=SamplingParams(max_new_tokens=2), env_factory=factory) as agent:
        batch = agent.collect(TASKS * 2, group_size=1, seed=0).trajectories
    assert [t.info["end"] for t in batch] == [END_ENV_ERROR] * 4 and len(made) > 2
    assert any("could not be made again" in t.info["error"] for t in batch)


@pytest.mark.slow  # the tiny model loads, then two 30 s description deadlines (the task list's env, the agent's)
@pytest.mark.parametrize("mode", ["drip_description", "drip_headers", "endless_continue"])
def test_seeupo_eval_against_a_dripped_description_ends_in_one_line(hostile, mode):
    command = [str(Path(sys.executable).with_name("seeupo-eval")), "--model", "tiny", "--env", "seeupo/TurnBandit-v0",
               "--tasks", TASKS[0], "-k", "1", "--no-progress", "--request-timeout", "5", "--episode-timeout", "5",
               f"env.url={hostile(mode)}"]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - start < 200
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("seeupo-eval: the env server at "), result.stderr


# ------------------------------------------------------------------------------ the serve client (NeMo Gym, verifiers)


def serve_client():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ecosystems" / "serve_client"))
    import seeupo_serve_client

    return seeupo_serve_client


@pytest.mark.parametrize("mode", ["drip_status", "drip_headers", "endless_continue", "drip_description"])
def test_the_serve_clients_description_is_whole_within_its_timeout_or_a_serve_error(hostile, mode):
    client = serve_client()
    start = time.monotonic()
    with pytest.raises(client.ServeError, match=r"did not answer in whole within 2 s"):
        client.served_env(hostile(mode), timeout_s=2)
    assert time.monotonic() - start < 3  # 1.5 x; before: as long as the server dripped
    assert client.served_env(hostile("honest"), timeout_s=2)["env_id"] == "seeupo/TurnBandit-v0"  # control


def test_the_serve_client_sends_its_token_to_the_server_never_to_a_proxy(hostile, proxy):
    import asyncio

    client = serve_client()
    assert client.served_env(hostile("honest"), token="serve-secret", timeout_s=5)["env_id"] == "seeupo/TurnBandit-v0"

    async def episode():
        async with client.ServeSession(hostile("honest"), token="serve-secret", timeout_s=5) as session:
            await session.reset(task_id=TASKS[0])
            return await session.step("A")

    assert isinstance(asyncio.run(episode()).reward, float)
    assert proxy.received == []
