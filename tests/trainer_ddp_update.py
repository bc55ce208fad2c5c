"""Run by `accelerate launch` from tests/test_trainer_ddp.py (not a test module).

One algorithm update on a fixed synthetic batch, through the LLM learner as the trainer
builds it; the main process saves the resulting weights and metrics to argv[2].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import synthetic_batch  # noqa: E402

from seeupo_gym.agents.models import load_model  # noqa: E402
from seeupo_gym.algorithms.base import make_algorithm  # noqa: E402
from seeupo_gym.algorithms.training.learner import LLMLearner, frozen_copy  # noqa: E402


def main() -> None:
    algorithm_name, out = sys.argv[1], Path(sys.argv[2])
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    print(f"distributed_type={accelerator.distributed_type} processes={accelerator.num_processes}", flush=True)
    model, tokenizer = load_model("tiny", seed=0)
    reference = frozen_copy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    learner = LLMLearner(accelerator, model, optimizer, pad_token_id=tokenizer.pad_token_id, reference=reference,
                         max_tokens_per_microbatch=24)
    # 3 tasks x 2 rollouts, up to 3 turns: pools of odd sizes, so some minibatch shares are empty.
    batch = synthetic_batch(num_tasks=3, group_size=2, max_turns=3, seed=1)
    algorithm = make_algorithm(algorithm_name, {"minibatch_size": 3, "epochs": 2})
    metrics = algorithm.update(batch, learner, torch.Generator().manual_seed(0))
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
