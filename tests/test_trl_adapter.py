"""Our envs as TRL `GRPOTrainer` environments (seeupo_gym.integrations.trl), with the real trl 1.16."""

from __future__ import annotations

import inspect
import math

import gymnasium as gym
import pytest

pytest.importorskip("trl", reason="the TRL adapter's tests need `pip install seeupo-gym[trl]` (make test installs it)")

from transformers.utils import get_json_schema  # noqa: E402

from seeupo_gym.bfcl import get_entry, load_category  # noqa: E402
from seeupo_gym.bfcl.calls import parse_call_list  # noqa: E402
from seeupo_gym.bfcl.data import function_docs  # noqa: E402
from seeupo_gym.integrations.trl import EnvReward, environment_reward  # noqa: E402
from seeupo_gym.integrations.trl import make as make_setup  # noqa: E402

BANDIT = {"variant": "follow", "num_tasks": 4}
BANDIT_ENV = {**BANDIT, "action_format": "tools"}  # what the adapter's env runs with


def make(env_id, **kwargs):
    """(environment_factory, train_dataset) of make(); its reward_funcs is one EnvReward."""
    setup = make_setup(env_id, **kwargs)
    assert set(setup) == {"environment_factory", "train_dataset", "reward_funcs"}
    (reward,) = setup["reward_funcs"]
    assert isinstance(reward, EnvReward) and reward.__name__ == env_id.split("/")[-1]
    return setup["environment_factory"], setup["train_dataset"]


def tools_of(instance) -> dict:
    """The tools TRL sees: public functions on the class, minus reset and get_reward (trl 1.16)."""
    return {
        name: getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def reset_row(instance, row: dict) -> str:
    return instance.reset(**{key: value for key, value in row.items() if key != "environment"})


def replayed_score(env_id: str, env_kwargs: dict, task_id: str, actions: list[str]) -> float:
    """What a fresh env scores for the same actions."""
    env = gym.make(env_id, **env_kwargs)
    env.reset(options={"task_id": task_id})
    reward = 0.0
    for action in actions:
        _, reward, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return float(reward)
    raise AssertionError("the replay did not end the episode")


def bfcl_ground_truth(instance, entry) -> None:
    docs = {doc.name: doc for class_docs in function_docs().values() for doc in class_docs}
    for calls in entry.ground_truth:
        for call in parse_call_list("[" + ", ".join(calls) + "]", max_calls=1000) if calls else ():
            arguments = dict(zip(docs[call.name].parameters.get("properties", {}), call.args))
            arguments.update(call.kwargs)
            getattr(instance, call.name)(**arguments)
        instance.end_turn("Done.")


def test_turnbandit_has_one_answer_tool_and_scores_like_the_env():
    factory, dataset = make("seeupo/TurnBandit-v0", **BANDIT)
    assert len(dataset) == 4 and set(dataset.column_names) == {"prompt", "task_id"}
    instance = factory()
    assert list(tools_of(instance)) == ["answer"]
    schema = get_json_schema(instance.answer)["function"]
    assert schema["parameters"]["properties"]["label"]["type"] == "string"
    row = dataset[0]
    first = reset_row(instance, row)
    assert first.startswith(f"Task {row['task_id']}") and "Options:" in first
    assert "`answer` tool" in row["prompt"][0]["content"]  # the env's own system prompt, tools format
    task = gym.make("seeupo/TurnBandit-v0", **BANDIT).unwrapped.tasks[0]
    for label in task.optimal_answers():
        instance.answer(label)
    assert environment_reward(instance) == pytest.approx(task.optimal_value)
    # A rollout that stops early scores what the env scores when it is run out: 0 (truncated).
    reset_row(instance, row)
    instance.answer("Z")
    assert environment_reward(instance) == 0.0 == replayed_score("seeupo/TurnBandit-v0", BANDIT_ENV, row["task_id"], instance.steps)


def test_bfcl_tools_are_the_entrys_functions_as_typed_documented_methods():
    factories, dataset = make("seeupo/BFCL-v4-v0", categories=["base", "miss_func"], split="all")
    assert set(dataset.column_names) == {"prompt", "task_id", "environment"}
    assert set(dataset["environment"]) == set(factories)
    for name, factory in factories.items():
        tools = tools_of(factory())
        expected = {doc.name for class_name in name.split("+") for doc in function_docs()[class_name]} | {"end_turn"}
        assert set(tools) == expected
        for tool in tools.values():
            schema = get_json_schema(tool)["function"]  # raises on a missing hint or docstring entry
            assert schema["name"] == tool.__name__
    cd = get_json_schema(tools_of(factories["GorillaFileSystem+TwitterAPI"]())["cd"])["function"]
    assert cd["parameters"]["properties"]["folder"]["type"] == "string" and cd["parameters"]["required"] == ["folder"]


@pytest.mark.parametrize("task_id", ["multi_turn_base_0", "multi_turn_base_173", load_category("miss_func")[3].id])
def test_bfcl_ground_truth_through_the_tools_scores_one_as_the_env_does(task_id):
    factories, dataset = make("seeupo/BFCL-v4-v0", task_ids=[task_id], categories=["base", "miss_func"])
    (row,) = list(dataset)
    instance = factories[row["environment"]]()
    assert reset_row(instance, row) == get_entry(task_id).user_messages[0]
    bfcl_ground_truth(instance, get_entry(task_id))
    assert environment_reward(instance) == 1.0
    kwargs = {"categories": ["base", "miss_func"], "split": "all", "action_format": "tools", "max_turns": 50}
    assert replayed_score("seeupo/BFCL-v4-v0", kwargs, task_id, instance.steps) == 1.0


def test_bfcl_rollout_that_stops_early_ends_its_turns_and_scores_zero():
    factories, dataset = make("seeupo/BFCL-v4-v0", task_ids=["multi_turn_base_0"])
    (row,) = list(dataset)
    instance = factories[row["environment"]]()
    reset_row(instance, row)
    assert "No such file or directory" in instance.cd(folder="nowhere")
    assert environment_reward(instance) == 0.0
    assert instance.steps[1:] == ["Done."] * get_entry("multi_turn_base_0").num_user_turns


def test_one_reward_column_per_env_not_per_generated_class(tmp_path, tiny):
    """TRL logs a column per reward function and per env class with a `get_reward`: BFCL's base train split
    made 20 classes (one per combination of backends), so 20 `rewards/<class>` columns, all but one empty
    per rollout. Now one column per env, whichever class a row uses."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    model, tokenizer = tiny
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_steps=1,
                      per_device_train_batch_size=2, num_generations=2)
    bfcl = make_setup("seeupo/BFCL-v4-v0", categories=["base"], split="train")
    assert len(bfcl["environment_factory"]) == 20
    for setup, name in [(bfcl, "BFCL-v4-v0"), (make_setup("seeupo/TurnBandit-v0", **BANDIT), "TurnBandit-v0")]:
        trainer = GRPOTrainer(model=model, args=args, processing_class=add_response_schema(tokenizer), **setup)
        assert trainer.reward_func_names == [name]


def test_env_reward_scores_each_rollouts_environment():
    factory, dataset = make("seeupo/TurnBandit-v0", **BANDIT)
    instances = [factory(), factory()]
    task = gym.make("seeupo/TurnBandit-v0", **BANDIT).unwrapped.tasks[0]
    for instance in instances:
        reset_row(instance, dataset[0])
    for label in task.optimal_answers():
        instances[0].answer(label)
    instances[1].answer("Z")
    assert EnvReward("seeupo/TurnBandit-v0")(prompts=[], completions=[], environments=instances) == [task.optimal_value, 0.0]
    with pytest.raises(ValueError, match="no environments"):
        EnvReward("seeupo/TurnBandit-v0")(prompts=[], completions=[])


def test_unknown_env_id_is_a_clear_error():
    with pytest.raises(ValueError, match="no TRL adapter"):
        make_setup("CartPole-v1")


@pytest.mark.appworld
@pytest.mark.slow
def test_appworld_ground_truth_through_execute_python_scores_one():
    from conftest import appworld_mini

    folder, tasks = appworld_mini()
    factory, dataset = make("seeupo/AppWorld-v0")
    assert list(dataset["task_id"]) == list(tasks)
    instance = factory()
    try:
        assert list(tools_of(instance)) == ["execute_python"]
        assert get_json_schema(instance.execute_python)["function"]["parameters"]["required"] == ["code"]
        row = dataset[0]
        assert "Task:" in reset_row(instance, row)
        solution = (folder / "tasks" / row["task_id"] / "ground_truth" / "solution.py").read_text()
        instance.execute_python(solution)
        assert environment_reward(instance) == 1.0
    finally:
        instance._close()


# ------------------------------------------------------------------------------ GRPOTrainer, real


def train_one_step(tmp_path, setup, tiny, max_completion_length=24):
    """One GRPOTrainer step on CPU with what make() returned (factory, dataset, the env's reward)."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    model, tokenizer = tiny
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        gradient_accumulation_steps=1, max_completion_length=max_completion_length, learning_rate=1e-4, logging_steps=1,
        report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, args=args, processing_class=add_response_schema(tokenizer), **setup)
    trainer.train()
    return trainer


def logged_rewards(trainer) -> list[float]:
    """Per rollout, the reward TRL logged: one column, the env's."""
    (column,) = trainer._logs["rewards"].values()
    assert not any(math.isnan(v) for v in column)
    return list(column)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_trainer_trains_a_step_on_turnbandit_and_logs_the_envs_scores(tmp_path, tiny, one_torch_thread):
    trainer = train_one_step(tmp_path, make_setup("seeupo/TurnBandit-v0", **BANDIT), tiny)
    assert trainer.state.global_step == 1
    rewards = logged_rewards(trainer)
    environments = trainer.environments
    assert len(rewards) == len(environments) == 4
    print("\nTRL logged rewards:", rewards, "\nactions:", [environment.steps for environment in environments])
    for reward, environment in zip(rewards, environments):
        assert reward == replayed_score("seeupo/TurnBandit-v0", BANDIT_ENV, environment.task_id, environment.steps)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_trainer_trains_a_step_on_bfcl_and_logs_the_envs_scores(tmp_path, tiny, one_torch_thread):
    ids = ["multi_turn_miss_func_146", "multi_turn_miss_func_121"]
    trainer = train_one_step(tmp_path, make_setup("seeupo/BFCL-v4-v0", task_ids=ids, categories=["miss_func"]), tiny)
    assert trainer.state.global_step == 1
    rewards = logged_rewards(trainer)
    environments = trainer.environments
    assert len(rewards) == len(environments) == 4
    kwargs = {"categories": ["miss_func"], "split": "all", "action_format": "tools", "max_turns": 50}
    print("\nTRL logged rewards:", rewards, "\nactions:", [environment.steps for environment in environments])
    for reward, environment in zip(rewards, environments):
        assert reward == replayed_score("seeupo/BFCL-v4-v0", kwargs, environment.task_id, environment.steps)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_trl_tool_loop_drives_turnbandit_with_scripted_sampling_instead_of_the_model(tmp_path, tiny, one_torch_thread):
    """The tiny random model never calls a tool, so here its `generate` answers from a script (rollout
    i picks "A" if i is even, else "B", one `answer` call per step, then plain text): TRL's own
    parsing and tool loop drive our env, and the rewards it logs differ across rollouts and equal
    what a fresh env scores for the same actions."""
    model, tokenizer = tiny
    real_generate = model.generate

    def plan(index, text):
        first = "<tool_response>" not in text
        label = "A" if (index % 2 == 0 if first else '"label": "A"' in text) else "B"
        return [("answer", {"label": label})] * 2

    model.generate = scripted(tokenizer, plan)
    try:
        # Room for two calls, their results and the closing text (TRL drops tool results past it).
        trainer = train_one_step(tmp_path, make_setup("seeupo/TurnBandit-v0", **BANDIT), (model, tokenizer),
                                 max_completion_length=256)
    finally:
        model.generate = real_generate
    rewards = logged_rewards(trainer)
    environments = trainer.environments
    print("\nTRL logged rewards:", rewards, "\nactions:", [environment.steps for environment in environments])
    assert all(len(environment.steps) == 2 for environment in environments)  # both steps came as tool calls
    assert len(set(rewards)) > 1
    for reward, environment in zip(rewards, environments):
        assert reward == replayed_score("seeupo/TurnBandit-v0", BANDIT_ENV, environment.task_id, environment.steps)


def scripted(tokenizer, plan):
    """A stand-in for `model.generate`: a row gets the next call of plan(row, prompt text) as a hermes
    tool call (counted by the tool results already in its prompt), then plain text. `row` is the
    position in this call's batch: TRL's later calls hold only the rollouts still calling tools, so
    a plan must recognize its rollout from the prompt after the first call."""
    import json

    import torch

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(input_ids, attention_mask=None, **kwargs):
        rows = []
        for index, prompt in enumerate(input_ids):
            text = tokenizer.decode(prompt)
            calls = plan(index, text)
            done = text.count("<tool_response>")
            text = "Done."
            if done < len(calls):
                name, arguments = calls[done]
                text = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [im_end])
        width = max(len(row) for row in rows)
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)

    return generate


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_trl_tool_loop_drives_bfcl_with_scripted_sampling_instead_of_the_model(tmp_path, tiny, one_torch_thread):
    """As the TurnBandit test above, on BFCL: even rollouts make the ground truth's calls (each user
    turn closed by `end_turn`), odd ones leave out the first call; TRL's logged rewards are 1.0 and
    0.0 and equal what a fresh env scores for the same actions."""
    task_id = "multi_turn_miss_func_146"
    docs = {doc.name: doc for class_docs in function_docs().values() for doc in class_docs}
    truth = []
    for calls in get_entry(task_id).ground_truth:
        for call in parse_call_list("[" + ", ".join(calls) + "]") if calls else ():
            arguments = dict(zip(docs[call.name].parameters.get("properties", {}), call.args))
            truth.append((call.name, {**arguments, **dict(call.kwargs)}))
        truth.append(("end_turn", {"reply": "Done."}))
    model, tokenizer = tiny
    real_generate = model.generate

    def plan(index, text):
        first = "<tool_response>" not in text
        # Our own call text: miss_func's reveal also names functions, as `"name": ..., "description"`.
        whole = index % 2 == 0 if first else f'{{"name": "{truth[0][0]}", "arguments"' in text
        return truth if whole else truth[1:]

    model.generate = scripted(tokenizer, plan)
    try:
        setup = make_setup("seeupo/BFCL-v4-v0", task_ids=[task_id, task_id], categories=["miss_func"])
        trainer = train_one_step(tmp_path, setup, (model, tokenizer), max_completion_length=2048)
    finally:
        model.generate = real_generate
    rewards = logged_rewards(trainer)
    environments = trainer.environments
    print("\nTRL logged rewards:", rewards, "\nactions:", [len(environment.steps) for environment in environments])
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert [len(environment.steps) for environment in environments] == [len(truth), len(truth) - 1] * 2
    kwargs = {"categories": ["miss_func"], "split": "all", "action_format": "tools", "max_turns": 50}
    for reward, environment in zip(rewards, environments):
        assert reward == replayed_score("seeupo/BFCL-v4-v0", kwargs, environment.task_id, environment.steps)
