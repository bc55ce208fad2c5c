"""Checkpoints: one save and load pair for resuming, and the Hugging Face folder users load.

A checkpoint `runs/<run>/checkpoints/step-N/` holds
- accelerate's state (weights in safetensors; optimizers and RNG states of every process, which
  accelerate loads with `torch.load(weights_only=True)`) and `trainer_state.json` (the trainer's
  step, config and run id, the algorithm's state): `load_checkpoint` resumes from it exactly;
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

A checkpoint folder may come from someone else: loading one never runs a pickle's code. Torch
state is read with `torch.load(weights_only=True)`; nothing is registered with accelerate's
`register_for_checkpointing`, whose `custom_checkpoint_N.pkl` it loads with `weights_only=False`;
a folder holding such a file (written
by seeupo-gym before trainer_state.json), a DeepSpeed pickle, or a torch.distributed.checkpoint
`.metadata` holding more than DCP's own metadata classes is refused with one line before
anything is read.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from seeupo_gym.training.config import Config, ConfigError, save_config
from seeupo_gym.training.run_files import refuse_links, write_run_text

CHECKPOINT_PREFIX = "step-"
HF_FOLDER = "hf"
ADAPTER_FOLDER = "adapter"
RUN_FILE = "run_id.json"  # not run.json: a seeupo-compare folder's own record
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FOLDER = "checkpoints"
# What a run writes into its folder (`clear_run_folder` removes exactly these).
RUN_OUTPUTS = (RUN_FILE, METRICS_FILE, "config.yaml", CHECKPOINTS_FOLDER, "logs")
TRAINER_STATE_FILE = "trainer_state.json"
_TRAINER_STATE_MAX_BYTES = 16 << 20  # a config and a few numbers; never a reason to read a huge file


class CheckpointError(ConfigError):
    """A checkpoint folder that cannot be resumed (one line: which folder, which file, why)."""


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
    if folder.is_dir():
        refuse_links(folder)  # before anything in it is read (`run_files.py`)
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
    write_run_text(folder / RUN_FILE, json.dumps({"run_id": run_id, **extra}, indent=2, default=str) + "\n")


def clear_run_folder(folder: Path) -> None:
    """Remove what a run wrote into `folder` (RUN_OUTPUTS), and nothing else."""
    for name in RUN_OUTPUTS:
        path = Path(folder) / name
        if path.is_dir() and not path.is_symlink():  # a link goes, never what it points at
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
    accelerator: Any, model: Any, tokenizer: Any, config: Config, root: Path, step: int, run_id: str | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write `root/step-<step>` (see the module doc); every process must call it. Returns the folder.

    trainer_state: what `load_checkpoint` returns on resume (plain JSON values)."""
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
        write_run_text(partial / TRAINER_STATE_FILE, json.dumps(trainer_state or {}, indent=1) + "\n")
        if run_id is not None:
            write_run_file(partial, run_id, step=step)
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in checkpoints(root)[: -config.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path) -> dict[str, Any]:
    """Restore weights, optimizers and RNG states from `path`; returns its trainer state
    (`save_checkpoint`'s trainer_state). Never unpickles: see the module doc."""
    from accelerate.utils import load as restricted_load

    path = Path(path)
    refuse_links(path)  # a fork's checkpoint may lie outside the run folder, which was checked
    refuse_pickles(path)
    state = read_trainer_state(path)
    # accelerate swallows a failure to load the RNG states (a resumed run would silently differ):
    # the same restricted load here first turns one into an error.
    rng = path / f"random_states_{accelerator.process_index}.pkl"
    if rng.is_file():
        try:
            restricted_load(rng)
        except Exception as error:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rng.name} (RNG states) does not load as plain tensor "
                                  f"data, refused: {_first_line(error)}") from error
    try:
        accelerator.load_state(str(path))
    except (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError, EOFError, OSError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r} does not load (weights, optimizer or RNG states; only "
                              f"plain tensor data is accepted): {_first_line(error)}") from error
    return state


# Files only a full unpickler reads: accelerate's registered objects (weights_only=False) and
# DeepSpeed's checkpoint files are refused; torch.distributed.checkpoint's `.metadata` (FSDP2's
# default sharded save, read with pickle.load) is checked first by `_DcpMetadataUnpickler`.
_PICKLED = re.compile(r"^(custom_checkpoint_\d+\.pkl|\.metadata|.*_optim_states\.pt|mp_rank_.*\.pt)$")
_DCP_METADATA = ".metadata"
_DCP_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
})


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of (its dataclasses, torch sizes, dtypes and layouts,
    paths): any other global, the only way a pickle runs code, is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def refuse_pickles(path: Path) -> None:
    """Raise CheckpointError if `path` holds a file that resuming would unpickle beyond plain data."""
    for file in sorted(Path(path).rglob("*")):
        if not _PICKLED.match(file.name):
            continue
        relative = file.relative_to(path)
        if file.name == _DCP_METADATA:
            try:
                with file.open("rb") as f:
                    _DcpMetadataUnpickler(f).load()
                continue
            except Exception as error:  # anything but DCP's own metadata: refused, whatever the reason
                why = (f"{relative} (torch.distributed.checkpoint's metadata) holds more than DCP's metadata, refused "
                       f"since a pickle runs code: {_first_line(error)}")
        elif file.name.startswith("custom_checkpoint_"):
            weights = path / HF_FOLDER if (path / HF_FOLDER).is_dir() else f"<the folder `seeupo-export {path} OUT` writes>"
            why = (f"{relative} is trainer state in a pickle (seeupo-gym before {TRAINER_STATE_FILE}), which resume "
                   f"never loads since a pickle runs code; start a new run from its weights instead "
                   f"(model.name_or_path={weights})")
        else:
            why = (f"{relative} is a DeepSpeed checkpoint's pickle, which resume never loads since a pickle runs "
                   f"code; save with FSDP or one process instead")
        raise CheckpointError(f"checkpoint {str(path)!r}: {why}")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The checkpoint's `trainer_state.json`: {"trainer": {"step": N, ...}, "algorithm": {...}}."""
    file = Path(path) / TRAINER_STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} holds no {TRAINER_STATE_FILE} (not a checkpoint of this "
                              f"trainer, or an unfinished one)")
    try:
        with file.open("rb") as f:
            text = f.read(_TRAINER_STATE_MAX_BYTES + 1)
        if len(text) > _TRAINER_STATE_MAX_BYTES:
            raise ValueError(f"over {_TRAINER_STATE_MAX_BYTES} bytes")
        state = json.loads(text)
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE_FILE} is not readable JSON: "
                              f"{_first_line(error)}") from error
    trainer = state.get("trainer") if isinstance(state, dict) else None
    step = trainer.get("step") if isinstance(trainer, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(state.get("algorithm", {}), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE_FILE} must hold "
                              '{"trainer": {"step": N >= 0, ...}, "algorithm": {...}}')
    return state


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


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
        _require_safetensors(folder, HF_FOLDER, "model")
        return load_model(str(folder / HF_FOLDER), dtype=config.model.dtype)
    if (folder / ADAPTER_FOLDER).is_dir():
        from peft import PeftModel

        _require_safetensors(folder, ADAPTER_FOLDER, "adapter_model")
        model, tokenizer = load_model(config.model.name_or_path, dtype=config.model.dtype, seed=config.train.seed)
        model = PeftModel.from_pretrained(model, folder / ADAPTER_FOLDER)
        model.eval()
        return model, tokenizer
    raise ConfigError(f"checkpoint {str(folder)!r} holds neither {HF_FOLDER}/ nor {ADAPTER_FOLDER}/")


def _require_safetensors(folder: Path, sub: str, stem: str) -> None:
    """A checkpoint's weights are safetensors only (what `save_checkpoint` writes): transformers and
    peft would otherwise fall back to a pickled `.bin`, and a checkpoint may come from anyone."""
    pickled = sorted(p.name for p in (folder / sub).iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
    if pickled:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {sub}/{pickled[0]} is a pickle, which is never loaded "
                              f"since a pickle runs code; a checkpoint's weights are safetensors ({sub}/{stem}.safetensors)")


def export_merged(config: Config, checkpoint: str | Path, out: str | Path) -> Path:
    """A standalone Hugging Face folder of a checkpoint's policy (a LoRA adapter merged into its base)."""
    model, tokenizer = load_policy(config, checkpoint)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
