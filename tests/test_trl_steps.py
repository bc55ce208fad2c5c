"""TRL runs that would do nothing, or be told to do what SeeUPOTrainer refuses: a dataset smaller than one
generation batch fails at construction in one line (TRL itself trains 0 steps and exits 0), and TRL's
advice to set `loss_type='grpo'` for sequence-level ratios never reaches a SeeUPO user. Real trl 1.16; the
two-process run (`accelerate launch --multi_gpu --num_processes 2` on CPU: DDP over gloo) is slow."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="the TRL trainer's tests need `pip install seeupo-gym[trl]`")

from seeupo_gym.integrations.trl import check_dataset_fills_a_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ADVICE = "set `loss_type='grpo'`"


def save_tiny(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("seeupo_in_trl", ROOT / "scripts" / "seeupo_in_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_tiny(folder)


def trainer_on(tmp_path: Path, tasks: int, trainer: str = "SeeUPOTrainer", **options):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    from seeupo_gym.integrations import trl as adapter

    model_dir = save_tiny(tmp_path / "tiny")
    if trainer == "SeeUPOTrainer":
        cls, config = adapter.SeeUPOTrainer, adapter.SeeUPOConfig
    else:
        from trl import GRPOConfig, GRPOTrainer

        cls, config = GRPOTrainer, GRPOConfig
    args = config(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                  per_device_train_batch_size=4, num_generations=2, max_completion_length=16, **options)
    return cls(model=str(model_dir), args=args, processing_class=add_response_schema(AutoTokenizer.from_pretrained(model_dir)),
               **adapter.make("seeupo/TurnBandit-v0", variant="follow", num_tasks=tasks))


def test_a_dataset_smaller_than_one_generation_batch_is_refused_in_one_line():
    args = SimpleNamespace(per_device_train_batch_size=4, num_generations=2, steps_per_generation=1, gradient_accumulation_steps=1)
    with pytest.raises(ValueError) as refused:
        check_dataset_fills_a_step([{}] * 2, args, processes=2)
    assert str(refused.value) == (
        "the dataset has 2 row(s) and one generation batch takes 4 distinct prompts (processes 2 x "
        "per_device_train_batch_size 4 x steps_per_generation 1 / num_generations 2): TRL would train 0 steps; "
        "give more tasks or a smaller batch")
    check_dataset_fills_a_step([{}] * 4, args, processes=2)  # the control: four rows fill the batch
    check_dataset_fills_a_step([{}] * 2, args, processes=1)
    check_dataset_fills_a_step(iter([]), args, processes=2)  # no length: not checked


def test_seeupo_trainer_refuses_a_dataset_that_would_train_zero_steps(tmp_path, one_torch_thread):
    # (its control, the same trainer on two tasks, is constructed in the next test)
    with pytest.raises(ValueError, match=r"the dataset has 1 row\(s\) and one generation batch takes 2 distinct prompts"):
        trainer_on(tmp_path, tasks=1)


def test_trls_loss_type_advice_never_reaches_a_seeupo_user(tmp_path, one_torch_thread, caplog):
    caplog.set_level(logging.WARNING, logger="trl")
    trainer = trainer_on(tmp_path, tasks=2)
    assert not [r for r in caplog.records if ADVICE in r.getMessage()]
    assert trainer.args.loss_type == "grpo" and trainer.args.importance_sampling_level == "sequence"
    # the control: GRPOTrainer with sequence-level ratios and its default loss gives the advice
    caplog.clear()
    trainer_on(tmp_path, tasks=2, trainer="GRPOTrainer", importance_sampling_level="sequence")
    assert [r for r in caplog.records if ADVICE in r.getMessage()]


SNIPPET = """
import os, sys
from trl.chat_template_utils import add_response_schema
from transformers import AutoTokenizer
from seeupo_gym.integrations.trl import SeeUPOConfig, SeeUPOTrainer, make

model_dir, out, tasks = sys.argv[1], sys.argv[2], int(sys.argv[3])
trainer = SeeUPOTrainer(
    model=model_dir, processing_class=add_response_schema(AutoTokenizer.from_pretrained(model_dir)),
    args=SeeUPOConfig(output_dir=out, max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=16, use_cpu=True, bf16=False, report_to=[], save_strategy="no"),
    **make("seeupo/TurnBandit-v0", variant="follow", num_tasks=tasks),
)
trainer.train()
print("rank", os.environ["RANK"], "of", trainer.accelerator.num_processes, "steps", trainer.state.global_step)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_cpu_processes_refuse_too_few_tasks_and_train_with_enough(tmp_path):
    model_dir = save_tiny(tmp_path / "tiny")
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPET)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    few = subprocess.run([*launch, str(model_dir), str(tmp_path / "few"), "2"], capture_output=True, text=True, timeout=400, env=env)
    assert few.returncode != 0 and "the dataset has 2 row(s) and one generation batch takes 4 distinct prompts" in few.stderr
    enough = subprocess.run([*launch, str(model_dir), str(tmp_path / "enough"), "4"], capture_output=True, text=True,
                            timeout=400, env=env)
    assert enough.returncode == 0, enough.stderr[-3000:]
    assert sorted(line for line in enough.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0 of 2 steps 1", "rank 1 of 2 steps 1"]
