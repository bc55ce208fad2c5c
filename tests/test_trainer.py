"""The trainer end to end on CPU: tiny model, real BFCL env, real accelerate.

The update tests use the BFCL env with a small length bonus on the final reward
(`trainer_helpers.LengthShapedReward`): the tiny random model never solves a task, so with the
plain reward every advantage is 0 and no algorithm would move the weights. The plain env is
trained on in `test_cli_*`.
"""

from __future__ import annotations

import json

import pytest
from trainer_helpers import ROOT, SHORT_TASKS, tiny_config, trainable_changed

from seeupo_gym.agents.models import load_model
from seeupo_gym.training.config import ConfigError
from seeupo_gym.training.checkpoint import checkpoints
from seeupo_gym.training.trainer import RolloutError, Trainer


# Episodes of 2 turns where the turn structure matters to the update (SeeUPO's turn pools,
# PPO's GAE across turns); GRPO and GSPO treat turns as independent samples, so 1 turn keeps
# them fast (their multi-turn updates are covered by the algorithm tests and the DDP test).
TURNS = {"ppo": 2, "grpo": 1, "gspo": 1, "seeupo": 2}


# GRPO and SeeUPO in the default suite; PPO and GSPO (whose updates the algorithm tests cover) in the slow one.
@pytest.mark.parametrize("algorithm", [pytest.param("ppo", marks=pytest.mark.slow), "grpo",
                                       pytest.param("gspo", marks=pytest.mark.slow), "seeupo"])
def test_each_algorithm_trains_two_steps_on_bfcl_with_length_shaped_reward(tmp_path, algorithm):
    config = tiny_config(tmp_path, f"algorithm.name={algorithm}", "train.steps=2",
                         f"env.kwargs={{max_turns: {TURNS[algorithm]}}}")
    with Trainer(config) as trainer:
        records = trainer.train()
        assert trainer.state.step == 2
        assert trainable_changed(trainer.accelerator.unwrap_model(trainer.model)) > 1e-4
        assert (trainer.learner.value_model is not None) == (algorithm == "ppo")
    train_records = [r for r in records if "rollout/trajectories" in r]
    assert [r["step"] for r in train_records] == [1.0, 2.0]
    for record in train_records:
        assert record["rollout/trajectories"] == 2.0  # 1 task x 2 rollouts
        assert 0 < record["rollout/reward_mean"] <= 0.1  # the length bonus, BFCL itself scores 0
        assert record["update/optimizer_steps"] >= 1
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    assert [p.name for p in checkpoints(tmp_path / "run" / "checkpoints")] == ["step-2"]


@pytest.mark.slow
def test_lora_run_trains_only_the_adapter(tmp_path):
    config = tiny_config(tmp_path, "model.lora={r: 4, alpha: 8}", "train.steps=1", "env.kwargs={max_turns: 1}",
                         "optim.lr=1e-2")
    with Trainer(config) as trainer:
        trainer.train()
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        assert trainer.learner.reference is None  # the reference is the base, adapter disabled
        base = peft_model.get_base_model()
        initial, _ = load_model("tiny", seed=0)
        lora_moved = base_moved = 0.0
        for name, param in base.named_parameters():
            if "lora_" in name:
                if "lora_B" in name:
                    lora_moved = max(lora_moved, float(param.detach().abs().max()))  # B starts at 0
                continue
            original = dict(initial.named_parameters())[name.replace(".base_layer", "")]
            base_moved = max(base_moved, float((param.detach() - original).abs().max()))
    assert lora_moved > 0 and base_moved == 0
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "adapter" / "adapter_config.json").is_file()


def test_cli_trains_a_step_on_real_bfcl_evaluates_and_writes_metrics_tensorboard_and_checkpoint(tmp_path):
    from seeupo_gym.training.cli import train_main as main

    out = tmp_path / "cli"
    code = main([
        "--config", "tiny-cpu",
        f"log.output_dir={out}", f"env.train_tasks=[{SHORT_TASKS[0]}]", "env.kwargs={max_turns: 1}",
        f"env.eval_tasks=[{', '.join(SHORT_TASKS)}]", "train.eval_every=1",
        "train.steps=1", "train.tasks_per_step=1", "sampling.max_new_tokens=4", "log.progress_bars=false",
    ])
    assert code == 0
    train, evaluation = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert train["step"] == 1 and train["rollout/trajectories"] == 2.0
    assert train["rollout/reward_mean"] == 0.0  # a random model fails BFCL
    # Greedy evaluation: one rollout per eval task, logged under eval/ at the same step.
    assert evaluation["step"] == 1 and evaluation["eval/tasks"] == 2.0 and evaluation["eval/rollouts_per_task"] == 1.0
    assert evaluation["eval/avg@1"] == 0.0
    assert list((out / "logs").rglob("events.out.tfevents.*"))
    checkpoint = out / "checkpoints" / "step-1"
    assert (checkpoint / "config.yaml").is_file()
    # The checkpoint's hf/ folder is a plain Hugging Face model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(checkpoint / "hf")
    assert exported.num_parameters() > 0 and AutoTokenizer.from_pretrained(checkpoint / "hf").vocab_size > 100_000


def test_cli_reports_a_bad_config_key_and_exits_2(tmp_path, capsys):
    from seeupo_gym.training.cli import train_main as main

    assert main(["--config", "tiny-cpu", "optim.learning_rate=1"]) == 2
    assert "optim.learning_rate" in capsys.readouterr().err


def test_a_failing_env_is_retried_then_reported_with_the_env_error(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, "train.steps=1", "train.rollout_retries=1", "env.kwargs={max_turns: 1}")
    with Trainer(config) as trainer:
        calls = []

        def broken_collect(tasks, group_size, seed):  # stands in for an env that keeps failing
            calls.append(tasks)
            raise ConnectionError("env server on 127.0.0.1:9 refused the connection")

        monkeypatch.setattr(trainer.agent, "collect", broken_collect)
        with pytest.raises(RolloutError, match=r"failed after 2 attempt\(s\).*ConnectionError: env server"):
            trainer.train()
        assert len(calls) == 2 and trainer.state.step == 0


def test_unknown_env_and_missing_resume_checkpoint_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="seeupo/NoSuchEnv-v0"):
        Trainer(tiny_config(tmp_path, "env.id=seeupo/NoSuchEnv-v0", "env.train_tasks=null"))
    with pytest.raises(ConfigError, match="resume_from .* is not a checkpoint folder"):
        Trainer(tiny_config(tmp_path, f"resume_from={tmp_path / 'nowhere'}"))
