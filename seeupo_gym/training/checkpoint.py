"""Checkpoints: one save and load pair for resuming, and the Hugging Face folder users load.

A checkpoint `runs/<run>/checkpoints/step-N/` holds
- accelerate's state (weights, optimizers, RNG states of every process) plus the trainer's
  step and config: `load_checkpoint` resumes from it exactly;
- `config.yaml`, the run's config;
- `hf/`: what `AutoModelForCausalLM.from_pretrained` and vLLM load (config.json, safetensors,
  tokenizer) for full fine-tuning; for LoRA, `adapter/`: the peft adapter with
  `base_model_name_or_path` set to a base that loads (`export_merged` writes a merged folder).

A folder is written as `step-N.partial` and renamed when complete, so a run killed while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from seeupo_gym.training.config import Config, ConfigError, save_config

CHECKPOINT_PREFIX = "step-"
HF_FOLDER = "hf"
ADAPTER_FOLDER = "adapter"


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(root: Path, where: str) -> Path | None:
    """`where` as a folder, or the newest checkpoint under `root` for "latest" (None if there is none)."""
    if where == "latest":
        found = checkpoints(root)
        return found[-1] if found else None
    path = Path(where)
    if not path.is_dir():
        raise ConfigError(f"resume_from {where!r} is not a checkpoint folder")
    return path


def base_model_reference(name_or_path: str) -> str:
    """What an adapter's `base_model_name_or_path` should say so that peft can load the base."""
    if name_or_path == "embedded":
        from seeupo_gym.agents.models import embedded_model_dir

        return str(embedded_model_dir())
    # "tiny" is a seeded random init, not a folder: export_merged gives a loadable model instead.
    return name_or_path


def save_checkpoint(accelerator: Any, model: Any, tokenizer: Any, config: Config, root: Path, step: int) -> Path:
    """Write `root/step-<step>` (see the module doc); every process must call it. Returns the folder."""
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    unwrapped = accelerator.unwrap_model(model)
    is_peft = hasattr(unwrapped, "peft_config")
    # Gathering a sharded state dict is collective: every process takes part.
    state = None if is_peft else accelerator.get_state_dict(model)
    accelerator.wait_for_everyone()  # every process's RNG file is in `partial` before it is renamed
    if accelerator.is_main_process:
        if is_peft:
            unwrapped.save_pretrained(partial / ADAPTER_FOLDER)
            _record_base(partial / ADAPTER_FOLDER, base_model_reference(config.model.name_or_path))
        else:
            unwrapped.save_pretrained(partial / HF_FOLDER, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(partial / HF_FOLDER)
        save_config(config, partial / "config.yaml")
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in checkpoints(root)[: -config.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path) -> None:
    """Restore weights, optimizers, RNG states and the registered trainer state from `path`."""
    accelerator.load_state(str(path))


def _record_base(adapter_dir: Path, base: str) -> None:
    import json

    config_file = adapter_dir / "adapter_config.json"
    data = json.loads(config_file.read_text())
    data["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(data, indent=2) + "\n")


def load_policy(config: Config, checkpoint: str | Path | None = None) -> tuple[Any, Any]:
    """The config's model with a checkpoint's weights (its `hf/` folder or LoRA adapter), in eval mode."""
    from seeupo_gym.agents.models import load_model

    if checkpoint is None:
        return load_model(config.model.name_or_path, dtype=config.model.dtype, seed=config.train.seed)
    folder = Path(checkpoint)
    if (folder / HF_FOLDER).is_dir():
        return load_model(str(folder / HF_FOLDER), dtype=config.model.dtype)
    if (folder / ADAPTER_FOLDER).is_dir():
        from peft import PeftModel

        model, tokenizer = load_model(config.model.name_or_path, dtype=config.model.dtype, seed=config.train.seed)
        model = PeftModel.from_pretrained(model, folder / ADAPTER_FOLDER)
        model.eval()
        return model, tokenizer
    raise ConfigError(f"checkpoint {str(folder)!r} holds neither {HF_FOLDER}/ nor {ADAPTER_FOLDER}/")


def export_merged(config: Config, checkpoint: str | Path, out: str | Path) -> Path:
    """A standalone Hugging Face folder of a checkpoint's policy (a LoRA adapter merged into its base)."""
    model, tokenizer = load_policy(config, checkpoint)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
