"""Wall time of one SeeUPO update versus one GRPO update on the same RolloutBatch.

Same model (reset to the same initial weights before every run), same samples, same reuse
(epochs, minibatch_size), same learner as the trainer's. The batch is synthetic but shaped like
a multi-turn episode: turn t's context is turn t-1's context + response + observation, and
trajectories end after 1..T turns. The paper reports SeeUPO at ~1.5x GRPO's update time.

    python scripts/bench_update.py                                   # tiny model, full fine-tuning
    python scripts/bench_update.py --model embedded --lora 8 --tasks 2 --group 4 --turns 3 --repeats 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from accelerate import Accelerator

from seeupo_gym.agents.models import load_model
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.training.learner import LLMLearner, frozen_copy
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn


def multi_turn_batch(
    tasks: int, group: int, turns: int, context: int, response: int, observation: int, vocab: int, seed: int
) -> RolloutBatch:
    rng = random.Random(seed)
    trajectories = []
    for task in range(tasks):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        for g in range(group):
            ids = list(prompt)
            turn_list = []
            for _ in range(rng.randint(1, turns)):
                reply = [rng.randrange(vocab) for _ in range(rng.randint(response // 2, response))]
                turn_list.append(Turn(list(ids), reply, [0.0] * len(reply)))
                ids += reply + [rng.randrange(vocab) for _ in range(rng.randint(observation // 2, observation))]
            trajectories.append(Trajectory(f"t{task}", f"t{task}", f"t{task}-{g}", turn_list, rng.random(), False))
    return RolloutBatch(trajectories)


class UpdateBench:
    """One model, reset to the same initial trainable weights before every timed update.

    Only the trainable parameters are snapshot and restored (the LoRA adapter, or every weight
    for full fine-tuning), so the 0.5B model is held once, not copied per run.
    """

    def __init__(self, model, tokenizer, batch: RolloutBatch, lora: bool, lr: float, forward_batch_size: int) -> None:
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.model = self.accelerator.prepare(model)
        self.reference = None if lora else frozen_copy(model)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.initial = [p.detach().clone() for p in self.trainable]
        self.tokenizer, self.batch, self.lr, self.forward_batch_size = tokenizer, batch, lr, forward_batch_size

    def run(self, name: str, options: dict) -> tuple[float, dict]:
        with torch.no_grad():
            for param, value in zip(self.trainable, self.initial):
                param.copy_(value)
        optimizer = self.accelerator.prepare(torch.optim.AdamW(self.trainable, lr=self.lr))
        learner = LLMLearner(
            self.accelerator, self.model, optimizer, pad_token_id=self.tokenizer.pad_token_id,
            reference=self.reference, forward_batch_size=self.forward_batch_size,
        )
        algorithm = make_algorithm(name, options)
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = algorithm.update(self.batch, learner, torch.Generator().manual_seed(0))
        # CPU time beside wall time: on a shared machine the wall time mostly measures the neighbours.
        metrics["cpu_s"] = time.process_time() - cpu_started
        seconds = time.perf_counter() - started
        optimizer.zero_grad(set_to_none=True)
        self.accelerator._optimizers.clear()  # drop this run's optimizer state
        return seconds, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | embedded | HF id / path")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="T_max; trajectories have 1..T_max turns")
    parser.add_argument("--context", type=int, default=256, help="first-turn context tokens")
    parser.add_argument("--response", type=int, default=48, help="max response tokens per turn")
    parser.add_argument("--observation", type=int, default=32, help="max observation tokens per turn")
    parser.add_argument("--minibatch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--forward-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithms", default="grpo,seeupo")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lora = {"r": args.lora, "alpha": 2 * args.lora} if args.lora else None
    model, tokenizer = load_model(args.model, lora=lora, device="cuda" if torch.cuda.is_available() else "cpu")
    batch = multi_turn_batch(
        args.tasks, args.group, args.turns, args.context, args.response, args.observation, vocab=min(len(tokenizer), 32000), seed=0
    )
    samples = batch.samples()
    print(
        f"model={args.model} lora={args.lora or 'off'} trajectories={len(batch)} turn samples={len(samples)} "
        f"T_max={batch.max_turns} response tokens={batch.num_response_tokens()} "
        f"max context={max(len(s.turn.context_ids) for s in samples)} minibatch={args.minibatch_size} epochs={args.epochs}"
    )
    options = {"minibatch_size": args.minibatch_size, "epochs": args.epochs}
    names = args.algorithms.split(",")
    bench = UpdateBench(model, tokenizer, batch, lora is not None, 1e-5, args.forward_batch_size)
    # One untimed warm-up update (allocator, kernels, lazy imports).
    bench.run(names[0], options)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, float] = {}
    for _ in range(args.repeats):
        for name in names:  # interleaved, so machine load drifts hit both alike
            seconds, metrics = bench.run(name, options)
            times[name].append(seconds)
            cpu[name].append(metrics["cpu_s"])
            print(f"  {name}: wall {seconds:.2f} s, CPU {metrics['cpu_s']:.2f} s", flush=True)
            steps[name] = metrics.get("optimizer_steps", float("nan"))
    for name in names:
        print(f"{name:>8}: wall median {statistics.median(times[name]):7.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times[name])}), CPU median {statistics.median(cpu[name]):7.2f} s, "
              f"optimizer steps {steps[name]:.0f}")
    if "grpo" in times and "seeupo" in times:
        wall = statistics.median(times["seeupo"]) / statistics.median(times["grpo"])
        cpu_ratio = statistics.median(cpu["seeupo"]) / statistics.median(cpu["grpo"])
        print(f"seeupo / grpo update time: wall {wall:.2f}x, CPU {cpu_ratio:.2f}x (paper: ~1.5x; target <= 1.2x)")


if __name__ == "__main__":
    main()
