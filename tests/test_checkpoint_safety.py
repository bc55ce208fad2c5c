"""Red team: a checkpoint folder from someone else never runs code when resumed or loaded.

Every file a loader could unpickle is replaced by (or joined by) a pickle whose load writes a
marker file: `--resume` and the policy loaders (seeupo-eval, seeupo-compare, seeupo-export) must
refuse with one line, and the marker must never appear. Before trainer_state.json, the trainer
registered its state with accelerate, which loads `custom_checkpoint_0.pkl` with
`weights_only=False`: the first case ran the payload.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from trainer_helpers import tiny_config

from seeupo_gym.training import cli
from seeupo_gym.training.checkpoint import (
    TRAINER_STATE_FILE,
    CheckpointError,
    checkpoints,
    load_policy,
    read_trainer_state,
)
from seeupo_gym.training.config import ConfigError
from seeupo_gym.training.trainer import Trainer


class Payload:
    """Unpickled by a full unpickler, writes `marker` (what an attacker's code would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant(file: Path, marker: Path) -> None:
    file.unlink(missing_ok=True)
    torch.save({"state": Payload(marker), "param_groups": []}, file)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A real run folder with a step-1 checkpoint (the tiny model, one step)."""
    root = tmp_path_factory.mktemp("saved")
    with Trainer(tiny_config(root, "train.steps=1", "train.save_every=1", "env.kwargs={max_turns: 1}")) as trainer:
        trainer.train()
    return root / "run"


@pytest.fixture
def run_copy(saved_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def resume(run: Path) -> None:
    with Trainer(tiny_config(run.parent, "train.steps=2", "resume_from=latest", "env.kwargs={max_turns: 1}")):
        pass


# Each: (what the attacker does to the step-1 checkpoint, a word the refusal names).
CASES = {
    "old-format trainer state pickle": (lambda c, m: plant(c / "custom_checkpoint_0.pkl", m), "custom_checkpoint_0.pkl"),
    "RNG states": (lambda c, m: plant(c / "random_states_0.pkl", m), "random_states_0.pkl"),
    "optimizer state": (lambda c, m: plant(c / "optimizer.bin", m), "does not load"),
    "weights as .bin": (lambda c, m: ((c / "model.safetensors").unlink(), plant(c / "pytorch_model.bin", m)), "does not load"),
    "DCP metadata": (lambda c, m: plant_dcp_metadata(c, m), ".metadata"),
}


def plant_dcp_metadata(checkpoint: Path, marker: Path) -> None:
    # torch.distributed.checkpoint reads `.metadata` with pickle.load (an FSDP sharded save).
    (checkpoint / "pytorch_model_fsdp_0").mkdir()
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


@pytest.mark.parametrize("case", list(CASES))
def test_resume_never_unpickles_a_planted_payload(run_copy, tmp_path, case):
    marker = tmp_path / "marker"
    tamper, named = CASES[case]
    tamper(checkpoints(run_copy / "checkpoints")[-1], marker)
    with pytest.raises(CheckpointError) as refused:
        resume(run_copy)
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_seeupo_train_resume_of_an_old_checkpoint_is_one_line_and_exit_2(run_copy, tmp_path, capsys):
    marker = tmp_path / "marker"
    step1 = checkpoints(run_copy / "checkpoints")[-1]
    plant(step1 / "custom_checkpoint_0.pkl", marker)
    (step1 / TRAINER_STATE_FILE).unlink()  # exactly what an old checkpoint holds
    code = cli.train_main(["--config", str(step1 / "config.yaml"), "--resume", str(step1), "train.steps=2",
                     f"log.output_dir={run_copy}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not marker.exists()
    assert err.startswith("seeupo-train: bad config: checkpoint") and "custom_checkpoint_0.pkl" in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("body", ["[1, 2]", '{"trainer": {"step": -1}}', '{"trainer": {"step": "1"}}', "{" * 100000,
                                  '{"trainer": {"step": 1}, "algorithm": []}', "\x00" * 100])
def test_a_malformed_trainer_state_is_refused(run_copy, body):
    step1 = checkpoints(run_copy / "checkpoints")[-1]
    (step1 / TRAINER_STATE_FILE).write_text(body)
    with pytest.raises(CheckpointError, match=TRAINER_STATE_FILE) as refused:
        read_trainer_state(step1)
    assert "\n" not in str(refused.value)
    if body == "[1, 2]":  # and through the trainer's door
        with pytest.raises(CheckpointError, match=TRAINER_STATE_FILE):
            resume(run_copy)


def test_the_policy_loaders_refuse_pickled_weights_in_hf(run_copy, tmp_path):
    """seeupo-eval --checkpoint, seeupo-compare --model x=CKPT and seeupo-export load `hf/`."""
    marker = tmp_path / "marker"
    step1 = checkpoints(run_copy / "checkpoints")[-1]
    (step1 / "hf" / "model.safetensors").unlink()
    plant(step1 / "hf" / "pytorch_model.bin", marker)
    config = cli.resolve_config(None, str(step1), [])
    with pytest.raises(ConfigError, match=r"hf/pytorch_model\.bin is a pickle"):
        load_policy(config, step1)
    assert not marker.exists()


def test_a_checkpoint_holds_no_pickle_of_the_trainer(saved_run):
    step1 = checkpoints(saved_run / "checkpoints")[-1]
    assert not list(step1.glob("custom_checkpoint_*"))
    state = json.loads((step1 / TRAINER_STATE_FILE).read_text())
    assert state["trainer"]["step"] == 1 and state["trainer"]["run_id"]


def test_a_fork_from_a_checkpoint_hiding_a_payload_behind_a_link_is_refused(run_copy, tmp_path):
    """A checkpoint outside the run folder (resume_from=PATH into a new folder): a linked subfolder
    would hide its pickle from the scan; links in a checkpoint are refused outright."""
    marker = tmp_path / "marker"
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    step1 = checkpoints(run_copy / "checkpoints")[-1]
    (step1 / "pytorch_model_fsdp_0").symlink_to(hidden)
    with pytest.raises(ConfigError, match="pytorch_model_fsdp_0' is a symbolic link"):
        with Trainer(tiny_config(tmp_path / "fork", "train.steps=2", f"resume_from={step1}", "env.kwargs={max_turns: 1}")):
            pass
    assert not marker.exists()


def test_dcp_metadata_is_read_only_when_it_is_dcps_own(tmp_path):
    """FSDP2 saves sharded state with torch.distributed.checkpoint, which loads `.metadata` with
    pickle.load: a real one passes the check, one with any other global is refused unrun."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from seeupo_gym.training.checkpoint import refuse_pickles

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optim": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(3)}},
                       "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0], "name": None}]}}
    real = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": one process
        dcp.save(state, checkpoint_id=str(real))
    refuse_pickles(tmp_path / "ckpt")  # DCP's own metadata: accepted

    marker = tmp_path / "marker"
    metadata = pickle.loads((real / ".metadata").read_bytes())
    metadata.storage_meta.modules = [Payload(marker)]  # one hostile object deep inside
    (real / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"builtins\.exec is not part of DCP's metadata"):
        refuse_pickles(tmp_path / "ckpt")
    assert not marker.exists()
