"""Our envs as TRL `GRPOTrainer(environment_factory=...)` environments.

    from trl import GRPOConfig, GRPOTrainer
    from seeupo_gym.integrations.trl import make

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), **make("seeupo/TurnBandit-v0", variant="follow"))

`make` returns GRPOTrainer's `environment_factory`, `train_dataset` and `reward_funcs`.

TRL's contract (trl 1.16): an environment is an object with `reset(**row)` (its returned text is
appended to the row's last prompt message) and public methods with type hints and a Google-style
docstring (the tools, rendered by `transformers.utils.get_json_schema` and called with the
model's arguments). TRL lists the tools on the *class*, so tools are fixed per class: BFCL gets one
class per combination of BFCL backends (the factory is then a dict, and each dataset row names its
`environment`). TRL would also log one reward column per class that defines `get_reward` (20 for
BFCL's base split, all but one empty per rollout), so our classes define none: the reward is one
function per env (`EnvReward`, logged as `rewards/<env name>`, e.g. `rewards/BFCL-v4-v0/mean`),
which asks each rollout's environment for its final score.

Each tool call is one step of the wrapped Gymnasium env (and counts toward its `max_turns`; BFCL's
defaults to 50 here):
- TurnBandit (`action_format="tools"`): `answer(label)` chooses the option of the current step.
- BFCL (`action_format="tools"`): one method per function of the entry's backends, plus
  `end_turn(reply)`, which ends the current user turn with a plain-text reply and returns the
  user's next message (BFCL's later user turns arrive as that tool's result, not as user messages).
- AppWorld (`action_format="tools"`): `execute_python(code)`.
The reward is the env's final score: when the rollout stops before the episode ends,
the remaining user turns are ended with an empty reply (BFCL) or the episode is run out to
`max_turns` with no action (AppWorld, TurnBandit), and the env scores what was done.

Over a served env (`make(env_id, url=...)`, or `make("seeupo/Remote-v0", url=..., env_id=...,
env_kwargs=...)`), each environment instance holds a `seeupo/Remote-v0` session with that
`seeupo-serve` server (AppWorld's sandboxes stay on the server's machine) and the dataset's tasks
are the server's. The server must serve the kwargs `make` uses (e.g. BFCL:
`seeupo-serve seeupo/BFCL-v4-v0 action_format=tools max_turns=50 split=all`, or let sessions set
them with `--session-kwargs`). A session lost mid-episode ends the episode: the tool returns an
error text and the reward is 0.0. So does a reset the env refuses or fails (TRL calls `reset`
outside any try, so the error stays here: the rollout's first message says it, its tools answer
"The episode is over.", it scores 0.0), and an episode the env does not end within its own turn
limit (`_final_reward` takes at most `max_turns` closing steps, then scores 0.0; the config's
`max_turns`, else the env's, a served env's declared one capped at `seeupo_gym.remote.MAX_TURNS_CAP`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import gymnasium as gym

import seeupo_gym  # noqa: F401  (registers the ids)

from seeupo_gym.tools import TURN_END_REPLY as _TURN_END  # a plain-text reply: ends a BFCL user turn without calls
from seeupo_gym.tools import plain_reply, step_tool_result


_TRAINER_NAMES = ("SeeUPOTrainer", "SeeUPOConfig")

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    """`SeeUPOTrainer` / `SeeUPOConfig` (trl_seeupo.py), imported on first use: this module stays light."""
    if name in _TRAINER_NAMES:
        from seeupo_gym.integrations import trl_seeupo

        return getattr(trl_seeupo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_dataset_fills_a_step(dataset: Any, args: Any, processes: int) -> None:
    """Refuse (ValueError, one line) a dataset too small for one generation batch. GRPOTrainer's sampler
    draws `generation_batch_size / num_generations` distinct prompts per batch and drops an incomplete
    one: with fewer rows TRL trains 0 steps and exits 0. An iterable dataset (no length) is not checked."""
    try:
        rows = len(dataset)
    except TypeError:
        return
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    needed = args.per_device_train_batch_size * processes * steps // args.num_generations
    if rows < needed:
        raise ValueError(
            f"the dataset has {rows} row(s) and one generation batch takes {needed} distinct prompts (processes {processes} "
            f"x per_device_train_batch_size {args.per_device_train_batch_size} x steps_per_generation {steps} / "
            f"num_generations {args.num_generations}): TRL would train 0 steps; give more tasks or a smaller batch")


class _SeeupoEnvironment:
    """What every adapter shares: one Gymnasium env, stepped once per tool call."""

    env_id: str = ""
    env_kwargs: dict[str, Any] = {}
    url: str | None = None  # a seeupo-serve server serving env_id: the env runs there

    def __init__(self) -> None:
        from seeupo_gym.remote import env_target

        target_id, target_kwargs = env_target(self.env_id, self.env_kwargs, url=self.url)
        self._env = gym.make(target_id, **target_kwargs)
        self._reward = 0.0
        self._done = True
        self.steps: list[str] = []  # the actions sent to the env this episode, for audits and tests
        self.task_id = ""

    def reset(self, task_id: str, **row: Any) -> str:
        self._reward, self._done, self.steps, self.task_id = 0.0, True, [], str(task_id)
        try:
            _, info = self._env.reset(options={"task_id": task_id})
            first = _first_user_message(info)
        except Exception as error:  # noqa: BLE001  a failed reset ends this rollout only, never the trainer
            logger.warning("env reset failed for task %s: %s: %s", task_id, type(error).__name__, error)
            return f"Error: the episode could not start ({type(error).__name__}: {str(error)[:500]}); it scores 0."
        self._done = False
        return first

    def _final_reward(self) -> float:
        """The env's final score (see the module docstring); private, so TRL makes it neither a tool
        nor a reward column of its own. At most the env's turn limit of closing steps: an env that
        has not ended by then scores 0.0."""
        from seeupo_gym.remote import turn_cap

        # our config's max_turns, else the env's (a served one's as it declares it), at most MAX_TURNS_CAP
        limit = turn_cap(self.env_kwargs.get("max_turns"), getattr(self._env.unwrapped, "max_turns", None))
        for _ in range(limit):
            if self._done:
                return self._reward
            self._step(self._closing_action())
        if not self._done:
            logger.warning("task %s: the env did not end its episode within %s closing steps; it scores 0.0",
                           self.task_id, limit)
            self._done, self._reward = True, 0.0
        return self._reward

    # -------------------------------------------------------------- helpers (not tools: private)

    def _closing_action(self) -> str:
        return ""  # an action that does nothing (an error observation) and uses up a turn

    def _step(self, action: str) -> tuple[str, dict[str, Any]]:
        if self._done:
            return "The episode is over.", {}
        from seeupo_gym.remote import RemoteEnvError

        self.steps.append(action)
        try:
            observation, reward, terminated, truncated, info = self._env.step(action)
        except RemoteEnvError as error:  # the served episode is gone (or refused at the door): it ends here, unscored
            self._done, self._reward = True, 0.0
            return f"Error: the episode ended because its env server was lost or refused ({str(error)[:500]}).", {}
        self._done = terminated or truncated
        if self._done:
            self._reward = float(reward)
        return observation, info

    def _tool_result(self, action: str) -> str:
        """Step the env; the result is the env's tool message when it sent one, else its observation."""
        return step_tool_result(*self._step(action))

    def _close(self) -> None:  # private: every public method would become a tool
        self._env.close()


def _first_user_message(info: dict[str, Any]) -> str:
    return next(m["content"] for m in info["messages"] if m["role"] == "user")


# ------------------------------------------------------------------------------------ TurnBandit


class TurnBanditEnvironment(_SeeupoEnvironment):
    env_id = "seeupo/TurnBandit-v0"

    def answer(self, label: str) -> str:
        """Choose one option of the current step.

        Args:
            label: The letter of the option, for example B.
        """
        from seeupo_gym.tools import render_tool_calls

        return self._tool_result(render_tool_calls([("answer", {"label": label if isinstance(label, str) else str(label)})]))


# ------------------------------------------------------------------------------------------ BFCL

_PYTHON_TYPES = {"string": str, "integer": int, "float": float, "number": float, "boolean": bool, "dict": dict}


def _python_type(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if kind in ("array", "tuple"):
        item = _python_type(schema.get("items") or {})
        return list[item] if item is not Any else list
    return _PYTHON_TYPES.get(kind, Any)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _bfcl_tool(doc: Any) -> Callable[..., str]:
    """A method named after a BFCL function, with its parameters as typed keyword arguments and a
    docstring in the format `get_json_schema` reads; a call runs it through the env."""
    from seeupo_gym.tools import render_tool_calls

    name = doc.name
    properties = doc.parameters.get("properties", {})
    required = set(doc.parameters.get("required", ()))

    def tool(self: _SeeupoEnvironment, **arguments: Any) -> str:
        return self._tool_result(render_tool_calls([(name, arguments)]))

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    lines = [_one_line(doc.description) or name, "", "Args:"] if properties else [_one_line(doc.description) or name]
    for parameter, schema in properties.items():
        hint = _python_type(schema)
        default = inspect.Parameter.empty if parameter in required else schema.get("default")
        if default is not inspect.Parameter.empty:
            hint = hint | None if hint is not Any else Any
        annotations[parameter] = hint
        parameters.append(inspect.Parameter(parameter, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
        lines.append(f"    {parameter}: {_one_line(schema.get('description', '')) or parameter}")
    annotations["return"] = str
    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = "\n".join(lines)
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    tool.__annotations__ = annotations
    return tool


class BFCLEnvironment(_SeeupoEnvironment):
    """Base of the per-backend-combination classes `bfcl_environment_class` builds."""

    env_id = "seeupo/BFCL-v4-v0"

    def end_turn(self, reply: str) -> str:
        """Reply to the user in plain text, which ends your turn; returns the user's next message.

        Args:
            reply: Your answer to the user.
        """
        return self._step(self._plain_reply(reply))[0]

    def _parsing_env(self) -> Any:
        """The env whose parser settings read replies: the local env, or for a served one a local
        copy built with the same kwargs (never reset: BFCL's parsing needs no episode)."""
        if self.url is None:
            return self._env.unwrapped
        if getattr(self, "_local_parser_env", None) is None:
            self._local_parser_env = gym.make(self.env_id, **self.env_kwargs).unwrapped
        return self._local_parser_env

    def _plain_reply(self, reply: Any) -> str:
        """`reply` when the env reads it as plain text, else `_TURN_END`: a reply holding tool-call
        markup (or anything the env's parser would not take as text) must end the turn, not run calls."""
        if not isinstance(reply, str) or not reply.strip():
            return _TURN_END
        env = self._parsing_env()
        return plain_reply(reply, parser=env.tool_parser, template=env.template, max_chars=env.max_action_chars)

    def _closing_action(self) -> str:
        return _TURN_END


def bfcl_environment_class(
    classes: tuple[str, ...], env_kwargs: dict[str, Any], url: str | None = None, env_id: str | None = None
) -> type[BFCLEnvironment]:
    """The environment class whose tools are the functions of these BFCL backends (served: `env_id` at `url`)."""
    from seeupo_gym.bfcl.data import function_docs

    methods = {doc.name: _bfcl_tool(doc) for class_name in classes for doc in function_docs()[class_name]}
    kwargs = {"split": "all", **env_kwargs, "action_format": "tools"}
    return type(f"BFCL_{'_'.join(classes)}", (BFCLEnvironment,), {**methods, "env_kwargs": kwargs, "url": url,
                                                               "env_id": env_id if url and env_id else BFCLEnvironment.env_id})


def bfcl_environment_name(classes: tuple[str, ...]) -> str:
    return "+".join(sorted(classes))


BFCL_TRL_NOTE = (
    "\n\nIn this conversation, the user's later requests come back as the result of the `end_turn` tool: call "
    "`end_turn` with your reply when a request is done."
)


# -------------------------------------------------------------------------------------- AppWorld


class AppWorldEnvironment(_SeeupoEnvironment):
    env_id = "seeupo/AppWorld-v0"

    def execute_python(self, code: str) -> str:
        """Run Python code in the task's persistent session and return what it printed. The `apis` object reaches every app: apis.<app_name>.<api_name>(**parameters).

        Args:
            code: The Python code to run.
        """
        from seeupo_gym.appworld.env import render_tool_action

        return self._tool_result(render_tool_action(code) if isinstance(code, str) else str(code))


# ------------------------------------------------------------------------------------------ reward


def environment_reward(environment: Any) -> float:
    """A rollout's reward: its environment's final score (the episode run out if it stopped early)."""
    return environment._final_reward()


class EnvReward:
    """GRPOTrainer's reward function for an env: each rollout's final score, in one column named
    after the env (TRL names a reward function by its `__name__`). A class, so TRL can pickle it."""

    def __init__(self, env_id: str) -> None:
        self.__name__ = env_id.rsplit("/", 1)[-1]

    def __call__(self, prompts: Any = None, completions: Any = None, environments: Any = None, **kwargs: Any) -> list[float]:
        if environments is None:
            raise ValueError(f"{self.__name__}: TRL passed no environments; use it with make()'s environment_factory")
        return [environment_reward(environment) for environment in environments]


# -------------------------------------------------------------------------------------------- make


def make(
    env_id: str, /, task_ids: list[str] | None = None, *, url: str | None = None, **env_kwargs: Any
) -> dict[str, Any]:
    """GRPOTrainer's `environment_factory`, `train_dataset` and `reward_funcs`, as keyword arguments:
    `GRPOTrainer(model=..., args=..., **make(env_id, ...))`.

    env_id: "seeupo/TurnBandit-v0", "seeupo/BFCL-v4-v0" (or a category id) or "seeupo/AppWorld-v0";
        or "seeupo/Remote-v0" with `url`, `env_id` (the served id) and `env_kwargs`, as `gym.make` takes it.
    task_ids: the tasks of the dataset (default: the env's own task list / split; the server's with `url`).
    url: a `seeupo-serve` server serving `env_id` with these kwargs; each instance is a session there.
    env_kwargs: passed to `gym.make` (every env runs in the tools format).
    Each dataset row holds `prompt` (the system message and an empty user message, which `reset`
    fills with the task's first message) and `task_id`; BFCL rows also hold `environment`.
    `reward_funcs` is one `EnvReward`: one reward column per env.
    """
    if env_id == "seeupo/Remote-v0":
        served_id, served_kwargs = env_kwargs.pop("env_id", None), env_kwargs.pop("env_kwargs", None) or {}
        if not url or not isinstance(served_id, str):
            raise ValueError('make("seeupo/Remote-v0", ...) needs url= (the seeupo-serve server) and env_id= (the id it serves)')
        if env_kwargs:
            raise ValueError(f"unknown arguments for seeupo/Remote-v0: {sorted(env_kwargs)}; the env's kwargs go in env_kwargs={{...}}")
        if served_id == "seeupo/Remote-v0":
            raise ValueError("env_id= names the env the server serves, not seeupo/Remote-v0")
        return make(served_id, task_ids, url=url, **dict(served_kwargs))
    factory, dataset = _factory_and_dataset(env_id, task_ids, env_kwargs, url)
    return {"environment_factory": factory, "train_dataset": dataset, "reward_funcs": [EnvReward(env_id)]}


def _factory_and_dataset(env_id: str, task_ids: list[str] | None, env_kwargs: dict[str, Any], url: str | None) -> tuple[Any, Any]:
    from datasets import Dataset

    def served_task_ids(kwargs: dict[str, Any]) -> list[str]:
        """The server's task list for these kwargs (it checks them against what it serves)."""
        probe = gym.make("seeupo/Remote-v0", url=url, env_id=env_id, env_kwargs=kwargs)
        try:
            return list(probe.unwrapped.task_ids)
        finally:
            probe.close()

    def rows(ids: list[str], system: str, **extra: Any) -> list[dict[str, Any]]:
        prompt = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
        return [{"prompt": prompt, "task_id": task_id, **extra} for task_id in ids]

    if env_id == "seeupo/TurnBandit-v0":
        kwargs = {**env_kwargs, "action_format": "tools"}
        cls = type("TurnBanditEnvironment", (TurnBanditEnvironment,), {"env_kwargs": kwargs, "url": url})
        probe = gym.make(env_id, **kwargs).unwrapped  # the system prompt; local, cheap
        if task_ids is not None:
            ids = list(task_ids)
        else:
            ids = served_task_ids(kwargs) if url else list(probe.task_ids)
        return cls, Dataset.from_list(rows(ids, probe.system_prompt()))

    if env_id.startswith("seeupo/BFCL-v4"):
        from seeupo_gym.bfcl.data import get_entry
        from seeupo_gym.bfcl.prompt import tools_system_prompt
        from seeupo_gym.templates import ReActTemplate

        # Each tool call is a step: the paper's 10 responses would be a handful of calls here.
        env_kwargs = {"max_turns": 50, **env_kwargs}
        probe = gym.make(env_id, **{**env_kwargs, "action_format": "tools"}).unwrapped
        # Served: the server's id fixes the categories; the kwargs must be what it serves.
        kwargs = {**env_kwargs} if url else {"categories": probe.categories, **env_kwargs}
        kwargs.pop("split", None)
        if task_ids is not None:
            ids = list(task_ids)
        else:
            ids = served_task_ids({"split": "all", **kwargs, "action_format": "tools"}) if url else list(probe.task_ids)
        factories: dict[str, Any] = {}
        data: list[dict[str, Any]] = []
        system = tools_system_prompt(probe.template if isinstance(probe.template, ReActTemplate) else ReActTemplate(),
                                     probe.max_turns) + BFCL_TRL_NOTE
        for task_id in ids:
            classes = get_entry(task_id).involved_classes
            name = bfcl_environment_name(classes)
            if name not in factories:
                factories[name] = bfcl_environment_class(tuple(sorted(classes)), kwargs, url=url, env_id=env_id)
            data += rows([task_id], system, environment=name)
        return factories, Dataset.from_list(data)

    if env_id == "seeupo/AppWorld-v0":
        from seeupo_gym.appworld.env import PROTOCOL, ROLE, TOOLS_ACTION_FORMAT
        from seeupo_gym.appworld.paths import MINI_SPLIT, find_data_dir, read_split
        from seeupo_gym.templates import ReActTemplate

        kwargs = {**env_kwargs, "action_format": "tools"}
        split = kwargs.get("split", MINI_SPLIT)
        if task_ids is not None:
            ids = list(task_ids)
        elif url:  # the data and the sandboxes are the server's
            ids = served_task_ids(kwargs)
        else:
            ids = list(read_split(find_data_dir(split, kwargs.get("data_dir")), split))
        template = kwargs.get("template") or ReActTemplate()
        system = template.system_prompt(role=ROLE, protocol=PROTOCOL.format(max_turns=kwargs.get("max_turns", 10)),
                                        action_format=TOOLS_ACTION_FORMAT)
        cls = type("AppWorldEnvironment", (AppWorldEnvironment,), {"env_kwargs": kwargs, "url": url})
        return cls, Dataset.from_list(rows(ids, system))

    raise ValueError(f"no TRL adapter for {env_id!r}; use seeupo/TurnBandit-v0, seeupo/BFCL-v4-v0 or seeupo/AppWorld-v0")
