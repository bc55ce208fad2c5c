"""The verl launcher refuses a rollout tensor parallelism the run's GPUs cannot hold, in one line,
before anything starts (`--print-config` included: it checks as a run would)."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")
from seeupo_gym.integrations.verl.__main__ import main  # noqa: E402


def test_tensor_parallelism_beyond_the_runs_gpus_is_refused_in_one_line(capsys):
    assert main(["--print-config", "+experiment=paper_bfcl", "trainer.n_gpus_per_node=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("seeupo verl: actor_rollout_ref.rollout.tensor_model_parallel_size=2 is more than the run's "
                   "trainer.n_gpus_per_node=1 x trainer.nnodes=1 = 1 GPU(s); set it to at most 1, or ask for more GPUs")


def test_tensor_parallelism_that_does_not_divide_the_gpus_is_refused(capsys):
    assert main(["--print-config", "+experiment=paper_bfcl", "trainer.n_gpus_per_node=3"]) == 2
    assert "does not divide the run's trainer.n_gpus_per_node=3" in capsys.readouterr().err


def test_tensor_parallelism_within_the_gpus_is_accepted(capsys):
    # control: the same experiment on two nodes of one GPU each holds a 2-way engine
    assert main(["--print-config", "+experiment=paper_bfcl", "trainer.n_gpus_per_node=1", "trainer.nnodes=2"]) == 0
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" in capsys.readouterr().out.splitlines()
