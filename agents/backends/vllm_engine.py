"""Requests as they come for `VLLMBackend`: vLLM's own continuous batching, driven from one thread.

`vllm.LLM.generate` adds a list of requests and steps the engine until all are done. Here a
worker thread adds each request the moment it is submitted (`LLMEngine.add_request`) and keeps
calling `LLMEngine.step()`; the scheduler admits new requests into the running batch at every
step and each finished request resolves its future. The same code drives the GPU and the CPU
build (the engine's executor is whatever the `LLM` was built with).

Each request is seeded by its own `sampling.seed` (vLLM seeds per request), so what it samples
does not depend on what shares its steps.

Not to be mixed with `VLLMBackend.generate` or `update_weights` while requests are in flight:
both use the same engine; push weights between collections.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from seeupo_gym.agents.backends.base import FINISH_LENGTH, FINISH_STOP, Completion, SamplingParams, check_prompts
from seeupo_gym.agents.backends.engine import EngineThread

if TYPE_CHECKING:
    from seeupo_gym.agents.backends.vllm import VLLMBackend

logger = logging.getLogger(__name__)


class VLLMEngineLoop(EngineThread):
    """`submit(prompt, sampling) -> Future[Completion]` over a `VLLMBackend`'s engine."""

    thread_name = "vllm-engine-loop"

    def __init__(self, backend: "VLLMBackend") -> None:
        super().__init__()
        self.backend = backend
        self._ids = itertools.count()
        self._pending: list[tuple[str, list[int], SamplingParams, Future]] = []
        self._in_flight: dict[str, Future] = {}
        self.steps = 0  # engine steps, for benchmarks

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        check_prompts([prompt])
        future: Future[Completion] = Future()
        request_id = f"seeupo-{next(self._ids)}"
        self._enqueue(lambda: self._pending.append((request_id, list(prompt), sampling, future)))
        return future

    def _loop(self) -> None:
        engine = self.backend.llm.llm_engine
        while True:
            with self._wake:
                while not self._pending and not self._in_flight and not self._closed:
                    self._wake.wait()
                if self._closed and not self._pending and not self._in_flight:
                    return
                arrived, self._pending = self._pending, []
            try:
                for request_id, prompt, sampling, future in arrived:
                    if not future.set_running_or_notify_cancel():
                        continue
                    engine.add_request(
                        request_id,
                        self.backend._vllm.TokensPrompt(prompt_token_ids=prompt),
                        request_params(self.backend, sampling),
                        lora_request=self.backend._lora_request,
                    )
                    self._in_flight[request_id] = future
                outputs = engine.step()
                self.steps += 1
            except BaseException as error:  # handed to every caller in flight; the loop goes on
                logger.exception("vLLM engine step failed")
                if self._in_flight:
                    engine.abort_request(list(self._in_flight))
                for future in list(self._in_flight.values()) + [f for *_, f in arrived]:
                    if not future.done():
                        future.set_exception(error)
                self._in_flight.clear()
                continue
            for output in outputs:
                if output.finished:
                    future = self._in_flight.pop(output.request_id, None)
                    if future is None:
                        logger.warning("vLLM returned an unknown request id %r", output.request_id)
                        continue
                    try:
                        future.set_result(completion_from(output))
                    except Exception as error:
                        future.set_exception(error)


def request_params(backend: "VLLMBackend", sampling: SamplingParams) -> Any:
    """vLLM sampling params of one request, as `VLLMBackend.generate` builds them (seed as given)."""
    from vllm.sampling_params import RequestOutputKind

    params = backend._vllm.SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop_strings) or None,
        stop_token_ids=list(sampling.stop_token_ids or backend.default_stop_token_ids),
        # The stop ids above are the whole rule (the Backend contract): the model's eos stops only when listed.
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's logprob only
    )
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def completion_from(output: Any) -> Completion:
    sample = output.outputs[0]
    token_ids = list(sample.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(sample.logprobs or [], token_ids)]
    if len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no logprob for some sampled tokens")
    finish = FINISH_LENGTH if sample.finish_reason == "length" else FINISH_STOP
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish)
