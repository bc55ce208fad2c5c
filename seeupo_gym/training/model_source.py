"""What an evaluation runs: a model loaded here (a name or a checkpoint) or one behind a server.

`seeupo-eval` builds one `ModelSource` from its flags, `seeupo-compare --model LABEL=SPEC` one per
label; both then score it with `evaluate_source`, so a model gets the same numbers whichever
command asked (same tasks, seeds, chunking, sampling and env).
"""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from seeupo_gym.agents.backends.server_check import ServerCheckError, check_server, public_url
from seeupo_gym.training.config import Config, ConfigError

__all__ = ["ModelSource", "OpenModel", "ServerCheckError", "check_model_source", "check_training_server", "evaluate_source", "public_url"]

# seeupo-eval's response budget when no config says otherwise: a random or untrained model
# rarely stops by itself, and the training default (1024 per turn, 10 turns) keeps a CPU busy
# for many minutes per episode.
EVAL_MAX_NEW_TOKENS = 256
# Seconds to wait for the Hugging Face hub when checking a model name.
HUB_TIMEOUT_S = 5.0
_MODEL_HINT = "use 'embedded' (the offline Qwen2.5-Coder-0.5B-Instruct), 'tiny', or a local folder"
SERVER_MODES = ("chat", "tokens")
EVAL_HINT = "fewer tasks (--max-tasks), rollouts (-n, -k), turns (env max_turns) or tokens (--max-new-tokens) shorten it"
# NAME@URL: the first '@' that starts an http(s) URL (a URL may hold '@' itself, a name seldom does).
SERVED_SPEC = re.compile(r"^(?P<name>[^@]+?)@(?P<url>https?://\S+)$")


def check_model_source(name: str) -> None:
    """Fail within seconds, in one line, for a model name that cannot load.

    Without this an unknown hub id costs a minute or two of retries and a 30-frame traceback
    (more when the hub is unreachable). A model in the local cache loads offline when the hub
    cannot be reached (HF_HUB_OFFLINE is set for this process, which `load_model` honours).
    """
    if name in ("tiny", "embedded") or Path(name).expanduser().exists():
        return
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except HFValidationError:
        raise ConfigError(f"model {name!r} is not a local folder, nor a Hugging Face id; {_MODEL_HINT}") from None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        if cached:
            return
        raise ConfigError(f"model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {_MODEL_HINT}")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        if not cached:
            raise ConfigError(f"model {name!r} is gated: accept its terms on the hub and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"no model {name!r} on the Hugging Face hub (or it is private); {_MODEL_HINT}") from None
    except Exception as error:  # connection refused, DNS, timeout: the hub is out of reach
        if not cached:
            raise ConfigError(
                f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached "
                f"({type(error).__name__}); {_MODEL_HINT}"
            ) from None
        os.environ["HF_HUB_OFFLINE"] = "1"  # load from the cache without a round of retries


@dataclass
class ModelSource:
    """A model to evaluate: `name` loaded here (with `checkpoint`'s weights), or served at `base_url`.

    Server settings: `mode` chat (messages and tools, any API model) or tokens (token ids and
    logprobs, vLLM's completions extensions, with `tokenizer`); the API key is read from the
    environment variable `api_key_env` when the backend is built and is never stored here.
    Deadlines: `request_timeout_s` for each attempt of a request (connection, headers and body
    together), `episode_timeout_s` for a whole chat episode, every turn and retry included.
    """

    name: str
    checkpoint: str | None = None
    base_url: str | None = None
    api_key_env: str | None = "OPENAI_API_KEY"
    mode: str = "chat"
    tokenizer: str | None = None
    concurrency: int = 8
    request_timeout_s: float = 120.0
    episode_timeout_s: float = 1800.0

    @property
    def served(self) -> bool:
        return self.base_url is not None

    def describe(self) -> str:
        """One line saying what this is; no key, and the URL without credentials."""
        if self.served:
            return f"{self.name} at {public_url(self.base_url or '')} ({self.mode} mode)"
        return f"{self.name} @ {self.checkpoint}" if self.checkpoint else self.name

    def check(self) -> None:
        """Checks that take seconds at most (ConfigError); loading comes later."""
        if not self.name:
            raise ConfigError("the model name is empty")
        if self.served:
            if self.checkpoint:
                raise ConfigError("a served model is evaluated on its server; load the checkpoint into the server instead")
            if urlsplit(self.base_url or "").scheme not in ("http", "https") or not urlsplit(self.base_url or "").hostname:
                raise ConfigError(f"server URL {public_url(self.base_url or '')!r} is not an http(s) URL, "
                                  "e.g. http://127.0.0.1:8000/v1")
            if self.mode not in SERVER_MODES:
                raise ConfigError(f"server mode must be one of {SERVER_MODES}, got {self.mode!r}")
            if self.mode == "tokens" and not self.tokenizer:
                raise ConfigError("tokens mode needs the served model's tokenizer ('tiny', 'embedded', an id or a path)")
            if int(self.concurrency) < 1:
                raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
            for name in ("request_timeout_s", "episode_timeout_s"):
                if not float(getattr(self, name)) > 0:  # NaN fails too
                    raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
            return
        if self.checkpoint is not None:
            from seeupo_gym.training.checkpoint import HF_FOLDER

            if not Path(self.checkpoint).is_dir():
                raise ConfigError(f"checkpoint {self.checkpoint!r} is not a folder (expected e.g. runs/x/checkpoints/step-10)")
            if (Path(self.checkpoint) / HF_FOLDER).is_dir():
                return  # a full model: the base name is not needed
        check_model_source(self.name)

    def open(self, config: Config) -> "OpenModel":
        """The backend (and tokenizer) to evaluate with; `config` gives the local model's settings."""
        if self.served:
            backend, tokenizer = _server_backend(self)
            try:
                check_server(backend)  # a dead or mistyped URL: one line now, not a 0.000 score later
            except BaseException:
                backend.close()
                raise
            return OpenModel(self, backend, tokenizer, model=None)
        from seeupo_gym.agents.backends import HFBackend
        from seeupo_gym.training.checkpoint import load_policy

        config.model.name_or_path = self.name
        model, tokenizer = load_policy(config, self.checkpoint)
        return OpenModel(self, HFBackend(model, tokenizer), tokenizer, model=model)


@dataclass
class OpenModel:
    """A ModelSource ready to generate; `close` frees its weights or connections."""

    source: ModelSource
    backend: Any
    tokenizer: Any
    model: Any = None

    @property
    def on_cpu(self) -> bool:
        """Whether generation runs on this machine's CPU (a served model runs on the server's hardware)."""
        return self.model is not None and next(self.model.parameters()).device.type == "cpu"

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()
        self.backend = self.model = None
        gc.collect()


def check_training_server(config: Config) -> None:
    """`generation.backend: openai` with a `generation.base_url` of the user's: the server answers
    (`check_server`), before a comparison starts its first run. A trainer checks its own at start."""
    generation = config.generation
    if generation.backend != "openai" or not generation.base_url or generation.serve:
        return
    from seeupo_gym.agents.backends.openai import OpenAIBackend

    backend = OpenAIBackend(generation.base_url, generation.served_model or config.model.name_or_path,
                            api_key_env=generation.api_key_env)
    try:
        check_server(backend)
    finally:
        backend.close()


def _server_backend(source: ModelSource) -> tuple[Any, Any]:
    """The OpenAIBackend of a served model (and, in tokens mode, the tokenizer contexts are kept in)."""
    from seeupo_gym.agents.backends.openai import OpenAIBackend

    tokenizer = None
    vocab_size = None
    stop_ids: tuple[int, ...] = ()
    if source.mode == "tokens":
        from seeupo_gym.agents.models import load_tokenizer

        tokenizer = load_tokenizer(source.tokenizer)
        vocab_size = len(tokenizer)
        stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    backend = OpenAIBackend(source.base_url or "", source.name, mode=source.mode, api_key_env=source.api_key_env,
                            vocab_size=vocab_size, stop_token_ids=stop_ids, max_concurrency=int(source.concurrency),
                            timeout_s=float(source.request_timeout_s), episode_timeout_s=float(source.episode_timeout_s))
    return backend, tokenizer


def evaluate_source(
    opened: OpenModel,
    config: Config,
    tasks: Sequence[str],
    *,
    env_kwargs: dict[str, Any],
    k: int,
    n: int,
    temperature: float | None,
    max_new_tokens: int,
    seed: int,
    num_envs: int | None = None,
    progress: bool = True,
    keep_rollouts: bool = False,
    program: str = "seeupo-eval",
    slow_hint: str = EVAL_HINT,
    desc: str = "eval",
) -> Any:
    """`evaluation.evaluate_policy` of an opened model with the config's env and sampling settings.

    `num_envs` (episodes in flight) defaults to the server's concurrency for a served model, else
    `env.num_envs`; it sets the chunking of tasks and so the seeds of the draws.
    """
    from seeupo_gym.training.evaluation import evaluate_policy
    from seeupo_gym.training.tasks import agent_options

    source = opened.source
    on_cpu = opened.on_cpu
    if on_cpu:
        warn_if_long(opened.model, len(tasks) * n, env_kwargs, max_new_tokens, program, slow_hint)
    result = evaluate_policy(
        opened.backend,
        opened.tokenizer,
        config.env.id,
        tasks,
        k=k,
        n=n,
        temperature=config.sampling.temperature if temperature is None else temperature,
        top_p=config.sampling.top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        num_envs=num_envs or (int(source.concurrency) if source.served else config.env.num_envs),
        max_context_tokens=config.env.max_context_tokens,
        env_kwargs=env_kwargs,
        progress=progress,
        keep_rollouts=keep_rollouts,
        agent_options=agent_options(config.env),
        warn_slow=program if on_cpu else None,
        desc=desc,
    )
    result.model = source.name
    result.checkpoint = source.checkpoint
    return result


def warn_if_long(
    model: Any, episodes: int, env_kwargs: dict, max_new_tokens: int, program: str = "seeupo-eval", hint: str = EVAL_HINT
) -> bool:
    """Print the token-budget warning when it applies; returns whether the model runs on a CPU."""
    import sys

    from seeupo_gym.training.evaluation import cpu_tokens_per_second, episode_turns, long_run_warning, token_budget

    parameters = sum(p.numel() for p in model.parameters())
    on_cpu = next(model.parameters()).device.type == "cpu"
    warning = long_run_warning(
        program,
        token_budget(episodes, episode_turns(env_kwargs), max_new_tokens),
        cpu_tokens_per_second(parameters),
        on_cpu=on_cpu,
        hint=hint,
    )
    if warning:
        print(warning, file=sys.stderr)
    return on_cpu
