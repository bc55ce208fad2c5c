"""Generation on any OpenAI-compatible server: API models, `vllm serve`, SGLang.

Two modes:

- "tokens" (a `Backend`, trainable): token prompts in, token ids and logprobs out, through the
  completions route with vLLM's extensions (`prompt` as a list of token ids, `return_token_ids`,
  `stop_token_ids`, `logprobs`). The recorded logprobs keep the contract of `Completion` only if
  the server computes them after temperature: start vLLM with
  `--logprobs-mode processed_logprobs` (the in-process `VLLMBackend` does the same).
- "chat" (`chat()`, evaluation only): messages plus `tools=` through the chat route, for models
  that have no tokenizer here (GPT-class APIs). Its replies carry text and tool calls, not
  trainable tokens; `agents.chat_agent` renders them into the env's action format.

The server is untrusted: every reply is read up to `max_body_bytes` (compressed replies are
refused: we ask for identity), parsed as JSON, and checked (token ids are ints in the vocabulary,
one finite logprob in [LOGPROB_FLOOR, 0] per token, at most `max_new_tokens` of them, a known finish
reason) before anything reaches the agent. 429, 5xx, timeouts and dropped connections are retried
with exponential backoff (tenacity) within `retries` attempts; anything else ends the request with
`ServerReplyError`, which the agent turns into an ended episode, not a crashed run.

Deadlines are wall-clock: each attempt, connection, headers and body together, ends `timeout_s`
after it starts, however slowly the server drips its bytes (httpx's own timeout bounds each read
only); a chat episode (`episode_deadline`) ends `episode_timeout_s` after it starts, retries and
all turns included.

The API key is read from the environment variable `api_key_env`, is never logged, and is redacted
(`[redacted]`) from every error message and every string of a reply, so a server that echoes the
request's headers cannot put it into an error, an episode's info, a log line or a rollouts file.
Keys under `MIN_SECRET_CHARS` characters are placeholders (`EMPTY`), not secrets, and are left alone.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import httpcore
import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from seeupo_gym.agents.backends.base import (
    FINISH_LENGTH, FINISH_STOP, Backend, Completion, RequestError, SamplingParams, TrainingSetup, check_prompts,
)

MODES = ("tokens", "chat")
_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "tool_calls": FINISH_STOP, "eos": FINISH_STOP}
MAX_TOOL_CALLS = 64
MAX_ARGUMENT_DEPTH = 64
# The lowest logprob accepted for a sampled token. A sampler cannot draw a token of probability
# below float32's smallest (1.4e-45, log -103.3; float64: -744.4), so only a broken or hostile
# server sends less; -1e4 leaves room for logprobs taken at another temperature than the draw,
# and keeps sums and means over a reply (`sampled_nll_mean`) finite (-1e308 overflows them).
LOGPROB_FLOOR = -1e4
MIN_SECRET_CHARS = 8
REDACTED = "[redacted]"


class ServerReplyError(RequestError):
    """A request the server did not answer usably (after the retries); the message says why."""


class _Retryable(ServerReplyError):
    """A failure worth another attempt: 429, 5xx, a timeout, a dropped connection."""


@dataclass(frozen=True)
class ChatReply:
    """One assistant reply in chat mode: its text and tool calls (arguments parsed from JSON, or
    the raw string when the server sent invalid JSON: the env then reports the error)."""

    content: str
    tool_calls: tuple[tuple[str, Any], ...] = ()
    finish_reason: str = FINISH_STOP
    completion_tokens: int = 0
    raw_tool_calls: list[dict[str, Any]] = field(default_factory=list, repr=False)


class OpenAIBackend(Backend):
    """An OpenAI-compatible endpoint as a generation backend (see the module docstring).

    base_url: e.g. "http://127.0.0.1:8000/v1"; model: the served model's name; api_key_env: the
    environment variable holding the key (unset is fine for local servers); vocab_size: token
    ids at or above it are refused (the tokenizer's length; None skips that check);
    max_concurrency: requests in flight at once (`submit` queues the rest);
    timeout_s: the wall-clock deadline of one attempt (connection, headers and body together);
    retries: attempts per request; max_body_bytes: the largest reply read;
    episode_timeout_s: the wall-clock deadline of one chat episode, every turn and retry included
    (`episode_deadline`; 1800 s: a 30-turn AppWorld episode at a slow API's 60 s a turn);
    extra_body: more request fields (e.g. {"top_k": -1}); version_header: the header that carries
    the policy version of a training run's requests.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        mode: Literal["tokens", "chat"] = "tokens",
        api_key_env: str | None = "OPENAI_API_KEY",
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] = (),
        max_concurrency: int = 8,
        timeout_s: float = 120.0,
        retries: int = 5,
        max_body_bytes: int = 16 * 2**20,
        extra_body: dict[str, Any] | None = None,
        backoff_s: float = 0.5,
        episode_timeout_s: float = 1800.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_concurrency < 1 or retries < 1:
            raise ValueError("max_concurrency and retries must be >= 1")
        if not (timeout_s > 0 and episode_timeout_s > 0):
            raise ValueError(f"timeout_s and episode_timeout_s must be > 0, got {timeout_s} and {episode_timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.mode = mode
        self.vocab_size = vocab_size
        self.default_stop_token_ids = tuple(stop_token_ids)
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_body_bytes = max_body_bytes
        self.extra_body = dict(extra_body or {})
        self.backoff_s = backoff_s
        self.episode_timeout_s = float(episode_timeout_s)
        self.policy_version = 0
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        self._secrets = _secret_forms(key)
        headers = {"Accept-Encoding": "identity"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=max_concurrency)
        )
        _install_deadlines(self._client)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="openai")
        self._lock = threading.Lock()
        self.requests_sent = 0
        self._adapters: list[str] = []
        self._request_model = model  # the served name, then the latest adapter's

    def __repr__(self) -> str:  # never shows the key
        return self.redact(f"OpenAIBackend({self.base_url!r}, {self.model!r}, mode={self.mode!r})")

    def redact(self, text: str) -> str:
        """`text` with the API key (and its JSON- and URL-escaped forms) replaced by [redacted]."""
        for form in self._secrets:
            text = text.replace(form, REDACTED)
        return text

    def episode_deadline(self) -> float:
        """The `time.monotonic()` at which a chat episode starting now must end (pass it to `chat`)."""
        return time.monotonic() + self.episode_timeout_s

    # ------------------------------------------------------------------------------ tokens mode

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        check_prompts(prompts)
        futures = [self.submit(prompt, sampling) for prompt in prompts]
        return [future.result() for future in futures]

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        self._require("tokens")
        check_prompts([prompt])
        return self._pool.submit(self._complete, list(prompt), sampling)

    @classmethod
    def for_training(cls, model: Any, tokenizer: Any, setup: TrainingSetup) -> "OpenAIBackend":
        """Generation on a server: the user's (`base_url`: `vllm serve <model> --enable-lora
        --logprobs-mode processed_logprobs`, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for LoRA runs),
        or one started here for the run (`serve: true`, see `vllm_server.py`) and stopped by `close`.

        Options (the config's `generation` section): base_url, serve, serve_command, serve_args (no
        `--host`), serve_host (default 127.0.0.1; another address takes the server off loopback),
        serve_stop_grace_s (SIGTERM to SIGKILL, default 30), serve_env, serve_timeout_s,
        enforce_eager, max_model_len, output_dir (the server's log goes
        there), served_model (default model.name_or_path), api_key_env, max_concurrency, request_timeout_s,
        weights_dir (a folder the server can read: adapters and weights are written there for it to load)."""
        options = dict(setup.options)
        base_url = options.get("base_url")
        serve = bool(options.get("serve"))
        if serve and base_url:
            raise ValueError("generation.serve starts a server for the run: leave generation.base_url unset")
        if not base_url and not serve:
            raise ValueError("generation.backend=openai needs generation.base_url (e.g. http://127.0.0.1:8000/v1) "
                             "or generation.serve=true")
        if setup.processes > 1:
            raise ValueError("generation.backend=openai serves one training process; run the trainer on one process")
        served_model = options.get("served_model") or setup.model_name
        server = _start_server(setup, options, served_model, keep_adapters=cls.keep_adapters) if serve else None
        try:
            backend = cls(
                server.base_url if server is not None else base_url,
                served_model,
                mode="tokens",
                api_key_env=options.get("api_key_env", "OPENAI_API_KEY"),
                vocab_size=len(tokenizer),
                stop_token_ids=tuple(i for i in (tokenizer.eos_token_id,) if i is not None),
                max_concurrency=int(options.get("max_concurrency", 32)),
                timeout_s=float(options.get("request_timeout_s", 300.0)),
            )
        except BaseException:
            if server is not None:
                server.stop()
            raise
        backend.server = server
        backend.weights_dir = options.get("weights_dir")
        if server is None:  # the user's server: a dead or mistyped base_url fails here, in one line
            from seeupo_gym.agents.backends.server_check import check_server

            try:
                check_server(backend)
            except BaseException:
                backend.close()
                raise
        return backend

    server: Any = None  # the VLLMServer this backend started (generation.serve), stopped by close()
    weights_dir: str | None = None
    # Adapters kept loaded on the server: the current one and the one before it (an overlapped
    # collection may still be sampling from it).
    keep_adapters = 2

    def update_weights(self, state_dict_or_model: Any) -> None:
        """Push the learner's weights to the server and sample from them from now on.

        A LoRA model's adapter is written to `weights_dir` and hot-loaded under a new name per policy
        version (`/v1/load_lora_adapter`; later requests name it as their model); full weights are
        written as safetensors and reloaded through vLLM's `collective_rpc` route (`reload_weights`;
        the server needs VLLM_SERVER_DEV_MODE=1). Either way the server must see `weights_dir`."""
        import tempfile

        version = self.policy_version + 1
        root = self.weights_dir or tempfile.gettempdir()
        folder = os.path.join(root, f"seeupo-policy-v{version}-{os.getpid()}")
        if hasattr(state_dict_or_model, "peft_config"):
            state_dict_or_model.save_pretrained(folder)
            name = f"policy-v{version}"
            self._post_control("/load_lora_adapter", {"lora_name": name, "lora_path": folder})
            self._adapters.append(name)
            while len(self._adapters) > self.keep_adapters:
                self._post_control("/unload_lora_adapter", {"lora_name": self._adapters.pop(0)})
            self._request_model = name
        else:
            from safetensors.torch import save_file

            from seeupo_gym.agents.backends.vllm import _unshared, merged_state_dict

            weights = merged_state_dict(state_dict_or_model) if hasattr(state_dict_or_model, "state_dict") else dict(state_dict_or_model)
            os.makedirs(folder, exist_ok=True)
            save_file(_unshared(weights), os.path.join(folder, "model.safetensors"))
            root_url = self.base_url.rsplit("/v1", 1)[0]
            self._post_control("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}}, root=root_url)
            self._post_control("/reset_prefix_cache", {}, root=root_url)
        self.policy_version = version

    def set_policy_version(self, version: int) -> None:
        """The weights version the server now samples from; sent with every later request."""
        self.policy_version = int(version)

    def _post_control(self, route: str, body: dict[str, Any], root: str | None = None) -> None:
        """A weight-sync request: retried like the others, then its status checked."""
        url = (root or self.base_url) + route
        for attempt in range(self.retries):
            try:
                response = self._client.post(url, json=body)
            except httpx.TransportError as error:
                if attempt + 1 == self.retries:
                    raise ServerReplyError(f"{route}: connection failed ({type(error).__name__})") from None
                continue
            if response.status_code == 200:
                return
            if response.status_code not in _RETRY_STATUS or attempt + 1 == self.retries:
                raise ServerReplyError(f"{route}: HTTP {response.status_code}: {self._snippet(response.content, 300)}")

    def _complete(self, prompt: list[int], sampling: SamplingParams) -> Completion:
        stop_ids = list(sampling.stop_token_ids or self.default_stop_token_ids)
        body: dict[str, Any] = {
            "model": self._request_model,
            "prompt": prompt,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            **self.extra_body,
        }
        if stop_ids:
            body["stop_token_ids"] = stop_ids
        if sampling.stop_strings:
            body["stop"] = list(sampling.stop_strings)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        reply = self._post("/completions", body)
        choice = _first_choice(reply)
        return self._checked_completion(choice, sampling)

    def _checked_completion(self, choice: dict[str, Any], sampling: SamplingParams) -> Completion:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") if isinstance(choice.get("logprobs"), dict) else None
        if not isinstance(token_ids, list) or not isinstance(logprobs, list):
            raise ServerReplyError(
                "the server's completion has no token ids or logprobs: tokens mode needs vLLM's "
                "`return_token_ids` and `logprobs` (or use mode='chat' for evaluation)"
            )
        if not token_ids or len(token_ids) != len(logprobs):
            raise ServerReplyError(f"the server sent {len(token_ids)} token ids and {len(logprobs)} logprobs")
        if len(token_ids) > sampling.max_new_tokens:
            raise ServerReplyError(f"the server sent {len(token_ids)} tokens, more than max_tokens={sampling.max_new_tokens}")
        for token in token_ids:
            if type(token) is not int or token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
                raise ServerReplyError(f"the server sent a token id outside the vocabulary: {str(token)[:40]}")
        values = []
        for value in logprobs:
            if type(value) not in (int, float) or not math.isfinite(value) or not LOGPROB_FLOOR <= value <= 1e-4:
                raise ServerReplyError(f"the server sent a logprob that is not a finite number in "
                                       f"[{LOGPROB_FLOOR:g}, 0]: {str(value)[:40]}")
            values.append(min(float(value), 0.0))
        finish = _FINISH.get(str(choice.get("finish_reason")))
        if finish is None:
            raise ServerReplyError(f"unknown finish reason from the server: {str(choice.get('finish_reason'))[:40]}")
        return Completion(token_ids=list(token_ids), logprobs=values, finish_reason=finish)

    # -------------------------------------------------------------------------------- chat mode

    def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: Sequence[dict[str, Any]] | None = None,
        *, deadline: float | None = None,
    ) -> ChatReply:
        """One assistant reply to `messages` (OpenAI chat format), offering `tools`; `deadline` (a
        `time.monotonic()`, e.g. `episode_deadline()`) ends the request and its retries there."""
        self._require("chat")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            **self.extra_body,
        }
        if tools:
            body["tools"] = list(tools)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop_strings:
            body["stop"] = list(sampling.stop_strings)
        choice = _first_choice(self._post("/chat/completions", body, deadline))
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ServerReplyError("the server's chat reply has no message")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ServerReplyError("the server's message content is not a string")
        calls, raw = _tool_calls(message.get("tool_calls"))
        finish = _FINISH.get(str(choice.get("finish_reason")), FINISH_STOP)
        return ChatReply(content=content, tool_calls=calls, finish_reason=finish, raw_tool_calls=raw)

    def submit_chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams, tools: Sequence[dict[str, Any]] | None = None,
        *, deadline: float | None = None,
    ) -> "Future[ChatReply]":
        return self._pool.submit(self.chat, messages, sampling, tools, deadline=deadline)

    # ------------------------------------------------------------------------------ transport

    def _require(self, mode: str) -> None:
        if self.mode != mode:
            raise RuntimeError(f"this OpenAIBackend is in {self.mode!r} mode; {mode!r} requests need mode={mode!r}")

    def _post(self, route: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        def give_up(state: Any) -> bool:  # the attempts are spent, or the episode's deadline is
            return state.attempt_number >= self.retries or (deadline is not None and time.monotonic() >= deadline)

        retrying = Retrying(
            stop=give_up,
            wait=wait_exponential_jitter(initial=self.backoff_s, max=30.0),
            retry=retry_if_exception(lambda error: isinstance(error, _Retryable)),
            reraise=True,
        )
        try:
            return retrying(self._post_once, route, body, deadline)
        except _Retryable as error:
            if deadline is not None and time.monotonic() >= deadline:
                raise ServerReplyError(f"{error} (the episode's deadline of {self.episode_timeout_s:g} s, "
                                       f"episode_timeout_s, passed)") from None
            raise ServerReplyError(f"{error} (gave up after {self.retries} attempts)") from None

    def _post_once(self, route: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        started = time.monotonic()
        if deadline is not None and started >= deadline:
            raise _Retryable(f"{route}: not sent")
        with self._lock:
            self.requests_sent += 1
        headers = {"X-Policy-Version": str(self.policy_version)}
        # Every socket operation of this attempt waits at most until then (see _DeadlineStream).
        _DEADLINE.at = min(started + self.timeout_s, deadline if deadline is not None else math.inf)
        try:
            with self._client.stream("POST", self.base_url + route, json=body, headers=headers) as response:
                encoding = response.headers.get("content-encoding", "identity").lower()
                if encoding not in ("", "identity"):
                    shown = _printable(self.redact(encoding).encode())[:20]  # redacted before the cut
                    raise ServerReplyError(f"the server sent a {shown}-compressed reply; identity was asked for")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                    raise ServerReplyError(f"the server's reply is {declared} bytes, over the {self.max_body_bytes} byte bound")
                data = bytearray()
                for chunk in response.iter_raw():
                    data += chunk
                    if len(data) > self.max_body_bytes:
                        raise ServerReplyError(f"the server's reply is over the {self.max_body_bytes} byte bound")
                status = response.status_code
        except httpx.TimeoutException:
            raise _Retryable(f"{route}: no whole reply within {time.monotonic() - started:.3g} s "
                             f"(timeout_s={self.timeout_s:g})") from None
        except httpx.TransportError as error:
            raise _Retryable(f"{route}: connection failed ({type(error).__name__})") from None
        finally:
            _DEADLINE.at = None
        if status in _RETRY_STATUS:
            raise _Retryable(f"{route}: HTTP {status}")
        if status != 200:
            raise ServerReplyError(f"{route}: HTTP {status}: {self._snippet(data, 300)}")
        try:
            reply = json.loads(bytes(data))
        except (ValueError, RecursionError):
            raise ServerReplyError(f"{route}: the reply is not JSON: {self._snippet(data, 120)}") from None
        if not isinstance(reply, dict):
            raise ServerReplyError(f"{route}: the reply is not a JSON object")
        if not self._secrets:
            return reply
        try:
            return self._redacted(reply)
        except RecursionError:  # JSON that parses but nests deeper than Python's stack walks
            raise ServerReplyError(f"{route}: the reply nests too deep") from None

    def _snippet(self, data: bytes | bytearray, limit: int) -> str:
        """The start of a server's body for an error message: redacted before it is cut (so no part
        of the key survives the cut), then printable ASCII."""
        text = bytes(data).decode("utf-8", errors="replace")
        if self._secrets:
            try:  # a JSON body may spell the key in \u escapes: redact its parsed strings
                text = json.dumps(self._redacted(json.loads(text)), ensure_ascii=False)
            except (ValueError, RecursionError):
                pass
        return _printable(self.redact(text)[:limit].encode("utf-8"))

    def _redacted(self, value: Any) -> Any:
        """A parsed reply with the key redacted from every string (keys of objects too)."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, list):
            return [self._redacted(item) for item in value]
        if isinstance(value, dict):
            return {self.redact(k): self._redacted(v) for k, v in value.items()}
        return value

    def close(self) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._client.close()
        finally:
            if self.server is not None:
                self.server.stop()


def _start_server(setup: TrainingSetup, options: dict[str, Any], served_model: str, *, keep_adapters: int) -> Any:
    """`vllm serve` for the run, on the learner's initial weights; returns it once /health answers."""
    import tempfile

    from seeupo_gym.agents.backends.vllm import model_folder
    from seeupo_gym.agents.backends.vllm_server import (
        LOOPBACK, STOP_GRACE_S, VLLMServer, checked_serve_args, free_port, serve_arguments, vllm_command,
    )

    command = vllm_command(options.get("serve_command"))
    extra = checked_serve_args(options.get("serve_args") or ())
    host = str(options.get("serve_host") or LOOPBACK)
    port = free_port()
    arguments = serve_arguments(
        model_folder(setup.model_name, seed=setup.seed), served_name=served_model, port=port, dtype=setup.dtype, host=host,
        seed=setup.seed, max_model_len=int(options.get("max_model_len") or setup.max_context_tokens),
        # The new adapter is loaded before the oldest kept one is unloaded: one more slot.
        lora_rank=setup.lora_rank, max_loras=keep_adapters + 1,
    ) + (["--enforce-eager"] if options.get("enforce_eager") else [])
    # LoRA runs hot-load an adapter per version; full fine-tuning reloads weights through the dev routes.
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if setup.lora_rank is not None else {"VLLM_SERVER_DEV_MODE": "1"}
    env.update({str(k): str(v) for k, v in (options.get("serve_env") or {}).items()})
    run_dir = options.get("output_dir")
    log_path = os.path.join(run_dir, "vllm-serve.log") if run_dir else os.path.join(tempfile.gettempdir(), f"seeupo-vllm-serve-{port}.log")
    server = VLLMServer(
        command, arguments + extra, env=env, log_path=log_path, port=port, host=host,
        startup_timeout_s=float(options.get("serve_timeout_s", 900.0)),
        stop_grace_s=float(options.get("serve_stop_grace_s", STOP_GRACE_S)),
    )
    server.start()
    return server


def _first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerReplyError("the server's reply has no choices")
    return choices[0]


def _tool_calls(value: Any) -> tuple[tuple[tuple[str, Any], ...], list[dict[str, Any]]]:
    if value is None:
        return (), []
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise ServerReplyError(f"the server's tool_calls is not a list of at most {MAX_TOOL_CALLS} calls")
    calls: list[tuple[str, Any]] = []
    for item in value:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ServerReplyError("a tool call from the server has no function name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                pass  # kept as the raw string: the env's parser reports it to the model
        if _depth(arguments) > MAX_ARGUMENT_DEPTH:  # what walks them later recurses
            raise ServerReplyError(f"a tool call's arguments from the server nest deeper than {MAX_ARGUMENT_DEPTH} levels")
        calls.append((function["name"], arguments))
    return tuple(calls), list(value)


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in `value`, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _printable(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").encode("ascii", errors="backslashreplace").decode("ascii")


def _secret_forms(key: str) -> tuple[str, ...]:
    """The forms in which a server may echo the key: as sent, JSON-escaped, URL-encoded."""
    if len(key) < MIN_SECRET_CHARS:
        return ()
    from urllib.parse import quote

    forms = {key, json.dumps(key)[1:-1], json.dumps(key, ensure_ascii=False)[1:-1], key.replace("/", "\\/"),
             quote(key, safe="")}
    return tuple(sorted(forms, key=len, reverse=True))


# The deadline of the attempt this thread is making (time.monotonic()), or None: none.
_DEADLINE = threading.local()


def _left(timeout: float | None, expired: type[Exception]) -> float | None:
    """`timeout` cut to what is left of this thread's deadline; `expired` once nothing is."""
    deadline = getattr(_DEADLINE, "at", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write waits at most until the thread's deadline, so a
    server dripping a byte at a time cannot stretch a request past it."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _install_deadlines(client: httpx.Client) -> None:
    """Route the client's connections (direct and through proxies) through `_DeadlineBackend`.
    httpx exposes no whole-request deadline, so this sets its pools' network backend; a version of
    httpx without one fails here, at construction, not silently without deadlines."""
    transports = [client._transport, *(t for t in client._mounts.values() if t is not None)]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        if pool is None or not hasattr(pool, "_network_backend"):
            raise RuntimeError(f"OpenAIBackend cannot set its request deadlines on httpx {httpx.__version__}'s "
                               f"{type(transport).__name__}; this httpx keeps no httpcore pool there")
        pool._network_backend = _DeadlineBackend(pool._network_backend)
