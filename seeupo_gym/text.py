"""Text an env hands out: valid Unicode by contract, bounded where it comes from a sandbox.

A Python `str` can hold lone UTF-16 surrogates (from `surrogatepass` decoding, a JSON
`"\\ud800"` escape, or model code that builds one), which no UTF-8 encoder and no tokenizer
takes. Envs escape them (`\\ud800` as six characters) before text leaves them.
"""

from __future__ import annotations

from typing import Any


def valid_unicode(text: str) -> str:
    """`text` with each lone surrogate written as its escape: encodable as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bounded(value: Any, limit: int) -> str:
    """`value` as valid Unicode text of at most `limit` characters (a longer one is cut, with a
    note saying how much was left out); a value that is not a string is shown by its repr."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        note = f"... [{len(text) - limit} more characters]"
        text = text[: max(0, limit - len(note))] + note
    return valid_unicode(text)


def valid_unicode_tree(value: Any) -> Any:
    """`value` with every string in it (dict keys included, through dicts, lists and tuples)
    passed through `valid_unicode`: for messages that carry parsed JSON, e.g. tool-call arguments."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, dict):
        return {valid_unicode_tree(key): valid_unicode_tree(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(valid_unicode_tree(item) for item in value)
    return value


def counted(count: Any, noun: str) -> str:
    """`1 token`, `2 tokens`: a count and its noun, plural unless the count is exactly 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
