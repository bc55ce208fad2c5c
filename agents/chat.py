"""Chat-template rendering for the agent's contexts, in both action formats.

- `render_chat` applies the tokenizer's chat template, with the env's tools (`info["tools"]`,
  JSON schemas) passed as `tools=` in the tools format, so the template renders them its own
  way (Qwen2.5: a `<tools>` section in the system message).
- `appended_text` is the text the template appends after a sampled response for the messages the
  env added after it: a user message (ReAct, or a BFCL turn end) or the `tool` messages holding
  tool results. Rendered with a sentinel conversation, so the sampled tokens are never re-rendered.
- `sampled_assistant_message` is the assistant message the env records for a response when it
  keeps the response as sampled; when the env's message differs (e.g. `keep_think=False`), the
  agent rebuilds the context from the env's messages instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seeupo_gym.tools import assistant_message, parse_tool_response

_ASSISTANT_SENTINEL = "\x00ASSISTANT\x00"
_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_UNBOUNDED = 1 << 62


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: Sequence[dict] | None = None
) -> str:
    # `tools or None`: some templates render tool boilerplate even for an empty list.
    return tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def appended_text(tokenizer: Any, closing: str, following: list[dict[str, Any]], *, closed_by: str = "") -> str:
    """Text after a response for the messages `following` it, ending with the generation prompt.

    closing: the template's text that ends an assistant turn (`ChatDelta.closing`); closed_by: the
    decoded stop token that ended the response, not repeated. Raises ValueError when the template
    does not render the messages as a suffix (then contexts must be rebuilt from messages).
    """
    calls = [{"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}}
             for m in following if m.get("role") == "tool"]
    assistant: dict[str, Any] = {"role": "assistant", "content": _ASSISTANT_SENTINEL}
    if calls:  # a template may expect the tool results' calls on the assistant message
        assistant["tool_calls"] = calls
    before = render_chat(tokenizer, _BASE + [assistant], add_generation_prompt=False)
    after = render_chat(tokenizer, _BASE + [assistant] + following, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render the env's new messages as a suffix")
    if closed_by and closing.startswith(closed_by):
        closing = closing[len(closed_by):]
    return closing + after[len(before):]


def sampled_assistant_message(action: str, tools: Sequence[dict] | None, parser: str = "hermes") -> dict[str, Any]:
    """The assistant message of `action` as sampled: in the tools format its tool calls parsed out
    (with the env's parser, `info["tool_parser"]`; no argument checks: the env decides what runs),
    else the text itself."""
    if tools:
        parsed = parse_tool_response(action, tools, parser=parser, max_chars=_UNBOUNDED, check_arguments=False)
        if parsed.calls and parsed.error is None:
            return assistant_message(parsed.content, parsed.calls)
    return {"role": "assistant", "content": action}
