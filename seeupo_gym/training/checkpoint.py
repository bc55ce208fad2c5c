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

Runs never mix: a run folder holds one run, named by the run id in its `run_id.json`; every
checkpoint (its own `run_id.json`) and every line of `metrics.jsonl` carries that id.
`open_run_folder` refuses a folder that already holds a run unless the run resumes from one of
that run's own checkpoints.
"""

from __future__ import annotations

import json
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from seeupo_gym.training.config import Config, ConfigError, save_config

CHECKPOINT_PREFIX = "step-"
HF_FOLDER = "hf"
ADAPTER_FOLDER = "adapter"
RUN_FILE = "run_id.json"  # not run.json: a seeupo-compare folder's own record
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FOLDER = "checkpoints"
# What a run writes into its folder (`clear_run_folder` removes exactly these).
RUN_OUTPUTS = (RUN_FILE, METRICS_FILE, "config.yaml", CHECKPOINTS_FOLDER, "logs")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def run_id_of(folder: Path) -> str | None:
    """The run id recorded in a run folder's or a checkpoint's `run_id.json` (None: none recorded)."""
    try:
        return str(json.loads((Path(folder) / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holds_a_run(folder: Path) -> bool:
    """Whether a run folder holds a run's results: a metrics record or a checkpoint."""
    metrics = Path(folder) / METRICS_FILE
    has_metrics = metrics.is_file() and any(line.strip() for line in metrics.read_text().splitlines())
    return has_metrics or bool(checkpoints(Path(folder) / CHECKPOINTS_FOLDER))


def open_run_folder(folder: Path, resume_from: str | None) -> tuple[str, Path | None]:
    """The run id to use in `folder` and the checkpoint to resume from (None: start at step 0).

    - no resume: the folder must hold no run yet (a folder left by a run that died before its
      first step is reused);
    - resume "latest": the newest checkpoint of the run in `folder` (none and no run: step 0);
    - resume PATH: a checkpoint of the run in `folder`, or, in a folder without a run, of any
      run (a new run that starts from it: a fork, with a run id of its own).
    """
    folder = Path(folder)
    taken = holds_a_run(folder)
    folder_id = run_id_of(folder)
    shown = f"run {folder_id}" if folder_id else "a run"
    if resume_from is None:
        if taken:
            raise ConfigError(
                f"run folder {str(folder)!r} already holds {shown}; runs never share a folder. Start a new run "
                f"elsewhere (--out DIR, or log.output_dir=DIR) or continue this one (--resume latest)"
            )
        return new_run_id(), None
    if resume_from == "latest":
        found = checkpoints(folder / CHECKPOINTS_FOLDER)
        if not found:
            if taken:
                raise ConfigError(
                    f"--resume latest: run folder {str(folder)!r} holds {shown} but no checkpoint to resume "
                    f"(train.save_every saves them); start a new run elsewhere (--out DIR)"
                )
            return new_run_id(), None
        path = found[-1]
    else:
        path = Path(resume_from)
        if not path.is_dir():
            raise ConfigError(f"resume_from {resume_from!r} is not a checkpoint folder")
    if not taken:
        return new_run_id(), path
    checkpoint_id = run_id_of(path)
    inside = path.resolve().parent == (folder / CHECKPOINTS_FOLDER).resolve()
    same = checkpoint_id == folder_id if folder_id is not None else inside  # a folder from before run ids
    if not same:
        raise ConfigError(
            f"checkpoint {str(path)!r} belongs to run {checkpoint_id or 'unknown'}, but run folder {str(folder)!r} "
            f"holds {shown}; resume a run in its own folder, or start from the checkpoint in a new one (--out DIR)"
        )
    return folder_id or new_run_id(), path


def write_run_file(folder: Path, run_id: str, **extra: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps({"run_id": run_id, **extra}, indent=2, default=str) + "\n")


def clear_run_folder(folder: Path) -> None:
    """Remove what a run wrote into `folder` (RUN_OUTPUTS), and nothing else."""
    for name in RUN_OUTPUTS:
        path = Path(folder) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def base_model_reference(name_or_path: str) -> str:
    """What an adapter's `base_model_name_or_path` should say so that peft can load the base."""
    if name_or_path == "embedded":
        from seeupo_gym.agents.models import embedded_model_dir

        return str(embedded_model_dir())
    # "tiny" is a seeded random init, not a folder: export_merged gives a loadable model instead.
    return name_or_path


def save_checkpoint(
    accelerator: Any, model: Any, tokenizer: Any, config: Config, root: Path, step: int, run_id: str | None = None
) -> Path:
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
        if run_id is not None:
            write_run_file(partial, run_id, step=step)
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
