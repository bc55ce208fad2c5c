"""The command lines' edges: mistakes a user can make end in one line, quickly, saying what to do."""

from __future__ import annotations

import json
import time

import pytest

from seeupo_gym.training import cli
from seeupo_gym.training.config import ConfigError, config_from_dict
from seeupo_gym.training.trainer import build_algorithm, check_trackers

TURNBANDIT = ["--env", "seeupo/TurnBandit-v0", "--env-kwargs", json.dumps({"variant": "easy", "num_tasks": 2, "max_turns": 2}),
              "--max-tasks", "1", "--num-envs", "1", "env.max_context_tokens=1024"]


def unreachable_hub(*args, **kwargs):
    raise ConnectionError("[Errno -2] Name or service not known")


@pytest.mark.parametrize("name", ["tiny", "embedded"])
def test_the_models_that_ship_need_no_hub(name, monkeypatch):
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", unreachable_hub)
    cli.check_model_source(name)


def test_an_existing_local_folder_needs_no_hub(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", unreachable_hub)
    cli.check_model_source(str(tmp_path))


def test_a_missing_local_path_is_named_with_what_loads_instead():
    with pytest.raises(ConfigError, match=r"model './no-such-folder' is not a local folder.*'embedded'.*'tiny'"):
        cli.check_model_source("./no-such-folder")


def test_an_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", unreachable_hub)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"not in the local Hugging Face cache and the hub cannot be reached"):
        cli.check_model_source("no-such-org/no-such-model")
    assert time.perf_counter() - started < 5


def test_an_uncached_hub_id_with_hf_hub_offline_fails_without_asking_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", pytest.fail)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        cli.check_model_source("no-such-org/no-such-model")


def test_an_id_the_hub_does_not_know_is_named(monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    class NotFound(RepositoryNotFoundError):
        def __init__(self) -> None:  # the real one wants an HTTP response
            Exception.__init__(self, "404 Client Error")

    def not_found(*args, **kwargs):
        raise NotFound()

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", not_found)
    with pytest.raises(ConfigError, match=r"no model 'no-such-org/no-such-model' on the Hugging Face hub"):
        cli.check_model_source("no-such-org/no-such-model")


def test_seeupo_eval_and_train_report_an_unknown_model_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.eval_main(["--model", "no-such-org/no-such-model", *TURNBANDIT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seeupo-eval: model 'no-such-org/no-such-model'")
    assert cli.train_main(["--config", "tiny-turnbandit", "model.name_or_path=no-such-org/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seeupo-train: bad config: model 'no-such-org/no-such-model'" in err


def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch):
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"log.trackers: 'wandb' is not installed.*log.trackers=\[\]"):
        check_trackers(["wandb"])
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbored'; accelerate knows .*'tensorboard'"):
        check_trackers(["tensorbored"])
    check_trackers([])


def test_an_unknown_algorithm_points_at_plugins():
    with pytest.raises(ConfigError, match=r"unknown algorithm 'my_own_algo'.*--plugin FILE"):
        build_algorithm(config_from_dict({"algorithm": {"name": "my_own_algo"}}))


def test_seeupo_eval_without_a_config_bounds_responses_and_says_so(monkeypatch, capsys):
    import seeupo_gym.training.evaluation as evaluation

    asked = {}

    def stop_here(*args, max_new_tokens, **kwargs):  # the settings are the point, not the rollouts
        asked["max_new_tokens"] = max_new_tokens
        raise SystemExit(0)

    monkeypatch.setattr(evaluation, "evaluate_policy", stop_here)
    with pytest.raises(SystemExit):
        cli.eval_main(["--model", "tiny", "--no-progress", *TURNBANDIT])
    assert asked["max_new_tokens"] == cli.EVAL_MAX_NEW_TOKENS
    assert f"at most {cli.EVAL_MAX_NEW_TOKENS} new tokens per turn" in capsys.readouterr().err
    # A config's own setting wins (the preset says 4).
    with pytest.raises(SystemExit):
        cli.eval_main(["--config", "tiny-turnbandit", "--no-progress", "--max-tasks", "1"])
    assert asked["max_new_tokens"] == 4


def test_seeupo_eval_progress_moves_every_turn(capsys):
    assert cli.eval_main(["--model", "tiny", "--max-new-tokens", "2", *TURNBANDIT]) == 0
    err = capsys.readouterr().err
    assert "at most 2 new tokens per turn" in err and "2 tokens generated" in err  # moves per response
