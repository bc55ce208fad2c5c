"""The ReAct-with-reasoning template every env shares.

A response is "think first, then act": a reasoning block `<think>...</think>` followed by the
action in the env's own format (a call list for BFCL, a code block for AppWorld, an option
label for TurnBandit). Envs supply what is theirs (role, tools, protocol, action format);
the template owns the layout of the system prompt, the split of a response into thought
and action, and whether earlier turns' thoughts stay in the context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_WHITESPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ReActResponse:
    """A model response split into its reasoning and its action text."""

    thought: str
    action: str
    # False when the response opened a think block and never closed it; the action is then empty.
    think_closed: bool


def strip_think(text: str) -> str:
    """The response without its `<think>...</think>` blocks (and the whitespace after each).

    One pass with `str.find`, linear in the text: a lazy regex restarts its scan at every
    `<think>` and is quadratic on responses full of unclosed ones (0.5 s on 32k characters).
    An unclosed block is kept, as no `</think>` follows it.
    """
    kept = []
    position = 0
    while (start := text.find(THINK_OPEN, position)) != -1:
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end == -1:
            break
        kept.append(text[position:start])
        position = _WHITESPACE.match(text, end + len(THINK_CLOSE)).end()
    kept.append(text[position:])
    return "".join(kept).strip()


@dataclass(frozen=True)
class ReActTemplate:
    """ReAct with reasoning.

    keep_think: whether earlier turns' `<think>` blocks stay in the context (the chat history
    the env reports in `info["messages"]`). Dropping them shortens long episodes; the agent then
    rebuilds each turn's context from those messages.
    """

    keep_think: bool = True

    def system_prompt(self, *, role: str, protocol: str, action_format: str, tools: str = "") -> str:
        sections = [
            role.strip(),
            "# How to respond\n"
            f"Think first, then act. Start every response with your reasoning inside "
            f"{THINK_OPEN}...{THINK_CLOSE}, then write your action.\n" + action_format.strip(),
            "# Protocol\n" + protocol.strip(),
        ]
        if tools.strip():
            sections.append("# Tools\n" + tools.strip())
        return "\n\n".join(sections)

    def parse(self, response: str) -> ReActResponse:
        """Split a response into thought and action. Never raises."""
        start = response.find(THINK_OPEN)
        if start == -1:
            # No reasoning block: everything is the action (a sloppy but usable response).
            return ReActResponse(thought="", action=response.strip(), think_closed=True)
        end = response.find(THINK_CLOSE, start)
        if end == -1:
            return ReActResponse(thought=response[start + len(THINK_OPEN):].strip(), action="", think_closed=False)
        thought = response[start + len(THINK_OPEN):end].strip()
        action = (response[:start] + response[end + len(THINK_CLOSE):]).strip()
        return ReActResponse(thought=thought, action=action, think_closed=True)

    def history_content(self, response: str) -> str:
        """How an earlier response appears in the context of later turns."""
        return response if self.keep_think else strip_think(response)

    @staticmethod
    def render(action: str, thought: str = "") -> str:
        """A response in the template's format: for scripted agents, tests and SFT data."""
        return f"{THINK_OPEN}{thought}{THINK_CLOSE}\n{action}"
