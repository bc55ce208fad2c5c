"""TurnBandit: a family of small multi-turn text tasks with a known optimum (`seeupo/TurnBandit-v0`).

A task has T turns (2-4) with K labelled options each; the agent answers each turn by naming one
option, and the team reward r(a_1..a_T) in [0, 1] is revealed at the end. Tasks come from a seed.

Variants (kwarg `variant`):
- `climbing` (deceptive, after the climbing game): the optimal joint action scores 1, every other
  joint action that starts like it scores almost nothing, and a decoy first option scores well
  whatever follows, so the first option that is best under a uniform continuation is the decoy.
- `random`: rewards drawn uniformly, rescaled so the best joint action scores 1.
- `mixed` (default): even task indices climbing, odd ones random.
- `stopping` (the episode's length is the policy's choice): at every turn one option (its place
  drawn per turn) is "stop", which ends the episode with that stop's reward. Continuing along one
  path of the other options reaches J*; the first turn's stop is a sure mid-size reward (a decoy,
  better than continuing under a uniform continuation, which mostly falls off the path). By task
  index mod 3: continuing to the end is optimal (J* = 1 after T turns); a stop at turn t_s >= 2 on
  the path is optimal (J* = 1 there, continuing to the end scores less); stopping first is optimal.
  `optimal()` is backward induction over stops included.
- `easy`: for small LLMs; T=2, K options per turn, exactly one of which is a fruit; the reward is
  the fraction of turns on which the fruit was chosen (`hint=True` says so in the goal).
- `capital`: the smoke test of a training loop, learnable by a random-init model; T=2 (the
  `turns` kwarg), every response is valid and chooses "A) starts with a capital letter"
  (its first non-space character is A-Z) or "B) anything else"; the reward is the fraction of
  turns on which A was chosen. About 17% of the Qwen2 vocabulary starts with a capital, so the
  first token of a random model earns reward often enough for RL to raise it (`--config smoke`).
- `ladder` (long horizons, a decoy): one right option per turn; the reward is the share of turns
  answered right before the first wrong one, except that one decoy first option pays 0.5 whatever
  follows. Under a uniform continuation the decoy is the better first choice once T >= 3; J* = 1.
- `follow`: instruction following for small LLMs; T=2, K=3; every step names the option to pick
  ("Pick option B."; a task names distinct options while T <= K), the reward is the fraction of
  turns on which it was picked. The untrained 0.5B model follows greedily but samples the named
  letter only 0.48 (K=3) to 0.62 (K=2) of the time: a preference RL can sharpen (`make demo`).

The best joint action scores J* = 1 unless `optimum` says otherwise: a number in (0, 1] scales
every task's rewards so that J* is that number; a range `(low, high)` draws each task's J* from
it, so a learner cannot assume that the best possible reward is 1.

Options of `make_tasks` for the tabular studies (docs/credit.md; the env takes neither): `turns` up to
`MAX_TASK_TURNS` (10; scenes repeat past 4 turns), and `slip` (stochastic transitions): the option a
turn executes is the chosen one with probability 1 - slip, else one of the others uniformly; rewards
and the next turn follow the executed options, and `optimal()` maximizes the expectation.

The env follows the contract of the other envs: `reset` returns the system prompt and the first
step as one string; `info["messages"]` is the chat history, system message first; `info["turn"]`
counts the responses so far (0 after reset); every `info` key has one type in every step.
Invalid actions (anything that does not name one option, an unclosed `<think>` block, over-long
text) never raise: the observation says what was wrong and lists the options again,
`info["action_error"]` says it too (it is "" after a valid action), the turn is used up, the same
decision is asked again, and each invalid turn costs `invalid_penalty` off the final reward
(floored at 0). An episode that reaches `max_turns` before the last decision is truncated with
reward 0.

With `action_format="tools"` (native tool calling) the env publishes one tool, `answer(label)`
(`TOOLS`, in `info["tools"]` for the chat template's `tools=`), and a response chooses by calling it
exactly once (`<tool_call>{"name": "answer", "arguments": {"label": "B"}}</tool_call>` with the default
"hermes" parser of `seeupo_gym.tools`); the env's reply comes back as a `tool` message. A response
without that one call (no call, bad JSON, an unknown tool, several calls, a label that names no
option) is an invalid action as above.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

import gymnasium as gym

from seeupo_gym.options import task_id_option
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.templates import ReActTemplate
from seeupo_gym.text import valid_unicode
from seeupo_gym.tools import assistant_message, function_schema, parse_tool_response, tool_message
from seeupo_gym.tools import tool_parser as find_tool_parser

LABELS = "ABCDEFGH"
VARIANTS = ("mixed", "climbing", "random", "easy", "follow", "capital", "stopping", "ladder")
MAX_TASK_TURNS = 10
MAX_OBSERVATION_CHARS = 4096
MAX_ACTION_CHARS = 8192
ACTION_FORMATS = ("react", "tools")
TOOL_NAME = "answer"
_UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
TOOLS = [
    function_schema(
        TOOL_NAME,
        "Choose one option of the current step.",
        {"type": "object", "properties": {"label": {"type": "string", "description": "The letter of the option, for example B."}},
         "required": ["label"]},
    )
]

_SCENES = [
    ("door", ["red", "blue", "green", "gold", "iron", "oak", "glass", "stone"]),
    ("path", ["left", "right", "middle", "upper", "lower", "narrow", "wide", "dark"]),
    ("key", ["silver", "bronze", "copper", "bone", "jade", "rusty", "tiny", "heavy"]),
    ("boat", ["sail", "row", "motor", "raft", "canoe", "barge", "yacht", "ferry"]),
]
_FRUITS = ["apple", "banana", "cherry", "grape", "mango", "pear", "plum", "peach"]
_NON_FRUITS = ["hammer", "sock", "brick", "cloud", "spoon", "candle", "rope", "coin", "ladder", "button"]


@dataclass(frozen=True)
class BanditTask:
    """One TurnBandit task: option texts per turn and the reward of every joint action."""

    task_id: str
    kind: str
    goal: str
    options: tuple[tuple[str, ...], ...]  # options[t][k]: text of option k at turn t+1
    # every complete joint action (T choices, or fewer ending with a stop) -> team reward in [0, 1]
    rewards: dict[tuple[int, ...], float]
    instructions: tuple[str, ...] = ()  # per turn, shown with the options (`follow`)
    stops: tuple[int, ...] = ()  # the stop option of each turn (`stopping`); () = no stop
    # Emit a reward at every turn (`turn_rewards`) instead of the whole reward at the end; the sum is the same.
    per_turn_rewards: bool = False
    # The probability that a turn executes another option than the chosen one (uniform over the others).
    slip: float = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.options)

    @property
    def num_options(self) -> int:
        return len(self.options[0])

    def reward(self, actions: Sequence[int]) -> float:
        return self.rewards[tuple(actions)]

    def ends(self, actions: Sequence[int]) -> bool:
        """Whether the episode is over after `actions`: T choices, or a turn's stop option."""
        return len(actions) >= self.num_turns or bool(self.stops and actions and actions[-1] == self.stops[len(actions) - 1])

    def executed(self, chosen: int) -> list[tuple[int, float]]:
        """(executed option, probability) after choosing `chosen`: itself w.p. 1 - slip, else uniform over the others."""
        if not self.slip:
            return [(chosen, 1.0)]
        other = self.slip / (self.num_options - 1)
        return [(e, 1.0 - self.slip if e == chosen else other) for e in range(self.num_options)]

    def uniform_value(self, history: Sequence[int]) -> float:
        """phi(h): the mean reward after `history` when every later turn is uniform; the reward itself once it ends."""
        history = tuple(history)
        if history and self.ends(history):
            return self.reward(history)
        return sum(self.uniform_value(history + (a,)) for a in range(self.num_options)) / self.num_options

    def turn_rewards(self, actions: Sequence[int]) -> tuple[float, ...]:
        """The per-turn rewards of a complete joint action: r_1 = phi(a_1), r_t = phi(a_1..a_t) - phi(a_1..a_t-1)
        (phi = `uniform_value`). They add up to r(a) (the differences telescope), so returns and J* are those
        of the end-only reward; each turn is told how much its choice moved a uniform continuation's
        expectation, which on `climbing` and `stopping` points at the decoy, as a shaped reward can."""
        actions = tuple(actions)
        if not self.ends(actions):
            raise ValueError(f"{actions} is not a complete joint action of task {self.task_id}")
        phi = [self.uniform_value(actions[: t + 1]) for t in range(len(actions))]
        return tuple([phi[0]] + [phi[t] - phi[t - 1] for t in range(1, len(phi))])

    def optimal(self) -> tuple[float, tuple[int, ...]]:
        """(J*, an optimal joint action) by backward induction: V(h) = max_a [r(h, a) if the episode
        ends at (h, a) (the last turn, or a stop) else V(h, a)]; ties go to the lowest option index.
        With `slip`, h is the executed history and V(h) = max_a sum_e P(e | a) [r(h, e) or V(h, e)]; the
        joint action returned is then the choices along the path on which nothing slips."""
        best_action: dict[tuple[int, ...], int] = {}

        def value(history: tuple[int, ...]) -> float:
            outcome = [self.reward(history + (e,)) if self.ends(history + (e,)) else value(history + (e,))
                       for e in range(self.num_options)]
            children = [sum(p * outcome[e] for e, p in self.executed(a)) for a in range(self.num_options)]
            best = max(range(self.num_options), key=lambda a: (children[a], -a))
            best_action[history] = best
            return children[best]

        optimum = value(())
        actions: tuple[int, ...] = ()
        while not actions or not self.ends(actions):
            actions += (best_action[actions],)
        return optimum, actions

    @property
    def optimal_value(self) -> float:
        return self.optimal()[0]

    def optimal_answers(self) -> tuple[str, ...]:
        """An optimal joint action as the labels the env accepts, one per step (e.g. ("B", "A"))."""
        return tuple(LABELS[a] for a in self.optimal()[1])

    def first_turn_uniform_values(self) -> list[float]:
        """Mean reward of each first option when every later turn is uniform."""

        def uniform(history: tuple[int, ...]) -> float:
            if self.ends(history):
                return self.reward(history)
            return sum(uniform(history + (a,)) for a in range(self.num_options)) / self.num_options

        return [uniform((a,)) for a in range(self.num_options)]

    @property
    def deceptive(self) -> bool:
        """True when the first option best under a uniform continuation starts no optimal joint action."""
        uniform = self.first_turn_uniform_values()
        greedy = max(range(self.num_options), key=lambda a: uniform[a])
        best = self.optimal_value
        return all(r < best for a, r in self.rewards.items() if a[0] == greedy)


def _scene_options(rng: random.Random, turns: int, options: int) -> tuple[tuple[str, ...], ...]:
    # Distinct scenes up to 4 turns (the draws of existing tasks unchanged); repeated past that.
    scenes = rng.sample(_SCENES, turns) if turns <= len(_SCENES) else [rng.choice(_SCENES) for _ in range(turns)]
    return tuple(tuple(f"{word} {noun}" for word in rng.sample(words, options)) for noun, words in scenes)


def _climbing_task(task_id: str, rng: random.Random, turns: int, options: int) -> BanditTask:
    best = tuple(rng.randrange(options) for _ in range(turns))
    decoy = rng.choice([a for a in range(options) if a != best[0]])
    rewards = {}
    for actions in itertools.product(range(options), repeat=turns):
        if actions == best:
            rewards[actions] = 1.0
        elif actions[0] == best[0]:
            rewards[actions] = round(rng.uniform(0.0, 0.1), 3)  # the cliff around the optimum
        elif actions[0] == decoy:
            rewards[actions] = round(rng.uniform(0.6, 0.8), 3)  # safe, never optimal
        else:
            rewards[actions] = round(rng.uniform(0.0, 0.5), 3)
    goal = "Reach the treasure room."
    return BanditTask(task_id, "climbing", goal, _scene_options(rng, turns, options), rewards)


STOP_TEXT = "stop here and take this step's reward"


def _stopping_task(task_id: str, rng: random.Random, turns: int, options: int, shape: int) -> BanditTask:
    """shape 0: continuing to the end is optimal; 1: a later stop on the path; 2: the first stop."""
    if options < 3:
        raise ValueError("the stopping variant needs options >= 3 (a stop and two ways on)")
    stops = tuple(rng.randrange(options) for _ in range(turns))
    best = tuple(rng.choice([a for a in range(options) if a != stops[t]]) for t in range(turns))
    later_stop = rng.randint(2, turns) if turns >= 2 and shape == 1 else None
    if shape == 1 and later_stop is None:
        shape = 0  # one turn: no later stop
    rewards: dict[tuple[int, ...], float] = {}

    def visit(history: tuple[int, ...]) -> None:
        t = len(history)  # 0-based turn of the next choice
        on_path = history == best[:t]
        for a in range(options):
            actions = history + (a,)
            if a == stops[t]:
                if on_path and t == 0:
                    rewards[actions] = 1.0 if shape == 2 else round(rng.uniform(0.55, 0.75), 3)  # the decoy
                elif on_path and later_stop == t + 1:
                    rewards[actions] = 1.0
                elif on_path:
                    rewards[actions] = round(rng.uniform(0.2, 0.5), 3)
                else:
                    rewards[actions] = round(rng.uniform(0.0, 0.3), 3)
            elif t + 1 == turns:
                if actions == best:
                    rewards[actions] = 1.0 if shape == 0 else round(rng.uniform(0.6, 0.9), 3)
                elif actions[0] == best[0]:
                    rewards[actions] = round(rng.uniform(0.0, 0.1), 3)  # the cliff around the path
                else:
                    rewards[actions] = round(rng.uniform(0.0, 0.4), 3)
            else:
                visit(actions)

    visit(())
    texts = tuple(tuple(STOP_TEXT if k == stops[t] else text for k, text in enumerate(row))
                  for t, row in enumerate(_scene_options(rng, turns, options)))
    goal = "Reach the treasure room, or stop on the way and keep what that step offers."
    return BanditTask(task_id, "stopping", goal, texts, rewards, stops=stops)


def _ladder_task(task_id: str, rng: random.Random, turns: int, options: int) -> BanditTask:
    right = tuple(rng.randrange(options) for _ in range(turns))
    decoy = rng.choice([a for a in range(options) if a != right[0]])
    rewards = {}
    for actions in itertools.product(range(options), repeat=turns):
        climbed = next((t for t in range(turns) if actions[t] != right[t]), turns)
        rewards[actions] = 0.5 if actions[0] == decoy else round(climbed / turns, 3)
    goal = "Climb the ladder: every step has one right rung."
    return BanditTask(task_id, "ladder", goal, _scene_options(rng, turns, options), rewards)


def _random_task(task_id: str, rng: random.Random, turns: int, options: int) -> BanditTask:
    raw = {a: rng.random() for a in itertools.product(range(options), repeat=turns)}
    top = max(raw.values())
    rewards = {a: round(r / top, 3) for a, r in raw.items()}
    goal = "Reach the treasure room."
    return BanditTask(task_id, "random", goal, _scene_options(rng, turns, options), rewards)


def _per_turn_rewards(right: Sequence[int], options: int) -> dict[tuple[int, ...], float]:
    """Every joint action's reward: the share of turns t on which it picked option right[t]."""
    turns = len(right)
    return {
        a: sum(int(a[t] == right[t]) for t in range(turns)) / turns
        for a in itertools.product(range(options), repeat=turns)
    }


def _easy_task(task_id: str, rng: random.Random, turns: int, options: int, hint: bool) -> BanditTask:
    texts, fruit_at = [], []
    for _ in range(turns):
        items = rng.sample(_NON_FRUITS, options - 1)
        position = rng.randrange(options)
        items.insert(position, rng.choice(_FRUITS))
        texts.append(tuple(items))
        fruit_at.append(position)
    goal = "Pick the fruit at every step." if hint else "Find the hidden prize."
    return BanditTask(task_id, "easy", goal, tuple(texts), _per_turn_rewards(fruit_at, options))


def _follow_task(task_id: str, rng: random.Random, turns: int, options: int) -> BanditTask:
    # Distinct options per task where there are enough: a policy that favours one letter then
    # gains nothing on average, so RL has to learn to follow the instruction.
    named = rng.sample(range(options), turns) if turns <= options else [rng.randrange(options) for _ in range(turns)]
    instructions = tuple(f"Pick option {LABELS[k]}." for k in named)
    goal = "Pick the option each step names."
    options_text = _scene_options(rng, turns, options)
    return BanditTask(task_id, "follow", goal, options_text, _per_turn_rewards(named, options), instructions)


def _capital_task(task_id: str, rng: random.Random, turns: int) -> BanditTask:
    options = tuple(("starts with a capital letter", "anything else") for _ in range(turns))
    return BanditTask(task_id, "capital", "Start every answer with a capital letter.", options,
                      _per_turn_rewards([0] * turns, 2))


def _capital_choice(action: str) -> int:
    """`capital`: every response chooses; A (0) when its first non-space character is A-Z."""
    first = action.strip()[:1]
    return 0 if first.isascii() and first.isupper() else 1


def _optimum_range(optimum: float | tuple[float, float]) -> tuple[float, float]:
    low, high = (optimum, optimum) if isinstance(optimum, (int, float)) else tuple(optimum)
    if not 0 < low <= high <= 1:
        raise ValueError(f"optimum must be a number in (0, 1] or a range (low, high) within it, got {optimum!r}")
    return float(low), float(high)


def _scaled(task: BanditTask, optimum: float) -> BanditTask:
    return dataclasses.replace(task, rewards={a: round(r * optimum, 3) for a, r in task.rewards.items()})


def make_tasks(
    variant: str = "mixed",
    num_tasks: int = 64,
    seed: int = 0,
    turns: tuple[int, int] = (2, 4),
    options: int = 3,
    hint: bool = False,
    optimum: float | tuple[float, float] = 1.0,
    turn_rewards: bool = False,
    slip: float = 0.0,
) -> list[BanditTask]:
    """The task list of a TurnBandit variant; task i depends only on (variant, seed, i, optimum).
    turn_rewards: the tasks pay `BanditTask.turn_rewards` turn by turn (same sum, same J*).
    slip: stochastic transitions (`BanditTask.executed`), for the tabular studies; the env takes none."""
    low_optimum, high_optimum = _optimum_range(optimum)
    if variant not in VARIANTS:
        raise ValueError(f"unknown TurnBandit variant {variant!r}; choose one of {VARIANTS}")
    low, high = turns
    if not 1 <= low <= high <= MAX_TASK_TURNS:
        raise ValueError(f"turns must be (low, high) with 1 <= low <= high <= {MAX_TASK_TURNS}, got {turns}")
    if not 0.0 <= slip < 1.0:
        raise ValueError(f"slip must lie in [0, 1), got {slip}")
    if not 2 <= options <= len(LABELS):
        raise ValueError(f"options must lie in [2, {len(LABELS)}], got {options}")
    tasks = []
    for i in range(num_tasks):
        rng = random.Random(f"turnbandit:{variant}:{seed}:{i}")
        task_id = f"{variant}-{seed}-{i}"
        if variant == "easy":
            task = _easy_task(task_id, rng, rng.randint(low, high), options, hint)
        elif variant == "follow":
            task = _follow_task(task_id, rng, rng.randint(low, high), options)
        elif variant == "capital":
            task = _capital_task(task_id, rng, rng.randint(low, high))
        elif variant == "stopping":
            task = _stopping_task(task_id, rng, rng.randint(low, high), options, i % 3)
        elif variant == "ladder":
            task = _ladder_task(task_id, rng, rng.randint(low, high), options)
        else:
            kind = variant if variant != "mixed" else ("climbing" if i % 2 == 0 else "random")
            make = _climbing_task if kind == "climbing" else _random_task
            task = make(task_id, rng, rng.randint(low, high), options)
        if (low_optimum, high_optimum) != (1.0, 1.0):
            # Its own generator, so the tasks with J* = 1 stay exactly what they were.
            task = _scaled(task, random.Random(f"turnbandit-optimum:{variant}:{seed}:{i}").uniform(low_optimum, high_optimum))
        if turn_rewards:
            task = dataclasses.replace(task, per_turn_rewards=True)
        if slip:
            task = dataclasses.replace(task, slip=float(slip))
        tasks.append(task)
    return tasks


_LABEL_ANSWER = re.compile(r"^(?:option\s*)?[(\[]?([A-Ha-h])[)\].:]?$", re.IGNORECASE)


def parse_choice(action: str, options: Sequence[str]) -> int | None:
    """The option an action names: its label (`B`, `b`, `(B)`, `B.`, `Option B`, `B) red door`)
    or its exact text; None when it names none of them."""
    text = action.strip().strip("`'\"*").strip()
    label_with_text = re.match(r"^[(\[]?([A-Ha-h])[)\].:]\s+(.+)$", text)
    if label_with_text:
        index = LABELS.index(label_with_text.group(1).upper())
        if index < len(options) and label_with_text.group(2).strip().rstrip(".").lower() == options[index].lower():
            return index
        return None
    match = _LABEL_ANSWER.match(text)
    if match:
        index = LABELS.index(match.group(1).upper())
        return index if index < len(options) else None
    lowered = text.rstrip(".").lower()
    for index, option in enumerate(options):
        if lowered == option.lower():
            return index
    return None


class TurnBanditEnv(gym.Env[str, str]):
    """Sequence-level multi-turn text env over TurnBandit tasks: one step is one whole response.

    kwargs: variant, num_tasks, seed (of the task list, not of the episode draw), turns=(low, high),
    options (K), hint (easy variant), optimum (J*, or the range J* is drawn from per task),
    invalid_penalty, max_turns, template, brief (a one-sentence system prompt without the
    reasoning instructions, for small models answering in a few tokens; a `<think>` block is still parsed),
    action_format ("react": the letter after `<think>`, the default; "tools": a call of the `answer` tool),
    tool_parser (with "tools", the registered parser that reads the call; see `seeupo_gym.tools`),
    turn_rewards (each step's `info["turn_reward"]` is that turn's share of the episode's reward,
    `BanditTask.turn_rewards`; the step rewards stay 0 ... R, the shares add up to R).
    `gym.make("seeupo/TurnBandit-v0", variant="easy", options=2)` is the small-LLM preset.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        variant: str = "mixed",
        num_tasks: int = 64,
        seed: int = 0,
        turns: tuple[int, int] | None = None,
        options: int | None = None,
        hint: bool = False,
        optimum: float | tuple[float, float] = 1.0,
        invalid_penalty: float = 0.1,
        max_turns: int = 10,
        template: ReActTemplate | None = None,
        brief: bool = False,
        action_format: str = "react",
        tool_parser: str = "hermes",
        turn_rewards: bool = False,
    ) -> None:
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {list(ACTION_FORMATS)}, got {action_format!r}")
        find_tool_parser(tool_parser)  # an unknown parser name is a clear error here
        self.action_format = action_format
        self.tool_parser = tool_parser
        self.variant = variant
        if variant == "capital":
            options = 2  # its two options are fixed
        if variant in ("easy", "follow", "capital"):
            turns = turns or (2, 2)
            options = options or (2 if variant == "easy" else 3)
        self.turn_rewards = turn_rewards
        self.tasks = make_tasks(variant, num_tasks, seed, turns or (2, 4), options or 3, hint, optimum, turn_rewards)
        self.task_index = {task.task_id: k for k, task in enumerate(self.tasks)}
        self.task_ids: tuple[str, ...] = tuple(task.task_id for task in self.tasks)
        if not 0 <= invalid_penalty <= 1:
            raise ValueError(f"invalid_penalty must lie in [0, 1], got {invalid_penalty}")
        if max_turns < max(task.num_turns for task in self.tasks):
            raise ValueError(f"max_turns={max_turns} is below the tasks' number of turns")
        self.invalid_penalty = invalid_penalty
        self.max_turns = max_turns
        self.template = template or ReActTemplate()
        self.brief = brief
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS)
        self.action_space = UnicodeText(MAX_ACTION_CHARS)
        self.task: BanditTask | None = None
        self._choices: list[int] = []
        self._turns_taken = 0
        self._invalid = 0
        self._paid = 0.0  # the per-turn rewards paid so far (turn_rewards)
        self._done = False
        self._messages: list[dict[str, Any]] = []

    @property
    def tools(self) -> bool:
        return self.action_format == "tools"

    # -- text ---------------------------------------------------------------------------
    def system_prompt(self) -> str:
        if self.brief:
            # Half the context of the full prompt (107 vs 215 tokens at step 2 of an easy task):
            # CPU training cost grows with it.
            if self.tools:
                return f"You are playing TurnBandit. At each step, call the `{TOOL_NAME}` tool with the letter of one option."
            return "You are playing TurnBandit. At each step, answer with only the letter of one option."
        if self.tools:
            action_format = (f"After your reasoning, call the `{TOOL_NAME}` tool exactly once with the letter of your "
                             f"option, for example:\n<think>B looks promising.</think>\n"
                             f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {{"label": "B"}}}}\n</tool_call>')
        else:
            action_format = ("After your reasoning, write only the letter of your option, for example:\n"
                             "<think>B looks promising.</think>\nB")
        return self.template.system_prompt(
            role="You are playing TurnBandit, a game of a few steps. At each step you choose one option. "
            "A single team reward between 0 and 1 is revealed only after the last step.",
            protocol="Each step lists options labelled A, B, ... Choose exactly one per step. "
            "An answer that names no listed option wastes the step and lowers the reward."
            + (" One option of each step stops the game there, with that step's reward." if self.variant == "stopping" else ""),
            action_format=action_format,
        )

    def _answer_hint(self) -> str:
        return f"Call `{TOOL_NAME}` with one letter" if self.tools else "Answer with one letter"

    def _step_text(self) -> str:
        assert self.task is not None
        t = len(self._choices)
        instruction = f" {self.task.instructions[t]}" if self.task.instructions else ""
        lines = [f"Step {t + 1} of {self.task.num_turns}.{instruction} Options:"]
        lines += [f"{LABELS[k]}) {text}" for k, text in enumerate(self.task.options[t])]
        lines.append(f"{self._answer_hint()}.")
        return "\n".join(lines)

    # -- gym API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task_id = task_id_option(options)
        if task_id is None:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        elif task_id in self.task_index:
            self.task = self.tasks[self.task_index[task_id]]
        else:
            raise ValueError(f"unknown TurnBandit task_id {task_id!r}; ids look like {self.tasks[0].task_id!r}")
        self._choices, self._turns_taken, self._invalid, self._done, self._paid = [], 0, 0, False, 0.0
        system = self.system_prompt()
        first = f"Task {self.task.task_id}. {self.task.goal}\n{self._step_text()}"
        self._messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        # Text-only agents see the tool in the observation; chat agents get it from info["tools"].
        shown = f"{system}\n\n# Tools\n{json.dumps(TOOLS[0])}" if self.tools else system
        return f"{shown}\n\n{first}", self._info(turn=0, action_error="")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None or self._done:
            raise RuntimeError("call reset() before step(), and again after the episode ends")
        self._turns_taken += 1
        text = action if isinstance(action, str) else ""
        choice, problem, call = None, "", None
        options = self.task.options[len(self._choices)]
        if not isinstance(action, str):
            problem = f"the action must be a string, got {type(action).__name__}"
        elif len(action) > MAX_ACTION_CHARS:
            problem = f"the response is {len(action)} characters long (limit {MAX_ACTION_CHARS})"
        elif self.tools:
            choice, problem, call = self._tool_choice(action, options)
        else:
            parsed = self.template.parse(action)
            if not parsed.think_closed:
                problem = "the <think> block was never closed"
            else:
                choice = _capital_choice(parsed.action) if self.task.kind == "capital" else parse_choice(parsed.action, options)
                if choice is None:
                    problem = f"{_shown(parsed.action)} names none of the options"
        if call is not None:
            self._messages.append(call)
        else:
            # valid_unicode: the history leaves the env (and reaches a tokenizer) as valid Unicode.
            self._messages.append({"role": "assistant", "content": valid_unicode(self.template.history_content(text[:MAX_ACTION_CHARS]))})

        reward, terminated, truncated = 0.0, False, False
        if choice is None:
            self._invalid += 1
            labels = ", ".join(LABELS[: self.task.num_options])
            observation = f"Invalid action: {problem}. {self._answer_hint()} among {labels}.\n{self._step_text()}"
        else:
            self._choices.append(choice)
            if self.task.ends(self._choices):
                terminated = True
                reward = max(0.0, self.task.reward(self._choices) - self.invalid_penalty * self._invalid)
                stopped = " (stop)" if self.task.stops and choice == self.task.stops[len(self._choices) - 1] else ""
                observation = f"You chose {LABELS[choice]}{stopped}. The game is over. Team reward: {reward:.3f}."
            else:
                observation = f"You chose {LABELS[choice]}.\n{self._step_text()}"
        if not terminated and self._turns_taken >= self.max_turns:
            truncated = True
            observation += f"\nTurn limit ({self.max_turns}) reached before the last step. Team reward: 0.000."
        self._done = terminated or truncated
        paid = self._paid
        if self.turn_rewards:
            # This turn's share (`BanditTask.turn_rewards`); the last step pays the rest, so the shares add
            # up to the episode's reward (penalties and a truncation's 0 included).
            if terminated or truncated:
                share = reward - paid
            elif choice is not None:
                before = self.task.uniform_value(self._choices[:-1]) if len(self._choices) > 1 else 0.0
                share = self.task.uniform_value(self._choices) - before
            else:
                share = 0.0
            self._paid = paid + share
        # A call of the tool gets the tool's result; anything else a user message.
        self._messages.append(tool_message(TOOL_NAME, observation) if call is not None else {"role": "user", "content": observation})
        info = self._info(turn=self._turns_taken, action_error=problem)
        if self.turn_rewards:
            info["turn_reward"] = float(self._paid - paid)
        return observation, reward, terminated, truncated, info

    def _tool_choice(self, action: str, options: Sequence[str]) -> tuple[int | None, str, dict[str, Any] | None]:
        """(choice, problem, assistant message with the call) of a tools-format response; the message
        is None when the response holds no single valid call of the tool."""
        parsed = parse_tool_response(action, TOOLS, parser=self.tool_parser, template=self.template,
                                     max_chars=MAX_ACTION_CHARS)
        if parsed.error:
            return None, parsed.error, None
        if not parsed.calls:
            return None, f"the response calls no tool; call `{TOOL_NAME}` with the letter of one option", None
        if len(parsed.calls) > 1:
            return None, f"the response makes {len(parsed.calls)} tool calls; call `{TOOL_NAME}` exactly once", None
        message = assistant_message(valid_unicode(self.template.history_content(parsed.content)), parsed.calls)
        label = parsed.calls[0].arguments["label"]
        if _UNPRINTABLE.search(label):  # JSON escapes can smuggle in what the text checks refuse
            return None, "the label contains binary data (control characters or lone surrogates)", None
        choice = _capital_choice(label) if self.task.kind == "capital" else parse_choice(label, options)
        return choice, "" if choice is not None else f"{TOOL_NAME}(label={_shown(label)}) names none of the options", message

    def _info(self, turn: int, action_error: str) -> dict[str, Any]:
        # One type per key in every step (vector envs batch info per key): "" means no error.
        assert self.task is not None
        optimal = self.task.optimal_value
        complete = bool(self._choices) and self.task.ends(self._choices)
        success = complete and self._invalid == 0 and self.task.reward(self._choices) >= optimal
        return {
            "task_id": self.task.task_id,
            "category": self.task.kind,
            "turn": turn,
            "messages": [dict(m) for m in self._messages],
            "success": bool(success),
            "choices": "".join(LABELS[c] for c in self._choices),
            "invalid_actions": self._invalid,
            "invalid_action": bool(action_error),
            "action_error": action_error,
            "optimal_value": optimal,
            "tools": list(TOOLS) if self.tools else [],
            "tool_parser": self.tool_parser if self.tools else "",
        }


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")
