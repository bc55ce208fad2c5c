"""The memory plan at start: does a run fit its device, before any weight is loaded?

`seeupo-train` estimates what the learner holds per device from the model's shape (read from its
config.json, or a table of the shapes this project names, never from its weights), the dtype, the
optimizer, LoRA or not, the reference and value models, `max_tokens_per_microbatch`, gradient
checkpointing and the processes, and compares it with the device's memory. A run that cannot fit
is refused in one line naming a setting that would (`device_check`); one that fits logs its plan.

Parts, in bytes per device (b = bytes per element of `model.dtype`):
- weights: every parameter, b each (ModelShape.num_parameters: a dense Llama/Qwen-style decoder).
- reference: full fine-tuning keeps a frozen copy of the weights (with LoRA the reference is the base
  with the adapter off: nothing).
- gradients and AdamW: b per trainable parameter for the gradient and 2 b for its two moments
  (torch's AdamW keeps its states in the parameter's dtype: a bf16 model has bf16 moments and no
  fp32 master copy). DDP adds one gradient-sized bucket copy; FSDP / DeepSpeed divide the policy's
  weights, gradients and states by the processes (the frozen reference copy is not sharded).
- value model (PPO): the critic's own copy of the backbone, its gradients and AdamW states.
- activations of the largest micro-batch, T tokens: on CUDA T = max(max_tokens_per_microbatch,
  env.max_context_tokens), since a sequence longer than the budget is a micro-batch alone; on CPU,
  where long sequences are not packed together, T = env.max_context_tokens.
  `activation_bytes` counts what autograd saves per token and per decoder layer in transformers'
  Qwen2/Llama layer: both RMSNorms (a float32 copy of the input, 4h, plus two b-sized h tensors each),
  q, k (after RoPE), v, the attention output and o_proj's input (b (3 q + 2 kv)), the MLP's gate, its
  SiLU, up and their product (4 b i); with LoRA, 2 bytes per element of each adapted linear's
  input plus 4 r per adapter (peft keeps adapters in float32); for a packed row (several sequences in
  one micro-batch, as on CUDA) the attention mask as b T per token and layer (sdpa converts the
  boolean block mask to an additive one in every layer, T x T). Without checkpointing all layers'
  activations are held at the start of the backward; with it, each layer's input (b h per token)
  plus the boolean mask (T x T bytes, once), and one layer's activations recomputed during its
  backward. The backward adds a workspace of 2 b T (i + h) (the gradients of one layer's widest
  tensors), and the LM head (chunked, LOGIT_CHUNK positions at a time) 3 float32 chunks of logits,
  plus a float32 gradient of the head's weight when it trains.
  Calibration (scripts/memory_calibration.py on one H200, torch 2.11, transformers 5.17, bf16): held
  after the forward, per token and layer, 1.5B full fine-tuning 106.4 KiB + 2 B x T packed (the count
  above: 104.0 + 2 T/1024 KiB), 7B LoRA r=32 326 KiB + 2 B x T (count: 307 + 2 T/1024); with
  checkpointing 4.0 KiB (1.5B, T=16384; count 3.6) and 8.2 KiB (7B; count 7.6). The count is
  multiplied by ACTIVATION_MARGIN to cover what it leaves out (hidden states at the head, RoPE
  tables, the allocator's rounding). Whole updates measured on the same card (the GPU probe:
  1.5B full fine-tuning, 16k-token micro-batches, 85 GiB peak without checkpointing, 22-28 GiB with;
  7B LoRA r=32: out of memory at 139 GiB without, 25-27 GiB with) are met within 20%
  (tests/test_memory_plan.py).
- the colocated vLLM (generation.backend=vllm, `engine_plan`): its share, gpu_memory_utilization x
  the GPU's memory, must hold the weights per tensor-parallel rank, one max_model_len sequence of KV
  cache and ENGINE_OVERHEAD, while the learner's resident memory stays beside it; asleep between
  rollouts it gives its memory back, awake (sleep_level 0) its share comes off the learner's budget.
- not counted: the HF backend's prefix cache (bounded by generation.prefix_cache_mib), CUDA's own
  context, the trunk cache (model.trunk_cache_mib) and memory other processes hold.

The budget: model.memory_budget_gib, else $SEEUPO_MEMORY_BUDGET_GIB, else on CUDA the free memory
the device reports minus RESERVE_FRACTION, on CPU the machine's total memory (psutil): other
programs come and go, and a run beyond the total never fits. model.memory_check: "refuse" (the
default), "warn" or "off".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from seeupo_gym.training.config import Config, ConfigError

logger = logging.getLogger(__name__)

GIB = 1 << 30
BUDGET_ENV = "SEEUPO_MEMORY_BUDGET_GIB"
# The learner's LM-head chunk (agents/scoring.py LOGIT_CHUNK; not imported: that pulls in torch).
LOGIT_CHUNK = 256
# What the per-layer count leaves out (see the module docstring): 1.5B measured 1.02x the count,
# 7B LoRA 1.06x.
ACTIVATION_MARGIN = 1.08
# CUDA: the part of the free memory left to the CUDA context, the allocator's fragmentation and kernels.
RESERVE_FRACTION = 0.05
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MAX_CONFIG_JSON = 1 << 20


class DeviceError(ConfigError):
    """The run needs a device (or memory) this machine does not have; the message is one line."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a dense decoder (Llama / Qwen2 / Qwen3 layout)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    attention_bias: bool = False  # Qwen2: q, k, v have biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of one decoder layer, by name."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_parameters(self) -> int:
        layer = sum(a * b for a, b in self.linears().values()) + 2 * self.hidden_size  # + two RMSNorms
        if self.attention_bias:
            layer += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            layer += 2 * self.head_dim
        return layer

    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * self.layer_parameters() + self.hidden_size  # + the final norm

    def lora_parameters(self, r: int, target_modules: str | list[str] = "all-linear",
                        last_layers: int | None = None) -> int:
        """Trainable parameters of a LoRA adapter of rank r: r (in + out) per adapted linear."""
        return self.lora_layer_parameters(r, target_modules) * min(last_layers or self.num_layers, self.num_layers)

    def lora_layer_parameters(self, r: int, target_modules: str | list[str]) -> int:
        return sum(r * (a + b) for a, b in self.adapted(target_modules).values())

    def adapted(self, target_modules: str | list[str]) -> dict[str, tuple[int, int]]:
        """The linears of a layer a LoRA `target_modules` matches ("all-linear": all but the LM head)."""
        if target_modules == "all-linear":
            return self.linears()
        names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        return {name: shape for name, shape in self.linears().items() if any(name == n.rsplit(".", 1)[-1] for n in names)}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """From a transformers config.json; ValueError for a layout this count does not describe."""
        if any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError("a mixture-of-experts model (the count covers dense decoders)")
        text = config.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in config:
            config = text
        try:
            h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            model_type = str(config.get("model_type", ""))
            return cls(
                hidden_size=h,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or h // heads),
                vocab_size=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type.startswith("qwen3"),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"config.json lacks a dense decoder's sizes ({error})") from None


def _qwen2(h: int, i: int, layers: int, heads: int, kv: int, tied: bool, vocab: int = 151936) -> ModelShape:
    return ModelShape(h, i, layers, heads, kv, h // heads, vocab, tied, attention_bias=True)


def _qwen3(h: int, i: int, layers: int, heads: int, kv: int, tied: bool) -> ModelShape:
    return ModelShape(h, i, layers, heads, kv, 128, 151936, tied, qk_norm=True)


# Shapes of the models this project names, for when their config.json is not on this machine
# (the paper presets' Qwen3-14B on a machine without network). Checked against the real "tiny" and
# against transformers' own parameter counts in tests/test_memory_plan.py.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 128, 2, 2, 1, 32, 151936, True, attention_bias=True),  # agents/models.py tiny_config
    "embedded": _qwen2(896, 4864, 24, 14, 2, True),  # Qwen2.5-Coder-0.5B-Instruct
    "Qwen/Qwen2.5-0.5B": _qwen2(896, 4864, 24, 14, 2, True),
    "Qwen/Qwen2.5-1.5B": _qwen2(1536, 8960, 28, 12, 2, True),
    "Qwen/Qwen2.5-3B": _qwen2(2048, 11008, 36, 16, 2, True),
    "Qwen/Qwen2.5-7B": _qwen2(3584, 18944, 28, 28, 4, False, 152064),
    "Qwen/Qwen2.5-14B": _qwen2(5120, 13824, 48, 40, 8, False, 152064),
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32, 8, True),
    "Qwen/Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8, False),
    "Qwen/Qwen3-14B": _qwen3(5120, 17408, 40, 40, 8, False),
}


def _known(name: str) -> ModelShape | None:
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    # Instruct / Coder variants share their base's shape.
    for suffix in ("-Instruct-2507", "-Instruct", "-Base"):
        if name.endswith(suffix) and name[: -len(suffix)] in KNOWN_SHAPES:
            return KNOWN_SHAPES[name[: -len(suffix)]]
    return None


def model_shape(name_or_path: str) -> tuple[ModelShape | None, str]:
    """The model's shape without its weights, and where it came from (or why it is unknown):
    a local folder's config.json, the Hugging Face cache, the table of known shapes."""
    path = Path(name_or_path)
    candidates: list[Path] = []
    if name_or_path not in ("tiny", "embedded") and path.is_dir():
        candidates.append(path / "config.json")
    elif "/" in name_or_path and not path.exists():
        cached = _hub_cached_config(name_or_path)
        if cached is not None:
            candidates.append(cached)
    for file in candidates:
        try:
            with file.open("rb") as f:
                data = json.loads(f.read(_MAX_CONFIG_JSON + 1)[:_MAX_CONFIG_JSON].decode("utf-8"))
            return ModelShape.from_hf_config(data), str(file)
        except (OSError, ValueError, AttributeError) as error:
            return None, f"{file}: {error}"
    known = _known(name_or_path)
    if known is not None:
        return known, "the table of known shapes"
    return None, f"no config.json for {name_or_path!r} on this machine"


def _hub_cached_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed id: the loader reports it
        return None
    return Path(found) if isinstance(found, str) else None


# --------------------------------------------------------------------------- the estimate


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    gradient_checkpointing: bool,
    dtype_bytes: int,
    lora_r: int | None = None,
    lora_targets: str | list[str] = "all-linear",
    packed: bool = True,
    head_trains: bool = True,
) -> int:
    """Peak bytes of one micro-batch of `tokens` tokens over its forward and backward, beyond the
    weights, gradients and optimizer states (the count of the module docstring)."""
    b, h, q, kv, i, T, L = dtype_bytes, shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size, tokens, shape.num_layers
    per_token_layer = 2 * (4 * h + 2 * b * h) + b * (3 * q + 2 * kv) + 4 * b * i
    if lora_r:
        adapted = shape.adapted(lora_targets)
        per_token_layer += sum(2 * a for a, _ in adapted.values()) + 4 * lora_r * len(adapted)
    if packed:
        per_token_layer += b * T  # the additive T x T mask each layer's attention saves
    layer = ACTIVATION_MARGIN * per_token_layer * T
    if gradient_checkpointing:
        held = b * h * T * L + (T * T if packed else 0) + layer  # layer inputs, the boolean mask, one layer
    else:
        held = layer * L
    backward = 2 * b * T * (i + h)
    head = 3 * 4 * LOGIT_CHUNK * shape.vocab_size + (4 * shape.vocab_size * h if head_trains else 0)
    return int(held + backward + head)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}" if value >= GIB else f"{value / GIB:.2f}"


@dataclasses.dataclass
class MemoryPlan:
    """The estimate of one device's memory for a run's learner, by part (bytes)."""

    model: str
    device: str
    parts: dict[str, int]
    tokens: int  # the largest micro-batch
    budget: int | None = None
    budget_source: str = ""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def describe(self) -> str:
        parts = ", ".join(f"{name} {_gib(value)}" for name, value in self.parts.items() if value)
        budget = f" of {_gib(self.budget)} GiB ({self.budget_source})" if self.budget is not None else ""
        return f"~{_gib(self.total)} GiB{budget} on {self.device} ({parts} GiB; micro-batches of {self.tokens} tokens)"


def plan_memory(
    config: Config,
    shape: ModelShape,
    *,
    device: str = "cuda",
    processes: int = 1,
    sharded: bool = False,
    needs_value_model: bool = False,
) -> MemoryPlan:
    """The plan for `config` on one device of `processes` (sharded: FSDP / DeepSpeed)."""
    m = config.model
    b = _DTYPE_BYTES[m.dtype]
    n = shape.num_parameters()
    lora = m.lora
    trainable = shape.lora_parameters(lora.r, lora.target_modules, lora.last_layers) if lora else n
    share = processes if sharded and processes > 1 else 1
    parts = {
        "weights": n * b // share,
        "reference": 0 if lora else n * b,
        "gradients": trainable * b // share,
        "AdamW": 2 * trainable * b // share,
    }
    if processes > 1 and not sharded:
        parts["DDP buckets"] = trainable * b
    if needs_value_model:
        head = 0 if shape.tied_embeddings else shape.vocab_size * shape.hidden_size
        critic_trainable = trainable if lora else n - head
        parts["value model"] = (n - head) * b + 3 * critic_trainable * b // share
    # On CUDA sequences are packed up to the budget; on CPU a sequence of PER_ROW_MIN_TOKENS (256) or
    # more runs alone (learner.py), so the longest sequence, at most the context budget, is the largest.
    packed = device == "cuda"
    context = config.env.max_context_tokens
    tokens = max(m.max_tokens_per_microbatch, context) if packed else max(min(m.max_tokens_per_microbatch, 256), context)
    parts["activations"] = activation_bytes(
        shape, tokens, gradient_checkpointing=m.gradient_checkpointing, dtype_bytes=b,
        lora_r=lora.r if lora else None, lora_targets=lora.target_modules if lora else "all-linear",
        packed=packed, head_trains=lora is None,
    )
    return MemoryPlan(model=m.name_or_path, device=device, parts=parts, tokens=tokens)


def device_budget(config: Config, device: str, index: int | None = None) -> tuple[int | None, str]:
    """Bytes the plan may count on per device (CUDA: device `index`, this process's), and where the
    figure comes from."""
    if config.model.memory_budget_gib is not None:
        return int(config.model.memory_budget_gib * GIB), "model.memory_budget_gib"
    text = os.environ.get(BUDGET_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"${BUDGET_ENV} is {text!r}; give GiB as a number, e.g. 40") from None
        if not value > 0:
            raise ConfigError(f"${BUDGET_ENV} must be > 0 GiB, got {value}")
        return int(value * GIB), f"${BUDGET_ENV}"
    if device == "cuda":
        import torch

        # This process's own GPU: asking for the current one would open a context on GPU 0 from every rank.
        free, total = torch.cuda.mem_get_info(index if index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0))
        budget = int(free - RESERVE_FRACTION * total)
        if config.generation.backend == "vllm" and config.generation.sleep_level == 0:
            # vLLM awake between rollouts keeps its share of the device.
            return int(budget - config.generation.gpu_memory_utilization * total), \
                f"free on the GPU less {RESERVE_FRACTION:.0%} and vLLM's generation.gpu_memory_utilization"
        return budget, f"free on the GPU less {RESERVE_FRACTION:.0%}"
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().total), "this machine's memory"
    return None, f"no memory figure for device {device}"


# --------------------------------------------------------------------------- what would fit


def _fits(config: Config, shape: ModelShape, budget: int, **where: Any) -> bool:
    return plan_memory(config, shape, **where).total <= budget


def suggestion(config: Config, shape: ModelShape, budget: int, **where: Any) -> str:
    """The first setting, in order of least change, under which the plan fits `budget`."""
    m = config.model

    def changed(**model: Any) -> Config:
        return dataclasses.replace(config, model=dataclasses.replace(m, **model))

    gc = m.gradient_checkpointing
    if not gc and _fits(changed(gradient_checkpointing=True), shape, budget, **where):
        return "turn on model.gradient_checkpointing"
    floor = config.env.max_context_tokens  # a sequence is never split: the budget cannot go below it
    for tokens in (16384, 12288, 8192, 6144, 4096, 3072, 2048, 1024):
        if floor <= tokens < m.max_tokens_per_microbatch and _fits(
                changed(gradient_checkpointing=True, max_tokens_per_microbatch=tokens), shape, budget, **where):
            prefix = "" if gc else "turn on model.gradient_checkpointing and "
            return f"{prefix}set model.max_tokens_per_microbatch <= {tokens}"
    if m.lora is None:
        from seeupo_gym.training.config import LoraConfig

        if _fits(changed(gradient_checkpointing=True, lora=LoraConfig(r=16, alpha=32)), shape, budget, **where):
            return "use LoRA (model.lora={r: 16, alpha: 32}) with model.gradient_checkpointing=true"
    if m.dtype == "float32" and _fits(changed(gradient_checkpointing=True, dtype="bfloat16"), shape, budget, **where):
        return "use model.dtype=bfloat16 with model.gradient_checkpointing=true"
    if where.get("device", "cuda") != "cuda":
        return "run it on a GPU machine, or pick a smaller model"
    best = changed(gradient_checkpointing=True)
    # Weight sync from sharded training into a colocated vLLM is not implemented (agents/backends/vllm.py).
    if config.generation.backend != "vllm":
        for processes in (2, 4, 8, 16, 32, 64):
            if _fits(best, shape, budget, **{**where, "processes": processes, "sharded": True}):
                return (f"shard over {processes} GPUs (accelerate launch --use_fsdp --num_processes {processes}) "
                        "with model.gradient_checkpointing=true")
    return "a smaller model or a GPU with more memory"


# --------------------------------------------------------------------------- the check at start


def check_device_request(config: Config) -> None:
    """Before the accelerator exists: the device the config asks for is there, and so is the
    generation engine it names. Raises DeviceError (one line)."""
    import torch

    wanted = config.train.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise DeviceError("train.device is cuda but this machine has no CUDA GPU visible (torch "
                          f"{torch.__version__}); run it on a GPU machine, or set train.device=cpu with a model that fits")
    if config.generation.backend == "vllm":
        if not vllm_installed():
            raise DeviceError("generation.backend is vllm but vLLM is not installed here; install it (pip install "
                              "'seeupo-gym[vllm]', GPU machines) or use generation.backend=hf")
        if not torch.cuda.is_available() and not _vllm_is_cpu_build():
            raise DeviceError("generation.backend is vllm but this machine has no CUDA GPU and the installed vLLM is "
                              "a CUDA build; run it on a GPU machine or use generation.backend=hf")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _vllm_is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:  # a source checkout on the path: let vLLM say what it is
        return True


def check_memory_early(config: Config) -> MemoryPlan | None:
    """`device_check` before the accelerator exists (seeupo-train, before the model is fetched):
    the device and layout accelerate will pick, read from torch and accelerate's launch variables."""
    import torch

    from seeupo_gym.algorithms.base import algorithm_class

    cuda = config.train.device != "cpu" and torch.cuda.is_available()
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    sharded = any(os.environ.get(key, "").lower() in ("1", "true")
                  for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    try:
        needs_value_model = bool(getattr(algorithm_class(config.algorithm.name), "needs_value_model", False))
    except ValueError:  # a plug-in's algorithm, not loaded yet: the trainer's own check covers it
        needs_value_model = False
    return device_check(config, device="cuda" if cuda else "cpu", processes=processes, sharded=sharded,
                        needs_value_model=needs_value_model, log=False)


def device_check(config: Config, *, device: str, index: int | None = None, processes: int = 1,
                 sharded: bool = False, needs_value_model: bool = False, log: bool = True) -> MemoryPlan | None:
    """The memory plan of `config` on this machine's `device`; refuses (DeviceError, one line) a run
    that cannot fit when model.memory_check is "refuse", and logs the plan otherwise."""
    if config.model.memory_check == "off":
        return None
    shape, source = model_shape(config.model.name_or_path)
    if shape is None:
        if log:
                logger.info("memory plan: skipped, the shape of %s is unknown (%s)", config.model.name_or_path, source)
        return None
    where = {"device": device, "processes": processes, "sharded": sharded, "needs_value_model": needs_value_model}
    plan = plan_memory(config, shape, **where)
    plan.budget, plan.budget_source = device_budget(config, device, index)
    engine_line = _engine_check(config, shape, plan, device, index)
    if plan.fits and engine_line is None:
        if log:
            logger.info("memory plan: %s %s", config.model.name_or_path, plan.describe())
        return plan
    if plan.fits:  # the learner fits; the colocated vLLM's share does not
        if config.model.memory_check == "warn":
            if log:
                logger.warning("%s", engine_line)
            return plan
        raise DeviceError(engine_line)
    fix = suggestion(config, shape, plan.budget, **where)
    what = f"LoRA r={config.model.lora.r}" if config.model.lora else "full fine-tuning"
    line = (f"memory plan: {config.model.name_or_path} ({what}, {config.model.dtype}) needs {plan.describe()}: "
            f"it does not fit; {fix} (model.memory_check=warn runs it anyway)")
    if config.model.memory_check == "warn":
        if log:
            logger.warning("%s", line)
        return plan
    raise DeviceError(line)



# --------------------------------------------------------------------------- the colocated vLLM


def _engine_check(config: Config, shape: ModelShape, learner: MemoryPlan, device: str, index: int | None) -> str | None:
    """On CUDA with generation.backend=vllm: the refusal line when vLLM's share cannot hold the model."""
    if config.generation.backend != "vllm" or device != "cuda":
        return None
    import torch

    device_index = index if index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
    total = int(torch.cuda.mem_get_info(device_index)[1])
    fix = engine_fix(config, shape, learner, total, torch.cuda.device_count())
    if fix is None:
        return None
    return (f"memory plan: {config.model.name_or_path}: {engine_plan(config, shape, total).describe()}: vLLM cannot "
            f"start beside the learner; {fix} (model.memory_check=warn runs it anyway)")

# What vLLM holds beyond the weights and the KV cache, per GPU: its profile run's activations, CUDA
# graphs and memory outside torch's allocator. An allowance, not a measurement of ours.
ENGINE_OVERHEAD = 2 * GIB
# Steps in which a suggested gpu_memory_utilization is rounded up, and the most one is ever told.
_UTILIZATION_STEP = 0.05
_UTILIZATION_MAX = 0.95


@dataclasses.dataclass
class EnginePlan:
    """A colocated vLLM on one GPU of `gpu_memory` bytes: its share against what it must hold (bytes,
    per tensor-parallel rank)."""

    utilization: float
    gpu_memory: int
    tensor_parallel: int
    weights: int
    kv_cache: int  # one max_model_len sequence: the least vLLM starts with
    max_model_len: int
    overhead: int = ENGINE_OVERHEAD

    @property
    def share(self) -> int:
        return int(self.utilization * self.gpu_memory)

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    @property
    def fits(self) -> bool:
        return self.need <= self.share

    def describe(self) -> str:
        rank = f" per rank of {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return (f"vLLM's share {self.utilization:g} x {_gib(self.gpu_memory)} GiB = {_gib(self.share)} GiB per GPU against "
                f"the weights {_gib(self.weights)} GiB{rank} + a KV cache of one {self.max_model_len}-token sequence "
                f"{_gib(self.kv_cache)} GiB + {_gib(self.overhead)} GiB for activations and CUDA graphs = {_gib(self.need)} GiB")


def engine_plan(config: Config, shape: ModelShape, gpu_memory: int, tensor_parallel: int | None = None) -> EnginePlan:
    """What a colocated vLLM needs per GPU, at generation.gpu_memory_utilization (or another TP size)."""
    g = config.generation
    tp = tensor_parallel or g.tensor_parallel_size
    b = _DTYPE_BYTES[config.model.dtype]
    length = g.max_model_len or config.env.max_context_tokens
    kv_heads = max(1, -(-shape.num_kv_heads // tp))  # vLLM splits KV heads over ranks, replicating below one each
    kv = 2 * shape.num_layers * kv_heads * shape.head_dim * b * length
    return EnginePlan(utilization=g.gpu_memory_utilization, gpu_memory=gpu_memory, tensor_parallel=tp,
                      weights=shape.num_parameters() * b // tp, kv_cache=kv, max_model_len=length)


def _resident(plan: MemoryPlan) -> int:
    """What the learner keeps on its GPU while vLLM generates (gradients are freed after each step)."""
    return sum(v for k, v in plan.parts.items() if k not in ("activations", "gradients", "DDP buckets"))


def _utilization_for(need: int, gpu_memory: int) -> float:
    steps = -(-need // int(_UTILIZATION_STEP * gpu_memory))
    return round(steps * _UTILIZATION_STEP, 2)


def engine_fix(config: Config, shape: ModelShape, learner: MemoryPlan | None, gpu_memory: int, gpus: int) -> str | None:
    """None when the colocated vLLM fits beside the learner (None: the engine alone, for a learner that
    must change first); else the first setting that fits: a larger generation.gpu_memory_utilization,
    then tensor parallelism, else a bigger GPU."""
    usable = int(gpu_memory * (1 - RESERVE_FRACTION))
    engine = engine_plan(config, shape, gpu_memory)
    resident = _resident(learner) if learner is not None else 0
    if engine.fits and resident + engine.share <= usable:
        return None
    for tp in (engine.tensor_parallel, 2, 4, 8):
        if tp < engine.tensor_parallel or shape.num_heads % tp:
            continue
        need = engine_plan(config, shape, gpu_memory, tp).need
        u = max(_utilization_for(need, gpu_memory), config.generation.gpu_memory_utilization)
        if u <= _UTILIZATION_MAX and resident + int(u * gpu_memory) <= usable:
            setting = f"generation.gpu_memory_utilization={u:g}"
            if tp != engine.tensor_parallel:
                setting = (f"generation.tensor_parallel_size={tp} (one training process over {tp} GPUs"
                           f"{'' if tp <= gpus else f', --gpus {tp}'}) with {setting}")
            return f"set {setting}"
    return "use a smaller model or a GPU with more memory (generation.backend=hf needs no share)"


def plan_report(config: Config, *, gpus: int, gpu_memory_gib: float, needs_value_model: bool = False) -> tuple[list[str], bool]:
    """The memory plan of `config` on `gpus` GPUs of `gpu_memory_gib` GiB each, with no device at hand
    (seeupo-train --plan-only): the learner per GPU and, with generation.backend=vllm, the colocated
    engine's share. Lines to print, and whether the run fits."""
    shape, source = model_shape(config.model.name_or_path)
    if shape is None:
        raise ConfigError(f"the shape of {config.model.name_or_path} is unknown ({source}); give a local folder "
                          "with its config.json as model.name_or_path")
    g = config.generation
    vllm = g.backend == "vllm"
    if vllm and g.tensor_parallel_size > gpus:
        raise ConfigError(f"generation.tensor_parallel_size={g.tensor_parallel_size} needs that many GPUs; --gpus is {gpus}")
    processes = 1 if vllm and g.tensor_parallel_size > 1 else gpus  # each engine of TP > 1 has one training process
    gpu_memory = int(gpu_memory_gib * GIB)
    usable = int(gpu_memory * (1 - RESERVE_FRACTION))
    awake = vllm and g.sleep_level == 0
    learner = plan_memory(config, shape, device="cuda", processes=processes, needs_value_model=needs_value_model)
    learner.budget = usable - (int(g.gpu_memory_utilization * gpu_memory) if awake else 0)
    learner.budget_source = f"{gpu_memory_gib:g} GiB less {RESERVE_FRACTION:.0%}" + (" and vLLM's awake share" if awake else "")
    what = f"LoRA r={config.model.lora.r}" if config.model.lora else "full fine-tuning"
    lines = [f"memory plan: {config.model.name_or_path} ({what}, {config.model.dtype}; shape from {source}) on "
             f"{gpus} GPU(s) of {gpu_memory_gib:g} GiB, {processes} training process(es)"]
    fits = learner.fits
    verdict = "fits"
    if not fits:
        fix = suggestion(config, shape, learner.budget, device="cuda", processes=processes, needs_value_model=needs_value_model)
        if awake and plan_memory(config, shape, device="cuda", processes=processes,
                                 needs_value_model=needs_value_model).total <= usable:
            fix = "set generation.sleep_level=1 (vLLM gives its memory back while the learner trains)"
        verdict = f"does not fit; {fix}"
    lines.append(f"  learner: {learner.describe()}: {verdict}")
    if vllm:
        engine = engine_plan(config, shape, gpu_memory)
        fix = engine_fix(config, shape, learner if learner.fits else None, gpu_memory, gpus)
        verdict = "fits" if fix is None else f"does not fit; {fix}"
        mode = "awake between rollouts" if awake else f"asleep while the learner trains (sleep_level {g.sleep_level})"
        lines.append(f"  vLLM, colocated, {mode}: {engine.describe()}: {verdict}")
        lines.append(f"  while vLLM generates: the learner's resident {_gib(_resident(learner))} GiB (weights, reference, "
                     f"optimizer states) + vLLM's share {_gib(engine.share)} GiB of {_gib(usable)} GiB")
        fits = fits and fix is None
    lines.append(f"plan: {'fits' if fits else 'does not fit'}")
    return lines, fits
