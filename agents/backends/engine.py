"""Requests as they come: one prompt in, a future of its completion out.

The per-episode schedule of `VectorAgent` sends each episode's next prompt the moment its env
has answered, without waiting for the other episodes. A backend that can batch such requests
has `submit(prompt, sampling) -> Future[Completion]` (`HFBackend`: continuous batching over its
decode loop; `VLLMBackend`: vLLM's own engine loop). `engine_for` gives any other `Backend` the
same method through `SerialEngine`, which runs one `generate` call per request.

`sampling.seed` is the request's own seed: a request samples the same completion whatever
else is in flight (up to the last bits of floating point, which batch shapes can move).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from seeupo_gym.agents.backends.base import Completion, SamplingParams, check_prompts

logger = logging.getLogger(__name__)


@runtime_checkable
class RequestEngine(Protocol):
    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        """Start sampling one completion of `prompt`; the future resolves when it is done."""
        ...


class SerialEngine:
    """`submit` for a backend with `generate` only: one call per request, on one worker thread.

    No batching; kept for backends of one's own and for tests with scripted backends.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._requests: queue.SimpleQueue[tuple[list[int], SamplingParams, Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="serial-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        check_prompts([prompt])
        future: Future[Completion] = Future()
        self._requests.put((list(prompt), sampling, future))
        return future

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            prompt, sampling, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                (completion,) = self.backend.generate([prompt], sampling)
            except BaseException as error:  # handed to the caller through the future
                future.set_exception(error)
            else:
                future.set_result(completion)


def engine_for(backend: Any) -> tuple[RequestEngine, bool]:
    """The backend itself when it takes requests as they come, else a `SerialEngine` over it.

    Returns (engine, owned): owned engines are the caller's to `close`.
    """
    if callable(getattr(backend, "submit", None)):
        return backend, False
    return SerialEngine(backend), True
