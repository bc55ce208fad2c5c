"""A syntax check on model code before it reaches an AppWorld server.

Model output is untrusted. AppWorld's own guard blocks some modules and turns some `os`
functions into no-ops, but it lets `import os`, `open(...)` for reading, `eval` and dunder
walks (`().__class__.__subclasses__()`) through. Tasks need none of that: they need the
`apis` object, plain Python and a few pure modules. This check refuses the rest before the
code is sent, so the agent reads a clear error at once. It is only that: a denylist over
Python cannot be complete (modules already loaded re-export `os`, frames reach builtins), so
the security boundary is the OS sandbox the code runs in (`seeupo_gym.appworld.sandbox`).
"""

from __future__ import annotations

import ast

ALLOWED_MODULES = frozenset({
    "array", "bisect", "calendar", "collections", "collections.abc", "copy", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "heapq", "itertools", "json", "math", "numbers",
    "operator", "pendulum", "pprint", "random", "re", "statistics", "string", "textwrap", "typing", "uuid",
})
BLOCKED_NAMES = frozenset({
    "__builtins__", "__import__", "breakpoint", "builtins", "compile", "eval", "exec", "exit", "globals",
    "input", "locals", "memoryview", "open", "quit", "requester", "vars",
})
_ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})


def refusal(code: str) -> str | None:
    """Why `code` may not run, or None when it may. Code that does not parse is left to
    AppWorld, whose syntax error message the agent should see."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    except (RecursionError, MemoryError):
        return "the code is nested too deeply to check"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [("." * node.level) + (node.module or "")]
        else:
            modules = []
        for module in modules:
            if module not in ALLOWED_MODULES:
                return f"importing {module!r} is not allowed (allowed: {', '.join(sorted(ALLOWED_MODULES))})"
        if isinstance(node, ast.Name) and node.id in BLOCKED_NAMES:
            return f"using {node.id!r} is not allowed"
        if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            return f"accessing the dunder attribute {node.attr!r} is not allowed"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS:
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and not name.value.startswith("_")):
                return f"{node.func.id}() is allowed only with a literal attribute name that does not start with '_'"
    return None
