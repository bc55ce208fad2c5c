"""seeupo-eval: avg@k / pass@k of real rollouts, the JSON and table it writes, checkpoint loading."""

from __future__ import annotations

import json

import pytest

from seeupo_gym.agents.backends import Backend, Completion
from seeupo_gym.agents.models import load_model
from seeupo_gym.training.metrics import Outcome, pass_at_k, summarize
from seeupo_gym.training.checkpoint import load_policy
from seeupo_gym.training.cli import eval_main as main, resolve_config
from seeupo_gym.training.evaluation import EvalResult, evaluate_policy
from seeupo_gym.turnbandit import make_tasks

EASY = {"variant": "easy", "num_tasks": 6, "max_turns": 2}


class ScriptedBackend(Backend):
    """Replaces the model to test the evaluation around it: answers option `letters[i]` on the
    i-th call of each prompt position, cycling, so different rollouts score differently."""

    def __init__(self, tokenizer, answers):
        self.tokenizer = tokenizer
        self.answers = list(answers)
        self.calls = 0
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.default_stop_token_ids = (self.stop,)

    def generate(self, prompts, sampling):
        out = []
        for row, _ in enumerate(prompts):
            text = self.answers[(self.calls + row) % len(self.answers)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop]
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        self.calls += 1
        return out

    def update_weights(self, source):
        pass


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def test_scripted_answers_give_the_scores_of_the_task_table_and_the_definitions(tiny):
    _, tokenizer = tiny
    tasks = make_tasks("easy", num_tasks=6, seed=0, turns=(2, 2), options=2)
    ids = [task.task_id for task in tasks[:4]]
    # Always "A": each task's score is r(A, A), known from the task table without the agent.
    result = evaluate_policy(ScriptedBackend(tokenizer, ["A"]), tokenizer, "seeupo/TurnBandit-v0", ids,
                             k=2, n=3, max_new_tokens=4, num_envs=4, env_kwargs=EASY)
    expected = {task.task_id: task.reward((0, 0)) for task in tasks[:4]}
    assert {t.task_id: t.mean_score for t in result.tasks} == pytest.approx(expected)
    assert result.avg_at_k == pytest.approx(sum(expected.values()) / 4)
    passed = [1.0 if score == 1.0 else 0.0 for score in expected.values()]
    assert result.pass_at_k == pytest.approx(sum(passed) / 4)
    assert 0 < result.avg_at_k < 1  # the constructed tasks have a mix of outcomes
    assert all(t.rollouts == 3 for t in result.tasks)


def test_evaluation_steps_the_envs_as_the_config_says(tiny):
    from seeupo_gym.training.config import load_config
    from seeupo_gym.training.tasks import agent_options

    _, tokenizer = tiny
    env = load_config("tiny-turnbandit", ["env.vectorization=async", "env.schedule=per_episode"]).env
    options = agent_options(env)
    assert options == {"vectorization": "async", "schedule": "per_episode", "workers": "local", "url": None,
                       "worker_options": {}}
    ids = [task.task_id for task in make_tasks("easy", num_tasks=6, seed=0, turns=(2, 2), options=2)[:2]]
    run = dict(k=1, n=2, max_new_tokens=4, num_envs=2, env_kwargs=EASY)
    # The options reach the agent: a per-episode, threaded evaluation scores what a plain one does
    # (scripted answers do not depend on the schedule), and a bad schedule is refused by the agent.
    plain = evaluate_policy(ScriptedBackend(tokenizer, ["A"]), tokenizer, "seeupo/TurnBandit-v0", ids, **run)
    configured = evaluate_policy(ScriptedBackend(tokenizer, ["A"]), tokenizer, "seeupo/TurnBandit-v0", ids,
                                 agent_options=options, **run)
    assert [t.mean_score for t in configured.tasks] == [t.mean_score for t in plain.tasks]
    with pytest.raises(ValueError, match="schedule"):
        evaluate_policy(ScriptedBackend(tokenizer, ["A"]), tokenizer, "seeupo/TurnBandit-v0", ids,
                        agent_options={**options, "schedule": "round_robin"}, **run)


def test_pass_at_k_uses_the_unbiased_estimator_over_n_rollouts(tiny):
    _, tokenizer = tiny
    tasks = make_tasks("easy", num_tasks=6, seed=0, turns=(2, 2), options=2)
    ids = [task.task_id for task in tasks[:3]]
    # Rollouts alternate answers, so a task's n rollouts hold some successes and some failures.
    result = evaluate_policy(ScriptedBackend(tokenizer, ["A", "B", "B"]), tokenizer, "seeupo/TurnBandit-v0",
                             ids, k=2, n=5, max_new_tokens=4, num_envs=5, env_kwargs=EASY)
    for task in result.tasks:
        assert task.pass_at_k == pytest.approx(pass_at_k(5, task.successes, 2))
    assert result.summary == summarize(result.outcomes, 2)
    assert any(0 < t.successes < 5 for t in result.tasks)


def test_cli_on_the_tiny_model_writes_json_rollouts_and_a_table(tmp_path, capsys):
    out, rollouts = tmp_path / "eval.json", tmp_path / "rollouts.jsonl"
    code = main([
        "--model", "tiny", "--env", "seeupo/TurnBandit-v0", "--env-kwargs", json.dumps(EASY),
        "-k", "2", "-n", "3", "--max-tasks", "2", "--max-new-tokens", "4", "--num-envs", "6",
        "--out", str(out), "--rollouts", str(rollouts), "--no-progress", "env.max_context_tokens=1024",
    ])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["k"] == 2 and data["n"] == 3
    assert [t["task_id"] for t in data["tasks"]] == ["easy-0-0", "easy-0-1"]
    lines = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert len(lines) == 6 and {line["task_id"] for line in lines} == {"easy-0-0", "easy-0-1"}
    # The JSON's numbers are the definitions applied to the rollouts it lists.
    outcomes = [Outcome(r["task_id"], r["reward"], r["success"], r["category"]) for r in lines]
    expected = summarize(outcomes, 2)
    assert list(data["summary"]) == list(expected)
    for category, row in expected.items():
        assert data["summary"][category] == pytest.approx(row)
    assert data["generated_tokens"] > 0
    printed = capsys.readouterr().out
    assert "| overall | 2 |" in printed and "avg@2" in printed and "pass@2" in printed


def test_cli_rejects_k_above_n_and_a_missing_checkpoint(tmp_path, capsys):
    assert main(["--model", "tiny", "--env", "seeupo/TurnBandit-v0", "-k", "3", "-n", "2"]) == 2
    assert "k <= n" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_bfcl_results_are_split_by_category(tiny):
    _, tokenizer = tiny
    from seeupo_gym.bfcl.data import task_ids

    ids = [task_ids(("base",), "test")[0], task_ids(("miss_param",), "test")[0]]
    result = evaluate_policy(ScriptedBackend(tokenizer, ["I cannot help."]), tokenizer, "seeupo/BFCL-v4-v0", ids,
                             k=1, max_new_tokens=8, num_envs=2,
                             env_kwargs={"categories": ["base", "miss_param"], "max_turns": 2})
    assert list(result.summary) == ["base", "miss_param", "overall"]
    assert result.summary["overall"]["tasks"] == 2.0
    assert isinstance(result, EvalResult) and result.to_dict()["summary"] == result.summary


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_a_trainer_checkpoint_loads_with_the_trained_weights(tmp_path, lora):
    import torch

    from seeupo_gym.training.config import load_config
    from seeupo_gym.training.trainer import Trainer

    overrides = [
        "model.name_or_path=tiny", "env.id=seeupo/TurnBandit-v0", "env.kwargs={variant: easy, max_turns: 2}",
        "env.train_tasks=[easy-0-0, easy-0-1]", "env.num_envs=4", "env.max_context_tokens=1024",
        "sampling.max_new_tokens=4", "train.steps=1", "train.tasks_per_step=2", "train.group_size=2",
        "log.trackers=[]", "log.progress_bars=false",
        f"log.output_dir={tmp_path / 'run'}",
    ]
    if lora:
        overrides.append("model.lora={r: 4, alpha: 8}")
    with Trainer(load_config(None, overrides)) as trainer:
        # Moved by hand (a random-init model earns no reward to learn from), so the saved
        # weights differ from the initial ones and the test can tell which were loaded.
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                if parameter.requires_grad:
                    parameter.add_(0.01)
        trainer.save_checkpoint()
        trained = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0"
    config = resolve_config(None, str(checkpoint), [])
    assert config.model.name_or_path == "tiny" and (checkpoint / "adapter").is_dir() == lora
    model, _ = load_policy(config, checkpoint)
    loaded = model.state_dict()
    assert set(trained) <= set(loaded)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    # ... and they are not the initial ones: the loaded policy answers differently from a fresh one.
    fresh, _ = load_policy(config, None)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, fresh(ids).logits)
