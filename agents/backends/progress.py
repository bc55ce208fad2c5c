"""A backend wrapper that moves a progress bar once per response (one turn of an episode).

Used by the evaluation's bar and by `VectorAgent.collect(..., progress=True)`.
"""

from __future__ import annotations

from typing import Any

from seeupo_gym.agents.backends.base import Backend
from seeupo_gym.text import counted


class TurnProgress(Backend):
    """A backend that counts each response's tokens (one turn of an episode) on a bar.

    Tasks finish only after up to max_turns turns, so a bar that moved per task alone could sit
    still for minutes on a slow model.
    """

    def __init__(self, backend: Backend, bar: Any) -> None:
        self._backend = backend
        self._bar = bar
        self.turns = 0
        self.tokens = 0
        self.default_stop_token_ids = backend.default_stop_token_ids

    def generate(self, prompts: Any, sampling: Any) -> Any:
        completions = self._backend.generate(prompts, sampling)
        self._record(sum(len(c.token_ids) for c in completions), f"turn {self.turns + 1} ({counted(len(prompts), 'episode')})")
        return completions

    def update_weights(self, state_dict_or_model: Any) -> None:
        self._backend.update_weights(state_dict_or_model)

    def __getattr__(self, name: str) -> Any:
        # The wrapped backend's `submit`: without it the per-episode schedule would fall back to one
        # request at a time whenever a progress bar is shown.
        if name == "submit" and callable(getattr(self._backend, "submit", None)):
            return self._submit
        raise AttributeError(name)

    def _submit(self, prompt: Any, sampling: Any) -> Any:
        future = self._backend.submit(prompt, sampling)
        future.add_done_callback(self._count)
        return future

    def _count(self, future: Any) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        self._record(len(future.result().token_ids), counted(self.turns + 1, "response"))

    def _record(self, generated: int, what: str) -> None:
        self.turns += 1
        self.tokens += generated
        self._bar.update(generated)
        # Shown at once: a response is the bar's unit of news (the update alone may wait for mininterval).
        self._bar.set_postfix_str(f"{what}, {counted(self.tokens, 'token')} generated")
