"""Running verl 0.9.1's FSDP engine on CPU (tests, the parity script), through verl's own plugin points.

verl's rollout cannot run here: 0.9.1 generates only through server replicas (vLLM, SGLang, TensorRT-LLM;
`verl.workers.rollout.replica`), none of which has a CPU build in this project. Everything after
generation (the actor worker, its FSDP engine, loss, optimizer) does, with these two changes.

Two verl components do not run on a CPU-only machine as shipped, and each has a public way around:
- `verl.plugin.platform` registers only nvidia / npu / rocm platforms and, finding no accelerator,
  falls back to "nvidia", so the FSDP engine's device mesh calls `torch.cuda.set_device` and fails.
  verl's answer is a platform plugin (`PlatformRegistry.register`, `VERL_PLATFORM`): `use_cpu_platform`
  registers one whose device is "cpu" and whose collectives are gloo. The FSDP engine is registered for
  cuda / npu only, so `VERL_ENGINE_DEVICE=cuda` picks it (verl's engine-selection override).
- `verl.models.transformers.monkey_patch.apply_monkey_patch` imports `AutoModelForCausalLMWithValueHead`
  from TRL whenever TRL is installed; TRL 1.16 no longer has it, so building any FSDP model fails with
  ImportError. `trl_hidden()` hides TRL from verl's probe while the engine is built, and restores it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_CPU_MODULE = types.SimpleNamespace(  # what verl asks of `torch.cuda` (memory figures, seeds, sync)
    max_memory_allocated=lambda *a, **k: 0, max_memory_reserved=lambda *a, **k: 0, memory_allocated=lambda *a, **k: 0,
    memory_reserved=lambda *a, **k: 0, empty_cache=lambda: None, synchronize=lambda *a, **k: None,
    is_available=lambda: True, device_count=lambda: 1, current_device=lambda: "cpu", set_device=lambda i: None,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, reset_peak_memory_stats=lambda *a, **k: None,
    mem_get_info=lambda *a, **k: (0, 0), get_device_name=lambda *a, **k: "CPU", get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
)


def use_cpu_platform() -> None:
    """Register verl's CPU platform (once) and select it and the FSDP engine for this process."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _CPU_MODULE)

        def is_available(self): return True
        def current_device(self): return "cpu"  # torch reads an int as an accelerator index
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        @contextlib.contextmanager
        def nvtx_range(self, msg): yield
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    set_platform(PlatformRegistry.get("cpu")())


@contextlib.contextmanager
def trl_hidden() -> Iterator[None]:
    """TRL invisible to `importlib.util.find_spec` (verl's `is_trl_available`) inside the block."""
    saved = sys.modules.get("trl", None)
    had = "trl" in sys.modules
    sys.modules["trl"] = None  # type: ignore[assignment]  (find_spec returns None for it)
    try:
        yield
    finally:
        if had:
            sys.modules["trl"] = saved
        else:
            del sys.modules["trl"]


# The overrides that make verl's FSDP engine exact and runnable on CPU (each is a stock verl option):
# FSDP2 (FSDP1's sync_module_states wants an accelerator), eager attention (no flash-attn wheel),
# float32 compute (the engine's mixed precision defaults to bf16), no torch.compile.
CPU_ACTOR_OVERRIDES = (
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
)


def verl_config(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """verl's own `ppo_trainer` config (its Hydra defaults) with `overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def cpu_actor_worker(config: Any) -> Any:
    """verl's `ActorRolloutRefWorker` (role "actor": its FSDP engine, loss and optimizer) in this process,
    on CPU, as a one-rank gloo group: what `actor_rollout_wg` runs on each rank, without Ray."""
    import torch.distributed as dist

    use_cpu_platform()
    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    from verl.workers.engine_workers import ActorRolloutRefWorker

    with trl_hidden():
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
        worker.init_model()
    return worker


def worker_parameters(worker: Any) -> dict[str, torch.Tensor]:
    """The worker's current parameters, as full tensors by name (FSDP2 holds DTensor shards)."""
    state = worker.actor.engine.module.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
