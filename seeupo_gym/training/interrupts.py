"""Ctrl-C and SIGTERM end a run at a step boundary, so that its last finished step is kept.

`Interrupts` turns SIGINT and SIGTERM into KeyboardInterrupt, except inside `held()` blocks (an
update, a weight sync, a checkpoint being written), where the signal waits for the block to end:
a step is then either finished or dropped whole, never half-applied to the weights. The trainer
checkpoints the last finished step on the way out; the command lines say how to continue and exit
with `EXIT_INTERRUPTED`. Signals a process inherited as ignored (nohup, a background job) stay
ignored. Only the main thread can take signals; elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

# 128 + SIGINT, what a shell reports for a Ctrl-C'd command; SIGTERM ends the same way.
EXIT_INTERRUPTED = 130
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop (SIGINT or SIGTERM); `signal_name` says which."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Interrupts:
    """Install on enter, restore on exit (nestable: an inner one defers to the outer's holds)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._holding = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN:
                    continue
                self._previous[signum] = previous
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = signal.Signals(signum).name
        if self._holding == 0 and first:
            raise Interrupted(self.received)
        # Inside a held block, or a second signal while the first one is being handled (e.g. during
        # the checkpoint on the way out): it waits.

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals wait until the block ends; then the first one raises Interrupted."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        self.raise_if_received()

    @contextlib.contextmanager
    def ignored(self) -> Iterator[None]:
        """Signals are noted and nothing is raised (the checkpoint written on the way out)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def raise_if_received(self) -> None:
        if self.received is not None and self._holding == 0:
            raise Interrupted(self.received)
