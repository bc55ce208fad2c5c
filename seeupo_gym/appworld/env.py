"""`seeupo/AppWorld-v0`: AppWorld as a sequence-level Gymnasium env.

Episode = one AppWorld task; one step = one model response. The response is "think, then
act": `<think>...</think>` and one ```python code block (see `render_action`), which runs
in the task's world, in a fresh sandboxed process of the env's own AppWorld server
(`seeupo_gym.appworld.server`, `sandbox`); the observation is what the code printed (or
AppWorld's "Execution failed" traceback). The episode terminates when the agent calls
`apis.supervisor.complete_task(...)`, and is truncated after `max_turns` responses; either
way the episode's process is killed and AppWorld's evaluator, in a separate grader process,
scores its final state: reward = passed tests / total tests, `info["success"]` = all passed.

Bad responses (no code block, unclosed `<think>`, too long, binary, code that imports system
modules or reaches for `eval`/`open`/dunders: see `guard`) run nothing: the observation says
why and the response still counts as a turn (the guard is a friendly early error, not the
security boundary: the sandbox is). Code that fails gets AppWorld's own traceback. Code that
outruns the time limit in a way AppWorld cannot stop (a long C loop), or that kills its own
process, ends the episode with reward 0 and the reason in `info["termination_reason"]`.

With `action_format="tools"` (native tool calling) the env publishes one tool,
`execute_python(code)` (`TOOLS`, in `info["tools"]` for the chat template's `tools=`), and a
response acts by calling it exactly once (`<tool_call>{json}</tool_call>` with the default
"hermes" parser of `seeupo_gym.tools`); the code runs as a code block would, under the same guard,
and what it printed comes back as a `tool` message. A response without that call is an error
observation and counts as a turn. One tool running code keeps AppWorld's own interface (its
`apis` object, its docs APIs) instead of flattening its hundreds of APIs into tool schemas.

`info` keys keep one type in every step (vector envs merge them per key): `tests` is always
a dict (zeros until the episode is scored), `action_error` and `termination_reason` are
strings ("" for none), `server_pid` an int (0 for none).

This module imports nothing of `appworld`: the caller's clock never freezes.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import gymnasium as gym

from seeupo_gym.appworld.guard import refusal
from seeupo_gym.appworld.paths import MINI_SPLIT, OFFICIAL_SPLITS, find_data_dir, read_split
from seeupo_gym.appworld.sandbox import SandboxLimits
from seeupo_gym.appworld.server import AppWorldServer, ServerDied, ServerError, ServerPool, ServerTimeout
from seeupo_gym.options import task_id_option
from seeupo_gym.spaces import UnicodeText
from seeupo_gym.templates import ReActTemplate
from seeupo_gym.text import bounded, valid_unicode, valid_unicode_tree
from seeupo_gym.tools import (
    ParsedTools,
    assistant_message,
    function_schema,
    parse_tool_response,
    render_tool_calls,
    tool_message,
)
from seeupo_gym.tools import tool_parser as find_tool_parser

ACTION_FORMATS = ("react", "tools")
TOOL_NAME = "execute_python"
TOOLS = [
    function_schema(
        TOOL_NAME,
        "Run Python code in the task's persistent session (variables survive between calls) and return what "
        "it printed. The `apis` object reaches every app: apis.<app_name>.<api_name>(**parameters).",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    )
]
TOOLS_ACTION_FORMAT = (
    f"Act by calling the `{TOOL_NAME}` tool exactly once per response, with the Python code to run. It runs in a "
    "persistent Python session (variables survive between turns); what it prints comes back to you as the tool's "
    "result. Work in small steps and look at each result before you go on."
)

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

ROLE = (
    "You are a capable coding agent. You do day-to-day tasks for your supervisor by writing Python code "
    "that calls the APIs of the apps they use (e.g. Simple Note, Todoist, Venmo, Phone, Spotify, Gmail) "
    "in AppWorld, acting on your supervisor's behalf."
)
ACTION_FORMAT = (
    "Your action is exactly one Python code block:\n"
    "```python\n"
    "print(apis.api_docs.show_app_descriptions())\n"
    "```\n"
    "It runs in a persistent Python session (variables survive between turns); what it prints comes back "
    "to you as the next message. Work in small steps and look at each result before you go on."
)
PROTOCOL = """\
- Every app's APIs are on the `apis` object: `apis.<app_name>.<api_name>(**parameters)`.
- Find what you need step by step:
  `print(apis.api_docs.show_app_descriptions())` lists the apps,
  `print(apis.api_docs.show_api_descriptions(app_name='venmo'))` lists an app's APIs,
  `print(apis.api_docs.show_api_doc(app_name='venmo', api_name='login'))` shows one API's parameters and response.
- Most APIs need an `access_token`: get your supervisor's passwords with
  `apis.supervisor.show_account_passwords()`, then call `apis.<app_name>.login(username=..., password=...)`;
  the username is your supervisor's email (their phone number for the phone app).
- Results come in pages: pass `page_index` (and `page_limit`) until a page comes back empty.
- Act only on what the task asks; do not change anything else.
- When you are done call `apis.supervisor.complete_task(answer=...)` if the task asks a question (a short
  answer: a number, a name, ...), else `apis.supervisor.complete_task()`. The episode ends with that call.
- You have at most {max_turns} responses. Modules that reach the system (os, sys, subprocess, ...) are blocked."""
FIRST_MESSAGE = """\
Using these APIs, write code to solve the actual task.

My name is {first_name} {last_name}. My personal email address is {email} and my phone number is {phone_number}.
Task: {instruction}"""


def render_action(code: str, thought: str = "") -> str:
    """A response the env runs `code` from: `<think>thought</think>` then one ```python block."""
    return ReActTemplate.render(f"```python\n{code.strip()}\n```", thought=thought)


def render_tool_action(code: str, thought: str = "") -> str:
    """A tools-format response that runs `code` through the `execute_python` tool."""
    return ReActTemplate.render(render_tool_calls([(TOOL_NAME, {"code": code.strip()})]), thought=thought)


def extract_code(response: str, template: ReActTemplate) -> tuple[str | None, str | None]:
    """(code, None) for a well-formed response, else (None, why not)."""
    parsed = template.parse(response)
    if not parsed.think_closed:
        return None, "your response opened <think> and never closed it, so it has no action"
    match = _CODE_BLOCK.search(parsed.action)
    if match is None:
        return None, "your response has no ```python code block"
    return checked_code(match.group(1))


def extract_tool_code(parsed: ParsedTools) -> tuple[str | None, str | None]:
    """(code, None) for a tools-format response that calls `execute_python` once, else (None, why not)."""
    if parsed.error:
        return None, parsed.error
    if not parsed.calls:
        return None, f"your response calls no tool; call `{TOOL_NAME}` with the code to run"
    if len(parsed.calls) > 1:
        return None, f"your response calls {len(parsed.calls)} tools; call `{TOOL_NAME}` exactly once per response"
    return checked_code(parsed.calls[0].arguments["code"])


def checked_code(code: str) -> tuple[str | None, str | None]:
    code = code.strip()
    if not code:
        return None, "your code block is empty"
    if "\x00" in code:
        return None, "your code contains NUL bytes (binary data)"
    try:
        code.encode("utf-8")
    except UnicodeEncodeError:
        return None, "your code is not valid Unicode text (it has lone surrogate characters)"
    why = refusal(code)
    if why is not None:
        return None, f"your code was refused: {why}"
    return code, None


class AppWorldEnv(gym.Env[str, str]):
    """AppWorld tasks (mini or official splits), each world on an AppWorld server process.

    Args:
        split: "mini" (built offline by this project) or an official split (train, dev,
            test_normal, test_challenge; needs `data_dir` or `$SEEUPO_APPWORLD_DATA`).
        max_turns: responses per episode before truncation.
        data_dir: the AppWorld `data` folder to serve (default: see `seeupo_gym.appworld.paths`).
        python: the AppWorld interpreter (default: `$SEEUPO_APPWORLD_PYTHON`, the checkout's
            `.venv-appworld`, or the managed venv of `python -m seeupo_gym.appworld.setup`).
        server_pool: a `ServerPool` to take the server from and give it back to at `close()`
            (reuses warm servers across envs); by default the env starts its own and kills it
            at `close()`.
        timeout_seconds: AppWorld's own limit on one code execution.
        response_grace_s: extra seconds the env waits beyond `timeout_seconds` before it
            declares the server stuck and kills it.
        keep_think / template: as in the other envs (`seeupo_gym.templates`).
        action_format: "react" (a ```python block after `<think>`, the default) or "tools" (the
            `execute_python` tool, see the module docstring).
        tool_parser: with "tools", the registered parser that reads the call (see `seeupo_gym.tools`).
        max_action_chars: longer responses are refused (error observation).
        max_output_chars: longer execution outputs are cut, with a note.
        startup_timeout: seconds to wait for a server to come up.
        recycle_after: episodes after which an env's server is restarted.
        sandbox: "auto" (default): "gvisor" where runsc runs here, else "bwrap" with a one-line
            warning naming what stays open. "gvisor": model code runs in a gVisor sandbox, a
            kernel of its own, and each episode in a sandbox no earlier episode ran in (started
            ahead, off the reset's path; see `seeupo_gym.appworld.sandbox` and docs/envs.md for
            the cost). "bwrap": in a bubblewrap sandbox (namespaces of the host's kernel, whose
            global counters every sandbox shares: a channel between episodes). A machine that
            cannot run the one named gets an error naming what is missing. "none": no sandbox,
            model code runs as you and can reach your files, network and the grader: unsafe for
            training, for debugging only. From the trainer's config only, never from a data row.
        limits: rlimits of each episode's process and the memory of its sandbox (`SandboxLimits`,
            or its fields as a dict, e.g. `{"exclusive_steps": true}` from a config: the steps of
            concurrent sandboxes one at a time).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        split: str = MINI_SPLIT,
        max_turns: int = 10,
        data_dir: str | os.PathLike[str] | None = None,
        python: str | os.PathLike[str] | None = None,
        server_pool: ServerPool | None = None,
        timeout_seconds: int = 10,
        response_grace_s: float = 10.0,
        keep_think: bool = True,
        template: ReActTemplate | None = None,
        max_action_chars: int = 32_768,
        max_output_chars: int = 20_000,
        startup_timeout: float = 180.0,
        recycle_after: int = 300,
        sandbox: str = "auto",
        limits: SandboxLimits | dict[str, Any] | None = None,
        action_format: str = "react",
        tool_parser: str = "hermes",
    ) -> None:
        if split != MINI_SPLIT and split not in OFFICIAL_SPLITS:
            raise ValueError(f"split must be {MINI_SPLIT!r} or one of {list(OFFICIAL_SPLITS)}, got {split!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if timeout_seconds < 1:
            raise ValueError(f"timeout_seconds must be at least 1, got {timeout_seconds}")
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {list(ACTION_FORMATS)}, got {action_format!r}")
        find_tool_parser(tool_parser)  # an unknown parser name is a clear error here
        if isinstance(limits, dict):  # from a config's env.kwargs
            limits = SandboxLimits(**limits)
        self.action_format = action_format
        self.tool_parser = tool_parser
        self.split = split
        self.max_turns = max_turns
        self.timeout_seconds = int(timeout_seconds)
        self.response_grace_s = response_grace_s
        self.template = template if template is not None else ReActTemplate(keep_think=keep_think)
        self.max_action_chars = max_action_chars
        self.max_output_chars = max_output_chars
        if server_pool is not None:
            if data_dir is not None and find_data_dir(split, data_dir) != server_pool.data_dir:
                raise ValueError(f"data_dir {data_dir} differs from the server pool's {server_pool.data_dir}")
            self.data_dir = server_pool.data_dir
            read_split(self.data_dir, split)  # the pool's data must hold this split
            self._pool, self._owns_pool = server_pool, False
        else:
            self.data_dir = find_data_dir(split, data_dir)
            self._pool = ServerPool(self.data_dir, python, startup_timeout=startup_timeout, recycle_after=recycle_after,
                                    sandbox=sandbox, limits=limits)
            self._owns_pool = True
        self.task_ids: tuple[str, ...] = tuple(read_split(self.data_dir, split))
        self.observation_space = UnicodeText(max(200_000, 4 * max_output_chars))
        self.action_space = UnicodeText(max_action_chars)

        self._server: AppWorldServer | None = None
        self._task_id: str | None = None
        self._messages: list[dict[str, str]] = []
        self._turn = 0
        self._completion_named = False
        self._done = True

    # ------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task_id = task_id_option(options)
        if task_id is None:
            task_id = self.task_ids[int(self.np_random.integers(len(self.task_ids)))]
        elif not (self.data_dir / "tasks" / task_id / "specs.json").is_file():
            raise ValueError(f"unknown AppWorld task {task_id!r}: no {self.data_dir}/tasks/{task_id}/specs.json")

        self._done = True
        task = self._open_world(task_id)
        self._task_id = task_id
        self._completion_named = False
        self._turn = 0
        self._done = False
        tools = self.action_format == "tools"
        system = self.template.system_prompt(
            role=ROLE, protocol=PROTOCOL.format(max_turns=self.max_turns),
            action_format=TOOLS_ACTION_FORMAT if tools else ACTION_FORMAT,
        )
        shown = system + "\n\n# Tools\n" + json.dumps(TOOLS[0]) if tools else system
        supervisor = task["supervisor"]
        first = FIRST_MESSAGE.format(instruction=task["instruction"], **supervisor)
        self._messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        return shown + "\n\n" + first, self._info(success=False)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done or self._server is None or self._task_id is None:
            raise RuntimeError("the episode is over (or never started): call reset() first")
        self._turn += 1
        text = action if isinstance(action, str) else repr(action)
        parsed = ParsedTools(content="")
        if not isinstance(action, str):
            code, error = None, f"the action must be a string, got {type(action).__name__}"
        elif len(text) > self.max_action_chars:
            code, error = None, f"your response has {len(text)} characters, over the limit of {self.max_action_chars}"
        elif self.action_format == "tools":
            parsed = parse_tool_response(action, TOOLS, parser=self.tool_parser, template=self.template,
                                         max_chars=self.max_action_chars)
            code, error = extract_tool_code(parsed)
        else:
            code, error = extract_code(action, self.template)
        if len(text) > self.max_action_chars:
            text = text[: self.max_action_chars] + f"\n... [response cut: {len(text)} characters in all]"
        as_tool = self.action_format == "tools" and code is not None
        # Tool names, argument names and values come back in errors and history as the model
        # wrote them: a JSON escape such as "\ud800" is a lone surrogate, escaped here.
        if as_tool:
            self._messages.append(valid_unicode_tree(
                assistant_message(self.template.history_content(parsed.content), parsed.calls)))
        else:
            self._messages.append({"role": "assistant", "content": valid_unicode(self.template.history_content(text))})

        reward, terminated, success = 0.0, False, False
        report: dict[str, Any] | ServerError | None = None
        tests = _no_tests()
        termination_reason = ""
        if code is None and self.action_format == "tools":
            observation = f"Error: {error}. Nothing was run. Call `{TOOL_NAME}` once with the code to run."
        elif code is None:
            observation = f"Error: {error}. Nothing was run. Write one ```python code block after your </think>."
        else:
            try:
                observation = self._clip(self._server.execute(
                    code, timeout=self.timeout_seconds + self.response_grace_s, max_chars=4 * self.max_output_chars
                ))
                # Saves a round trip per step: with the guard's rules (no dunders, literal getattr
                # names) the task can only be completed by code that names `complete_task`.
                self._completion_named = self._completion_named or "complete_task" in code
                if self._completion_named and self._server.task_completed(timeout=60.0):
                    # The episode's process says so; the grader decides on the state it left.
                    report = self._grade_claim()
                    terminated = report is not None
            except ServerError as failure:  # the episode's world reported an error and lives on
                error = f"the environment could not run this code: {failure}"
                observation = f"Error: {error}."
            except (ServerDied, ServerTimeout) as failure:
                termination_reason = f"{type(failure).__name__}: {failure}"
                error = termination_reason
                observation = f"Error: your code stopped the environment ({failure}). The episode is over."
                terminated = True
        observation = valid_unicode(observation)
        truncated = not terminated and self._turn >= self.max_turns
        if (terminated or truncated) and not termination_reason:
            reward, success, tests, termination_reason = self._evaluate(terminated, report)
        self._done = terminated or truncated
        if not self._done and as_tool:
            self._messages.append(tool_message(TOOL_NAME, observation))
        elif not self._done:
            self._messages.append({"role": "user", "content": observation})
        info = self._info(success=success, action_error=error, tests=tests, termination_reason=termination_reason)
        return observation, reward, terminated, truncated, info

    def close(self) -> None:
        self._done = True
        if self._server is not None:
            self._pool.release(self._server)
            self._server = None
        if self._owns_pool:
            self._pool.shutdown()
        super().close()

    # ------------------------------------------------------------------ helpers

    @property
    def server(self) -> AppWorldServer | None:
        """The server this env's worlds run on (None before the first reset and after close)."""
        return self._server

    def _open_world(self, task_id: str) -> dict[str, Any]:
        """Open the task's world in a fresh episode process; a failed server is restarted once."""
        for attempt in range(2):
            if self._server is None:
                self._server = self._pool.acquire()
            else:
                self._pool.prepare(self._server)
            server = self._server
            try:
                task = server.open_episode(task_id, timeout_seconds=self.timeout_seconds,
                                           max_interactions=self.max_turns + 1)
            except (ServerDied, ServerTimeout):
                server.kill()  # replaced, never reused
                if attempt == 1:
                    raise
                continue
            except ServerError as failure:
                try:
                    server.close_episode(collect=False)
                except (ServerDied, ServerTimeout, ServerError):
                    server.kill()  # restarted at the next reset
                raise ServerError(f"AppWorld could not open task {task_id!r}: {failure}") from failure
            return task
        raise AssertionError("unreachable")

    def _grade_claim(self) -> dict[str, Any] | ServerError | None:
        """The grader's report on the episode's state as it is now, if that state holds a
        completed task; the error if the grader refused that state (the episode then ends with
        reward 0); None (the episode goes on) if the state holds no completed task."""
        assert self._server is not None and self._task_id is not None
        try:
            report = self._server.grade(self._task_id, self._server.episode_state(), timeout=30.0)
        except ServerError as failure:
            return failure
        return report if isinstance(report, dict) and report.get("completed") is True else None

    def _evaluate(
        self, completed: bool, report: dict[str, Any] | ServerError | None = None
    ) -> tuple[float, bool, dict[str, Any], str]:
        """Score the episode's final state in the grader (the episode's process is killed first);
        `report`: the grader's report on that state (or its refusal), already made."""
        reason = "completed" if completed else "max_turns"
        assert self._server is not None and self._task_id is not None
        try:
            state = self._server.close_episode(collect=report is None)
            if isinstance(report, ServerError):
                raise report
            if report is None:
                report = self._server.grade(self._task_id, state or {}, timeout=30.0)
        except (ServerDied, ServerTimeout, ServerError) as failure:
            self._server.kill()
            return 0.0, False, _no_tests(), f"{reason}; evaluation failed: {type(failure).__name__}: {failure}"
        try:
            passed, total = len(report["passes"]), int(report["num_tests"])
            failed = [bounded(failure["requirement"], 500) for failure in report["failures"][:100]]
            success = report["success"] is True
        except (KeyError, TypeError, ValueError) as failure:
            self._server.kill()
            return 0.0, False, _no_tests(), f"{reason}; evaluation failed: malformed report ({failure!r})"[:2000]
        tests = {"passed": passed, "total": total, "failed_requirements": failed}
        return (min(1.0, passed / total) if total > 0 else 0.0), success, tests, reason

    def _clip(self, text: str) -> str:
        limit = self.max_output_chars
        if len(text) <= limit:
            return text
        note = f"\n... [output cut: {len(text)} characters in all]"
        return text[: limit - len(note)] + note

    def _info(
        self,
        success: bool,
        action_error: str | None = None,
        tests: dict[str, Any] | None = None,
        termination_reason: str = "",
    ) -> dict[str, Any]:
        return {
            "task_id": self._task_id,
            "turn": self._turn,
            "messages": [dict(message) for message in self._messages],
            "tools": list(TOOLS) if self.action_format == "tools" else [],
            "tool_parser": self.tool_parser if self.action_format == "tools" else "",
            "success": success,
            "action_error": valid_unicode(action_error or ""),
            "tests": tests if tests is not None else _no_tests(),
            "termination_reason": valid_unicode(termination_reason),
            "server_pid": (self._server.pid or 0) if self._server is not None else 0,
        }


def _no_tests() -> dict[str, Any]:
    return {"passed": 0, "total": 0, "failed_requirements": []}
