"""TRL's environment_factory over a served env (seeupo_gym.integrations.trl.make(..., url=...)), against a
real `seeupo-serve` process on 127.0.0.1, with the real trl 1.16."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("trl", reason="the TRL adapter's tests need `pip install seeupo-gym[trl]` (make test installs it)")
pytest.importorskip("websockets", reason="seeupo/Remote-v0 needs `pip install seeupo-gym[serve]`")

from serve_helpers import serving  # noqa: E402

from seeupo_gym.bfcl import get_entry  # noqa: E402
from seeupo_gym.integrations.trl import make  # noqa: E402
from seeupo_gym.remote import RemoteEnv, RemoteEnvError  # noqa: E402
from test_trl_adapter import bfcl_ground_truth, reset_row  # noqa: E402

BANDIT = {"variant": "follow", "num_tasks": 4}
BANDIT_ARGS = ("variant=follow", "num_tasks=4", "action_format=tools")  # the adapter plays TurnBandit's tools format


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def made(*args, **kwargs):
    """(environment_factory, train_dataset) of `make`, which returns GRPOTrainer's keyword arguments."""
    arguments = make(*args, **kwargs)
    return arguments["environment_factory"], arguments["train_dataset"]


def test_turnbandit_over_a_served_env_is_the_local_adapter_with_a_remote_session():
    local_factory, local_dataset = made("seeupo/TurnBandit-v0", **BANDIT)
    with serving("seeupo/TurnBandit-v0", *BANDIT_ARGS) as served:
        # Both spellings: the env id with url=, and seeupo/Remote-v0 as gym.make takes it (env_id= once only).
        by_url = made("seeupo/TurnBandit-v0", url=served.url, **BANDIT)
        factory, dataset = made("seeupo/Remote-v0", url=served.url, env_id="seeupo/TurnBandit-v0", env_kwargs=BANDIT)
        assert list(dataset) == list(local_dataset) == list(by_url[1])
        remote, local = factory(), local_factory()
        assert isinstance(remote._env.unwrapped, RemoteEnv)
        for row in list(dataset)[:2]:
            assert reset_row(remote, row) == reset_row(local, row)
            task = local._env.unwrapped.tasks[int(row["task_id"].rsplit("-", 1)[1])]
            for label in task.optimal_answers():
                assert remote.answer(label) == local.answer(label)
            assert remote._final_reward() == local._final_reward() == pytest.approx(task.optimal_value)
        remote._close()
        local._close()


def test_bfcl_ground_truth_over_a_served_env_scores_one():
    with serving("seeupo/BFCL-v4-base-v0", "action_format=tools", "max_turns=50", "split=all") as served:
        factories, dataset = made("seeupo/BFCL-v4-base-v0", ["multi_turn_base_0", "multi_turn_base_1"], url=served.url)
        for row in dataset:
            instance = factories[row["environment"]]()
            assert isinstance(instance._env.unwrapped, RemoteEnv)
            entry = get_entry(row["task_id"])
            assert reset_row(instance, row) == entry.user_messages[0]
            bfcl_ground_truth(instance, entry)
            assert instance._final_reward() == 1.0
            instance._close()


# Slow suite: a server start for a task list, ~10 s.
@pytest.mark.slow
def test_the_dataset_of_a_served_env_is_the_servers_task_list():
    with serving("seeupo/TurnBandit-v0", "variant=follow", "num_tasks=3", "action_format=tools") as served:
        _, dataset = made("seeupo/TurnBandit-v0", url=served.url, variant="follow", num_tasks=3)
    assert [row["task_id"] for row in dataset] == ["follow-0-0", "follow-0-1", "follow-0-2"]


# ------------------------------------------------------------------------------------ red team


# Slow suite: a server start, ~10 s; kwargs compared by value are tested in test_openenv_serve.py.
@pytest.mark.slow
def test_a_server_that_serves_other_kwargs_is_refused_before_any_episode():
    with serving("seeupo/TurnBandit-v0", "variant=follow", "num_tasks=3", "action_format=tools") as served:
        with pytest.raises(ValueError, match="serves seeupo/TurnBandit-v0 with"):
            make("seeupo/TurnBandit-v0", url=served.url, variant="mixed", num_tasks=3)
        with pytest.raises(ValueError, match="not 'seeupo/BFCL-v4-v0'"):
            make("seeupo/Remote-v0", url=served.url, env_id="seeupo/BFCL-v4-v0", env_kwargs={"action_format": "tools"})


def test_remote_without_a_url_or_a_served_id_is_a_clear_error():
    with pytest.raises(ValueError, match="needs url="):
        make("seeupo/Remote-v0", env_id="seeupo/TurnBandit-v0")
    with pytest.raises(ValueError, match="needs url="):
        make("seeupo/Remote-v0", url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown arguments for seeupo/Remote-v0"):
        make("seeupo/Remote-v0", url="http://127.0.0.1:1", env_id="seeupo/TurnBandit-v0", variant="follow")


def test_a_dead_server_is_a_clear_error_at_make_and_a_lost_session_ends_the_episode_at_zero():
    with pytest.raises(RemoteEnvError, match="cannot reach the env server"):
        make("seeupo/TurnBandit-v0", url=f"http://127.0.0.1:{free_port()}", **BANDIT)
    served = None
    with serving("seeupo/TurnBandit-v0", *BANDIT_ARGS) as served:
        factory, dataset = made("seeupo/TurnBandit-v0", url=served.url, **BANDIT)
        instance = factory()
        reset_row(instance, dataset[0])
        served.process.kill()
        served.process.wait(timeout=30)
        answer = instance.answer("A")
        assert answer.startswith("Error: the episode ended because its env server was lost")
        assert instance._final_reward() == 0.0 and instance.answer("A") == "The episode is over."
        instance._close()


def test_hostile_tool_arguments_over_a_served_env_are_observations():
    with serving("seeupo/BFCL-v4-base-v0", "action_format=tools", "max_turns=50", "split=all") as served:
        factories, dataset = made("seeupo/BFCL-v4-base-v0", ["multi_turn_base_0"], url=served.url)
        row = dataset[0]
        instance = factories[row["environment"]]()
        reset_row(instance, row)
        results = [
            instance.cd(folder="__import__('os').system('id')"),
            instance.cd(folder="\ud800" * 3),
            instance.cd(folder="x" * 200_000),
            instance.end_turn(reply="\udfff"),
        ]
        assert all(isinstance(text, str) and text.encode("utf-8") for text in results)
        assert "Error" in results[0] or "error" in results[0]
        assert instance._final_reward() == 0.0
        instance._close()
