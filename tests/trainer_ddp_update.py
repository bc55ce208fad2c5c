"""Run by `accelerate launch` from tests/test_trainer_ddp.py (not a test module).

One algorithm update on a fixed synthetic batch, through the LLM learner as the trainer
builds it; the main process saves the resulting weights and metrics to argv[2].
argv[3] == "fsdp": the model is sharded with FSDP2 through accelerate instead of DDP.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import synthetic_batch  # noqa: E402

from seeupo_gym.agents.models import load_model  # noqa: E402
from seeupo_gym.algorithms.base import make_algorithm  # noqa: E402
from seeupo_gym.training.learner import LLMLearner, frozen_copy  # noqa: E402


def main() -> None:
    algorithm_name, out = sys.argv[1], Path(sys.argv[2])
    fsdp = len(sys.argv) > 3 and sys.argv[3] == "fsdp"
    manual_fsdp = fsdp and not torch.cuda.is_available()
    if fsdp and not manual_fsdp:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False,
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    print(f"distributed_type={accelerator.distributed_type} processes={accelerator.num_processes}", flush=True)
    model, tokenizer = load_model("tiny", seed=0)
    model.to(accelerator.device)
    reference = frozen_copy(model)
    if manual_fsdp:
        # accelerate 1.15 enables FSDP only for GPU-like distributed types (MULTI_CPU keeps DDP), so on
        # CPU the same FSDP2 sharding is applied with torch's fully_shard over the gloo group.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (accelerator.num_processes,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    print(f"sharded={sharded}", flush=True)
    learner = LLMLearner(accelerator, model, optimizer, pad_token_id=tokenizer.pad_token_id, reference=reference,
                         max_tokens_per_microbatch=24)
    # 3 tasks x 2 rollouts, up to 3 turns: pools of odd sizes, so some processes get dummy micro-batches.
    batch = synthetic_batch(num_tasks=3, group_size=2, max_turns=3, seed=1)
    algorithm = make_algorithm(algorithm_name, {"minibatch_size": 3, "epochs": 2})
    metrics = algorithm.update(batch, learner, torch.Generator().manual_seed(0))
    if manual_fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({k.removeprefix("module."): v.cpu() for k, v in state.items()}, out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
