"""`seeupo/BFCL-v4-v0`: BFCL v4 multi-turn as a sequence-level Gymnasium env.

Episode = one BFCL entry; one step = one model response.

- A response with calls (see `seeupo_gym.bfcl.calls` for the format) has them run on the
  episode's own backends; the observation lists each call with its result.
- A plain-text response ends the current user turn; the observation is the next user
  message (on miss_func's reveal turns: the newly available functions). After the last user
  turn the episode terminates and is scored as BFCL's `multi_turn_checker` scores it (our
  replay of the calls that ran, bfcl-eval's own state and response comparisons; see
  `seeupo_gym.bfcl.backend.check_episode`): reward 1.0 iff every user turn passes its state and
  response checks, else 0.0. No text the model wrote is ever `eval`ed, in either format.
- Any other response (empty, too long, binary, malformed or unsafe call list, unknown
  function) is an error: nothing runs, the observation says why, the turn goes on, and the
  response still counts toward `max_turns`.
- `max_turns` bounds the responses of the whole episode (the paper uses 10). Reaching it
  before the last user turn ends truncates the episode with reward 0.0, as BFCL fails
  force-terminated entries.
- Time: every argument is bounded at parse time (`calls.MAX_INT_DIGITS`, `max_action_chars`,
  `backend.ARGUMENT_BOUNDS`), which makes each call cheap; a response's calls start only within
  `call_seconds_per_step` of wall time, the rest are reported as not run. The checker replays
  only the calls that ran, so its cost is bounded by theirs.
- `action_format="tools"`: native tool calling instead of the ReAct call list. The entry's
  functions are published as JSON schemas (`info["tools"]`, fixed for the episode; the system
  message leaves them to the chat template's `tools=`), the response's tool calls are read by a
  parser from `seeupo_gym.tools` (`tool_parser`, default "hermes": `<tool_call>{json}</tool_call>`)
  and checked (known function, known argument names, bounded values; types are left to the
  backend, as in BFCL), and each result comes back as a `tool` message. A response
  without a tool call ends the user turn; miss_func's reveals list the new schemas in the user
  message. Scoring is the same checker on the same calls.
- Every `info` key has one type at reset and in every step ("" / [] / {} when there is nothing
  to say), because vector envs batch `info` per key.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import gymnasium as gym

from seeupo_gym.bfcl.backend import CheckResult, EpisodeBackend, check_episode
from seeupo_gym.bfcl.calls import MAX_INT_DIGITS, ActionError, Call, DecodedResponse, decode_response, parse_call_list
from seeupo_gym.bfcl.data import CATEGORIES, SPLITS, Entry, FunctionDoc, function_docs, get_entry, task_ids
from seeupo_gym.bfcl.prompt import reveal_message, system_prompt, tool_schema, tools_reveal_message, tools_system_prompt
from seeupo_gym.options import task_id_option
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.templates import ReActTemplate
from seeupo_gym.text import valid_unicode, valid_unicode_tree
from seeupo_gym.tools import ParsedTools, assistant_message, parse_tool_response, render_tool_calls, tool_message
from seeupo_gym.tools import tool_parser as find_tool_parser

ACTION_FORMATS = ("react", "tools")

FINAL_OBSERVATION = "The conversation is over."


class BFCLEnv(gym.Env[str, str]):
    """BFCL v4 multi-turn (base, miss_func, miss_param, long_context) over bfcl-eval's real data.

    Args:
        categories: BFCL categories to draw tasks from (a name or a list of names).
        split: "train", "test" (the fixed ids in `seeupo_gym/bfcl/split.json`) or "all"; "paper-train" /
            "paper-test": the SeeUPO paper's split of base (entries 0-99 / 100-199, `data.PAPER_SPLIT`).
        max_turns: responses per episode before truncation.
        keep_think: whether earlier responses keep their `<think>` block in `info["messages"]`.
        template: the ReAct template (overrides keep_think when given).
        max_action_chars: longer responses are refused (error observation).
        max_observation_chars: longer observations are cut, with a note saying how much.
        max_calls_per_response: a response with more calls is refused.
        call_seconds_per_step: wall time in which a response's calls may start; later ones do not run.
        action_format: "react" (the call list after `<think>`, the default) or "tools" (native tool calls).
        tool_parser: with "tools", the registered parser that reads the calls (see `seeupo_gym.tools`).
    """

    metadata = {"render_modes": []}
    # A response without a call ends the user turn (tool doors offer it as an `end_turn` tool).
    plain_text_ends_turn = True

    def __init__(
        self,
        categories: str | Sequence[str] = ("base",),
        split: str = "train",
        max_turns: int = 10,
        keep_think: bool = True,
        template: ReActTemplate | None = None,
        max_action_chars: int = 32_768,
        max_observation_chars: int = 200_000,
        max_calls_per_response: int = 64,
        call_seconds_per_step: float = 5.0,
        action_format: str = "react",
        tool_parser: str = "hermes",
    ) -> None:
        chosen = (categories,) if isinstance(categories, str) else tuple(categories)
        unknown = [category for category in chosen if category not in CATEGORIES]
        if not chosen or unknown:
            raise ValueError(f"categories must be a non-empty subset of {list(CATEGORIES)}, got {list(chosen)}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if not call_seconds_per_step >= 0:
            raise ValueError(f"call_seconds_per_step must be >= 0, got {call_seconds_per_step}")
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {list(ACTION_FORMATS)}, got {action_format!r}")
        find_tool_parser(tool_parser)  # an unknown parser name is a clear error here
        self.action_format = action_format
        self.tool_parser = tool_parser
        self.categories = chosen
        self.split = split
        self.max_turns = max_turns
        self.template = template if template is not None else ReActTemplate(keep_think=keep_think)
        self.max_action_chars = max_action_chars
        self.max_observation_chars = max_observation_chars
        self.max_calls_per_response = max_calls_per_response
        self.call_seconds_per_step = call_seconds_per_step
        self.task_ids: tuple[str, ...] = tuple(task_ids(chosen, split))
        self.observation_space = UnicodeText(max_observation_chars)
        self.action_space = UnicodeText(max_action_chars)

        self._order: list[str] = []
        self._entry: Entry | None = None
        self._tools: list[dict[str, Any]] = []
        self._callable_tools: list[dict[str, Any]] = []
        self._backend: EpisodeBackend | None = None
        self._done = True

    # ------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: `options={"task_id": ...}` picks any BFCL v4 multi-turn id (also outside
        the env's split); otherwise the next id of a seeded shuffle of the split, each id once per pass."""
        super().reset(seed=seed)
        if seed is not None:
            self._order = []  # same seed, same task order
        task_id = task_id_option(options)
        entry = get_entry(task_id) if task_id is not None else get_entry(self._next_task_id())

        self._backend = None  # release the previous episode's state before building the next
        self._entry = entry
        self._backend = EpisodeBackend(entry)
        self._user_turn = 0
        self._turn = 0
        self._done = False
        self._calls_per_turn: list[list[tuple[Call, ...]]] = [[] for _ in range(entry.num_user_turns)]
        held_back = {name for names in entry.revealed_functions.values() for name in names}
        self._visible: dict[str, FunctionDoc] = {
            doc.name: doc
            for class_name in entry.involved_classes
            for doc in function_docs()[class_name]
            if doc.name not in held_back
        }
        self._tools: list[dict[str, Any]] = []
        self._callable_tools: list[dict[str, Any]] = []
        if self.action_format == "tools":
            self._tools = [tool_schema(doc) for doc in self._visible.values()]
            # Held-back functions are callable early, as in the react format (see `_checked`).
            self._callable_tools = [
                tool_schema(doc) for class_name in entry.involved_classes for doc in function_docs()[class_name]
            ]
            system = tools_system_prompt(self.template, self.max_turns)
            shown = system + "\n\n# Tools\n" + "\n".join(json.dumps(tool) for tool in self._tools)
        else:
            system = shown = system_prompt(self.template, self._visible.values(), self.max_turns)
        first = self._open_user_turn()
        self._messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        return self._clip(shown + "\n\n" + first), self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._entry is None or self._backend is None or self._done:
            raise RuntimeError("the episode is over (or never started): call reset() first")
        entry, backend = self._entry, self._backend
        self._turn += 1
        # Not repr(action): an arbitrary object's repr may be huge or raise.
        text = action if isinstance(action, str) else f"<not a string: {type(action).__name__}>"
        parsed: ParsedTools | None = None
        if self.action_format == "tools":
            parsed = parse_tool_response(
                action, self._callable_tools, parser=self.tool_parser, template=self.template,
                max_chars=self.max_action_chars, max_calls=self.max_calls_per_response, max_int_digits=MAX_INT_DIGITS,
                # As in BFCL (and the react format), argument types go to the backend as written
                # and its own error comes back: the ground truth itself passes a string ticket_id
                # to an integer parameter, and the checker compares against that. Argument names
                # are checked against the function's parameters with the react format's calls.
                check_arguments=False,
            )
            decoded = _decoded_tools(parsed)
        else:
            decoded = decode_response(
                action, self.template, max_chars=self.max_action_chars, max_calls=self.max_calls_per_response
            )
        if decoded.kind == "calls":
            decoded = self._checked(decoded, backend)
        if parsed is not None and decoded.kind == "calls":
            content = self.template.history_content(self._clip_action(parsed.content))
            self._messages.append(valid_unicode_tree(assistant_message(content, parsed.calls)))
        else:
            self._messages.append({"role": "assistant", "content": valid_unicode(self.template.history_content(self._clip_action(text)))})

        terminated = False
        reward = 0.0
        executed: list[str] = []
        check: CheckResult | None = None
        action_error = decoded.error or ""
        if decoded.kind == "calls":
            results = backend.execute_within(decoded.calls, self.call_seconds_per_step)
            ran = decoded.calls[: len(results)]
            executed = [call.source for call in ran]
            self._calls_per_turn[self._user_turn].append(ran)
            observation = _results_observation(decoded.calls, results, backend.stop_reason)
            if parsed is not None:
                tool_messages = [
                    tool_message(call.name, self._clip(results[index] if index < len(results) else f"not run: {backend.stop_reason}"))
                    for index, call in enumerate(decoded.calls)
                ]
            if len(results) < len(decoded.calls):
                action_error = (
                    f"{len(decoded.calls) - len(results)} of {len(decoded.calls)} calls did not run: {backend.stop_reason}"
                )
        elif decoded.kind == "turn_end":
            self._user_turn += 1
            if self._user_turn == entry.num_user_turns:
                terminated = True
                check = check_episode(entry, self._calls_per_turn)
                reward = 1.0 if check.valid else 0.0
                observation = FINAL_OBSERVATION
            else:
                observation = self._open_user_turn()
        elif parsed is not None:
            observation = (
                f"Error: {decoded.error}. Nothing was run and your turn goes on. Call the functions with the "
                "tool-calling format, or reply in plain text with no tool call to end your turn."
            )
        else:
            observation = (
                f"Error: {decoded.error}. Nothing was run and your turn goes on. Write a call list like "
                "[func_name(param=value)], or reply in plain text to end your turn."
            )
        truncated = not terminated and self._turn >= self.max_turns
        if truncated:
            check = CheckResult(
                valid=False,
                error_type="multi_turn:force_terminated",
                error_message=f"the episode reached max_turns={self.max_turns} responses before the last user turn ended",
                turn_results=["not_checked"] * entry.num_user_turns,
            )
        self._done = terminated or truncated
        # Model text (JSON escapes, names quoted in errors) may hold lone surrogates: none leave.
        observation = valid_unicode(self._clip(observation))
        action_error = valid_unicode(action_error)
        if not terminated and parsed is not None and decoded.kind == "calls":
            self._messages.extend(tool_messages)
        elif not terminated:
            self._messages.append({"role": "user", "content": observation})
        info = self._info(decoded.kind, action_error, executed, check)
        return observation, reward, terminated, truncated, info

    def close(self) -> None:
        self._backend = None
        self._entry = None
        self._done = True
        super().close()

    # ------------------------------------------------------------------ helpers

    @property
    def calls_per_turn(self) -> list[list[list[str]]]:
        """The calls that ran, as bfcl-eval's result files hold them: per user turn that ended, per
        response, the call strings (rebuilt from validated values, never the model's text), every
        argument by name (bfcl's decoder drops positional ones). A turn still open (a truncated
        episode) is left out, as BFCL's inference leaves out a turn it force-terminated."""
        backend = self._backend
        assert backend is not None
        return [[[backend.named(call).source for call in calls] for calls in turn] for turn in self._calls_per_turn[: self._user_turn]]

    @property
    def visible_tools(self) -> list[dict[str, Any]]:
        """In the tools format, the schemas of the functions shown so far: the system message's, then
        each miss_func reveal's (for tool doors that list tools, as MCP does)."""
        if self.action_format != "tools":
            return []
        return [tool_schema(doc) for doc in self._visible.values()] if self._entry is not None else []

    @property
    def entry(self) -> Entry | None:
        """The current episode's BFCL entry (with its ground truth: for scripted agents and tests)."""
        return self._entry

    def _next_task_id(self) -> str:
        if not self._order:
            self._order = [self.task_ids[index] for index in self.np_random.permutation(len(self.task_ids))]
        return self._order.pop(0)

    def _open_user_turn(self) -> str:
        """The message that opens the current user turn; reveals held-back functions first."""
        entry = self._entry
        assert entry is not None
        revealed = entry.revealed_functions.get(self._user_turn, ())
        if revealed:
            docs = {doc.name: doc for class_name in entry.involved_classes for doc in function_docs()[class_name]}
            new_docs = [docs[name] for name in revealed if name in docs]
            self._visible.update((doc.name, doc) for doc in new_docs)
            message = tools_reveal_message(new_docs) if self.action_format == "tools" else reveal_message(new_docs)
            user_text = entry.user_messages[self._user_turn]
            return f"{message}\n\n{user_text}" if user_text else message
        return entry.user_messages[self._user_turn]

    def _checked(self, decoded: DecodedResponse, backend: EpisodeBackend) -> DecodedResponse:
        """Refuse the whole response if any call is not a public method of the entry's backends or
        is over a resource bound. Held-back miss_func functions are callable before they are
        revealed, as in BFCL (whose ground truth sometimes calls them early)."""
        try:
            for call in decoded.calls:
                backend.check_call(call)
        except ActionError as error:
            return DecodedResponse("error", error=str(error), thought=decoded.thought)
        return decoded

    def _clip(self, text: str) -> str:
        limit = self.max_observation_chars
        if len(text) <= limit:
            return text
        note = f"\n... [cut: {len(text)} characters in all]"
        return text[: limit - len(note)] + note

    def _clip_action(self, text: str) -> str:
        limit = self.max_action_chars
        if len(text) <= limit:
            return text
        return text[:limit] + f"\n... [response cut: {len(text)} characters in all]"

    def _info(
        self,
        action_kind: str = "",
        action_error: str = "",
        executed: list[str] | None = None,
        check: CheckResult | None = None,
    ) -> dict[str, Any]:
        entry = self._entry
        assert entry is not None
        check = check or CheckResult(valid=False)
        return {
            "task_id": entry.id,
            "category": entry.category,
            "turn": self._turn,
            "user_turn": self._user_turn,
            "num_user_turns": entry.num_user_turns,
            "messages": [dict(message) for message in self._messages],
            # The tools of the system message in the tools format (JSON schemas for `apply_chat_template(tools=)`).
            "tools": list(self._tools),
            "tool_parser": self.tool_parser if self.action_format == "tools" else "",
            "success": check.valid,
            "action_kind": action_kind,  # "calls", "turn_end", "error"; "" after reset
            "action_error": action_error,
            "calls": list(executed or []),
            # The checker's verdict, filled in at the end of the episode.
            "turn_results": list(check.turn_results),
            "error_type": check.error_type or "",
            "error_message": check.error_message or "",
            "check_details": dict(check.details),
        }


def _decoded_tools(parsed: ParsedTools) -> DecodedResponse:
    """A tools-format response as the react decoder would classify it: the same `Call`s (JSON
    arguments as keyword arguments), so execution and scoring are shared."""
    if parsed.error:
        return DecodedResponse("error", error=parsed.error, thought=parsed.thought)
    if not parsed.calls:
        return DecodedResponse("turn_end", text=parsed.content, thought=parsed.thought)
    calls = tuple(Call(name=call.name, kwargs=tuple(call.arguments.items())) for call in parsed.calls)
    return DecodedResponse("calls", calls=calls, thought=parsed.thought)


def render_tool_action(calls: Sequence[str], thought: str = "") -> str:
    """A tools-format response (hermes `<tool_call>` blocks) making these BFCL calls, e.g.
    render_tool_action(["cd(folder='docs')", "ls()"]); positional arguments get their parameter
    names from BFCL's function docs. For scripted agents, tests and SFT data."""
    if not calls:
        raise ValueError("render_tool_action needs at least one call; a turn ends with plain text")
    docs = {doc.name: doc for class_docs in function_docs().values() for doc in class_docs}
    named = []
    for call in parse_call_list("[" + ", ".join(call.strip() for call in calls) + "]", max_calls=max(64, len(calls))):
        doc = docs.get(call.name)
        if call.args and doc is None:
            raise ValueError(f"{call.name} is not a BFCL function, so its positional arguments have no names")
        names = list(doc.parameters.get("properties", {})) if doc is not None else []
        if len(call.args) > len(names):
            raise ValueError(f"{call.name} takes {len(names)} parameters, got {len(call.args)} positional arguments")
        arguments = dict(zip(names, call.args))
        arguments.update(call.kwargs)
        named.append((call.name, arguments))
    return ReActTemplate.render(render_tool_calls(named), thought=thought)


def _results_observation(calls: Sequence[Call], results: Sequence[str], stop_reason: str = "") -> str:
    """Each call with its result; calls past the end of `results` did not run (`stop_reason`)."""
    lines = ["Results:"]
    for index, call in enumerate(calls, start=1):
        result = results[index - 1] if index <= len(results) else f"not run: {stop_reason}"
        lines.append(f"[{index}] {call.source} -> {result}")
    return "\n".join(lines)


def _category_env(category: str, kwargs: dict[str, Any]) -> BFCLEnv:
    if "categories" in kwargs:
        raise TypeError(f"this id is fixed to category {category!r}; use seeupo/BFCL-v4-v0 to choose categories")
    return BFCLEnv(categories=(category,), **kwargs)


def make_base(**kwargs: Any) -> BFCLEnv:
    return _category_env("base", kwargs)


def make_miss_func(**kwargs: Any) -> BFCLEnv:
    return _category_env("miss_func", kwargs)


def make_miss_param(**kwargs: Any) -> BFCLEnv:
    return _category_env("miss_param", kwargs)


def make_long_context(**kwargs: Any) -> BFCLEnv:
    return _category_env("long_context", kwargs)
