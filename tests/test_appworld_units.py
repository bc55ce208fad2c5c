"""AppWorld env pieces that need no server: action parsing, the code guard, interpreter and data lookup."""

import sys

import pytest

from seeupo_gym.appworld import AppWorldEnv, AppWorldSetupError, extract_code, find_python, render_action
from seeupo_gym.appworld.guard import refusal
from seeupo_gym.appworld.paths import find_data_dir
from seeupo_gym.templates import ReActTemplate

TEMPLATE = ReActTemplate()


def test_render_action_gives_what_the_env_extracts():
    code = "token = apis.venmo.login(username='a@b.com', password='x')['access_token']\nprint(token)"
    response = render_action(code, thought="log in first")
    assert response.startswith("<think>log in first</think>\n```python\n")
    assert extract_code(response, TEMPLATE) == (code, None)


@pytest.mark.parametrize(
    "response, why",
    [
        ("just prose, no code", "no ```python code block"),
        ("<think>I will write code but never stop thinking", "never closed"),
        ("<think>x</think>\n```python\n\n```", "empty"),
        ("```python\nprint(1)\x00\n```", "NUL"),
        ("```python\nprint('\ud800')\n```", "lone surrogate"),
        ("```python\nimport os\nos.listdir('/')\n```", "importing 'os'"),
    ],
)
def test_malformed_responses_are_refused_with_a_reason(response, why):
    code, error = extract_code(response, TEMPLATE)
    assert code is None
    assert why in error


@pytest.mark.parametrize(
    "code",
    [
        "import os",
        "import subprocess",
        "from os import path",
        "import sys",
        "from pathlib import Path",
        "import importlib",
        "__import__('os').system('true')",
        "eval('1+1')",
        "exec('x=1')",
        "open('/etc/passwd').read()",
        "builtins.open('/etc/passwd')",
        "().__class__.__base__.__subclasses__()",
        "print.__globals__",
        "getattr(print, '__glob' + 'als__')",
        "getattr(apis, name)",
        "requester.request('admin', 'x')",
    ],
)
def test_guard_refuses_code_that_reaches_for_the_system(code):
    assert refusal(code) is not None


@pytest.mark.parametrize(
    "code",
    [
        "print(apis.api_docs.show_app_descriptions())",
        "import json, math, re\nfrom collections import Counter\nprint(json.dumps({'a': math.pi}))",
        "from datetime import datetime, timedelta\nimport pendulum",
        "notes = apis.simple_note.search_notes(access_token=t, page_index=0)\nprint(getattr(notes, 'count'))",
        "x = (",  # syntax errors go through: AppWorld's message is the useful one
    ],
)
def test_guard_lets_ordinary_task_code_through(code):
    assert refusal(code) is None


@pytest.mark.parametrize("code", ["-" * 100_000 + "1", "a" + ".b" * 100_000, "x = 1" + " + 1" * 200_000])
def test_code_too_deep_for_the_parser_is_refused_not_crashed(code):
    assert "nested too deeply" in refusal(code)


def test_a_missing_interpreter_names_the_command_that_fixes_it(tmp_path):
    with pytest.raises(AppWorldSetupError, match="python -m seeupo_gym.appworld.setup"):
        find_python(tmp_path / "no-such-python")


def test_an_interpreter_without_appworld_is_refused(monkeypatch):
    monkeypatch.setenv("SEEUPO_APPWORLD_PYTHON", sys.executable)
    with pytest.raises(AppWorldSetupError, match="has no `appworld` package"):
        find_python()


def test_env_without_an_interpreter_fails_at_construction_with_the_fix(tmp_path):
    with pytest.raises(AppWorldSetupError, match="seeupo_gym.appworld.setup"):
        AppWorldEnv(split="mini", python=tmp_path / "missing")


def test_official_split_without_data_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv("SEEUPO_APPWORLD_DATA", raising=False)
    with pytest.raises(AppWorldSetupError, match="appworld download data.*SEEUPO_APPWORLD_DATA"):
        AppWorldEnv(split="dev")


def test_a_data_folder_without_the_split_is_a_clear_error(tmp_path):
    with pytest.raises(AppWorldSetupError, match="No AppWorld data for split 'mini'"):
        find_data_dir("mini", tmp_path)


def test_unknown_split_and_bad_bounds_are_errors():
    with pytest.raises(ValueError, match="split"):
        AppWorldEnv(split="validation")
    with pytest.raises(ValueError, match="max_turns"):
        AppWorldEnv(max_turns=0)
