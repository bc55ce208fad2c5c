"""Parity: SeeUPO steps through TRL's `SeeUPOTrainer` against the kit's own update, same rollouts.

For each case: the `tiny` model (float32, CPU) is saved once; `SeeUPOTrainer` (GRPOTrainer's loop,
`trainer.train()`) trains it on TurnBandit through `environment_factory`, with the model's `generate`
replaced by fixed scripted completions with tool calls (INJECTED generation: the tiny random model
never calls a tool). TRL's tool loop runs the calls against the env. Then the kit's `SeeUPO.update`,
with the project's learner (seeupo_gym/training/learner.py `LLMLearner`, an optimizer of the
trainer's class and settings), updates the same initial weights on the same rollouts, step after
step (the records the trainer built: each trajectory's turns are checked against the script first).
Prints `max parameter difference vs the kit: X` per case; the tests hold X <= 1e-5.

Cases: `reverse`, `natural`, `kl` (reverse + beta 0.002): one step, 4 completions on one process;
`accumulation`: gradient_accumulation_steps=2 (2 completions per micro-step, one SeeUPO step per
4); `processes`: 2 processes on CPU (torch.distributed.run, DDP over gloo), 2 completions each.
`--steps N` runs N steps (SGD without momentum at a constant rate: N kit updates in a row match).

The default optimizer is SGD at lr 0.1 (`optim="sgd"`, the same in both): its step is linear in the
gradient, so X measures the algorithm. With AdamW (TRL's default) X also holds float noise amplified by
Adam's first steps (g / (|g| + eps) on the tied embedding's ~1e-8 gradients) (`--optim adamw_torch --lr 1e-4`).

`--count-forwards` prints the forward calls of one SeeUPO step (8 trajectories of 4 turns, KL on,
the tiny model) through `TRLLearner`, the kit's packed learner under a token budget, against the
learner it replaced (one forward per turn sample in every gradient pass, one per trajectory in
every frozen pass, a ratio pass of its own after each pool).

    python scripts/seeupo_in_trl.py                       # reverse, natural, reverse + KL
    python scripts/seeupo_in_trl.py --case accumulation --case processes --steps 2
    python scripts/seeupo_in_trl.py --case reverse --control   # also TRL natural vs the kit's reverse (large X)
    python scripts/seeupo_in_trl.py --count-forwards
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

CASES = {  # name: SeeUPOTrainer settings (4 completions per SeeUPO step in every case)
    "reverse": {"order": "reverse", "beta": 0.0},
    "natural": {"order": "natural", "beta": 0.0},
    "kl": {"order": "reverse", "beta": 0.002},
    "accumulation": {"order": "reverse", "beta": 0.002, "batch_size": 2, "gradient_accumulation_steps": 2},
    "processes": {"order": "reverse", "beta": 0.002, "batch_size": 2, "processes": 2},
}
BANDIT = {"variant": "follow", "num_tasks": 2}


def plan(index: int, text: str) -> list[tuple[str, dict]]:
    """The calls of a rollout: even rows answer A twice (3 turns with the closing text), odd rows B
    once (2 turns). Later calls recognize the rollout from its prompt (TRL batches only those still calling)."""
    if "<tool_response>" not in text:
        return [("answer", {"label": "A" if index % 2 == 0 else "B"})]
    latest = text.rsplit("<tool_call>", 1)[-1]  # the rollout's own latest call (the system prompt may quote examples)
    return [("answer", {"label": "B"})] if '"label": "B"' in latest else [("answer", {"label": "A"})] * 2


def scripted_generate(tokenizer, plan):
    """INJECTED generation, a stand-in for `model.generate`: a row's next call of plan(row, prompt) as a
    hermes tool call (counted by the tool results in its prompt), then "Done."; each ends with <|im_end|>."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(input_ids, attention_mask=None, **kwargs):
        rows = []
        for index, prompt in enumerate(input_ids):
            text = tokenizer.decode(prompt)
            calls, done = plan(index, text), text.count("<tool_response>")
            reply = "Done."
            if done < len(calls):
                name, arguments = calls[done]
                reply = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            rows.append(tokenizer(reply, add_special_tokens=False)["input_ids"] + [im_end])
        width = max(len(row) for row in rows)
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)

    return generate


def save_tiny(folder: Path) -> Path:
    from seeupo_gym.agents.models import load_model

    model, tokenizer = load_model("tiny", dtype="float32")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_in_trl(model_dir: Path, out: Path, order: str, beta: float, generate_plan=plan, env=BANDIT, max_steps=1,
                 optim: str = "sgd", lr: float = 0.1, generate=None, batch_size: int = 4,
                 gradient_accumulation_steps: int = 1, **seeupo):
    """SeeUPOTrainer.train() for max_steps on TurnBandit with scripted completions (generate(tokenizer):
    another stand-in for `model.generate`); the trainer, with `seeupo_batches`: every step's rollouts."""
    from transformers import AutoTokenizer, TrainerCallback
    from trl.chat_template_utils import add_response_schema

    from seeupo_gym.integrations.trl import SeeUPOConfig, SeeUPOTrainer, make

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = SeeUPOConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=batch_size, num_generations=2,
        gradient_accumulation_steps=gradient_accumulation_steps, max_completion_length=256, learning_rate=lr, optim=optim,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
        dataloader_num_workers=0, beta=beta, seeupo_order=order, **seeupo,
    )
    batches = []

    class KeepBatches(TrainerCallback):  # each step's rollouts, for the kit's updates in a row
        def on_step_end(self, args, state, control, **kwargs):
            batches.append(trainer.seeupo_last_batch)

    trainer = SeeUPOTrainer(model=str(model_dir), args=args, processing_class=add_response_schema(tokenizer),
                            callbacks=[KeepBatches()], **make("seeupo/TurnBandit-v0", **env))
    trainer.seeupo_batches = batches
    trainer.model.generate = generate(tokenizer) if generate else scripted_generate(tokenizer, generate_plan)
    trainer.train()
    return trainer


def check_turns(trainer, batches=None) -> None:
    """The trainer's records hold the script: turn k's response is the k-th scripted reply, and turn k+1's
    context extends turn k's context + response with a tool result."""
    tokenizer = trainer.processing_class if hasattr(trainer, "processing_class") else trainer
    for trajectory in (t for batch in (batches or trainer.seeupo_batches) for t in batch):
        texts = [tokenizer.decode(turn.response_ids) for turn in trajectory.turns]
        assert texts[-1] == "Done.<|im_end|>" and all(t.startswith("<tool_call>") for t in texts[:-1]), texts
        for turn, following in zip(trajectory.turns, trajectory.turns[1:]):
            head = turn.context_ids + turn.response_ids
            assert following.context_ids[: len(head)] == head
            assert "<tool_response>" in tokenizer.decode(following.context_ids[len(head):])


def run_facts(trainer) -> dict:
    """What the kit's side needs of a finished run (plain values: a worker process hands them over)."""
    from seeupo_gym.integrations.trl_seeupo import kit_config

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    config = kit_config(trainer.args)
    return {
        "optimizer": type(optimizer).__name__, "defaults": dict(optimizer.defaults),
        "pad_token_id": trainer.processing_class.pad_token_id, "max_grad_norm": trainer.args.max_grad_norm,
        "temperature": float(trainer.temperature), "seed": trainer.args.seed,
        "config": {k: v for k, v in asdict(config).items() if not isinstance(v, dict)},
        "batches": [[asdict(t) for t in batch] for batch in trainer.seeupo_batches],
    }


def kit_update(model_dir: Path, facts: dict, order: str):
    """The kit's SeeUPO.update with the project's learner on the run's rollouts, step after step, from the
    saved weights."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
    from seeupo_gym.algorithms.seeupo import SeeUPO, SeeUPOConfig
    from seeupo_gym.training.learner import LLMLearner, frozen_copy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    kind = getattr(torch.optim, facts["optimizer"])
    accepted = inspect.signature(kind).parameters  # defaults may hold keys the constructor fixes
    optimizer = kind(model.parameters(), **{k: v for k, v in facts["defaults"].items() if k in accepted})
    learner = LLMLearner(Accelerator(cpu=True), model, optimizer, pad_token_id=facts["pad_token_id"],
                         reference=frozen_copy(model), max_grad_norm=facts["max_grad_norm"],
                         logprob_temperature=facts["temperature"])
    algorithm = SeeUPO(SeeUPOConfig(**{**facts["config"], "order": order}))
    generator = torch.Generator().manual_seed(facts["seed"])
    for records in facts["batches"]:
        batch = RolloutBatch([Trajectory(**{**t, "turns": [Turn(**turn) for turn in t["turns"]]}) for t in records])
        algorithm.update(batch, learner, generator)
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module, where: bool = False):
    theirs = dict(b.named_parameters())
    gaps = {name: float((p.detach() - theirs[name].detach()).abs().max()) for name, p in a.named_parameters()}
    worst = max(gaps, key=gaps.get)
    return (gaps[worst], worst) if where else gaps[worst]


def run_case(model_dir: Path, out: Path, name: str, kit_order: str | None = None, steps: int = 1, **train) -> float:
    """Train `name` for `steps` through TRL, the same updates through the kit: the largest parameter gap."""
    case = dict(CASES[name])
    processes = case.pop("processes", 1)
    if processes > 1:
        facts, state = in_processes(model_dir, out / name, name, processes, steps, train)
        tokenizer, trained = None, state
    else:
        trainer = train_in_trl(model_dir, out / name, case.pop("order"), case.pop("beta"), max_steps=steps, **case, **train)
        assert trainer.state.global_step == steps, trainer.state.global_step
        facts, tokenizer = run_facts(trainer), trainer.processing_class
        trained = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

    batches = [RolloutBatch([Trajectory(**{**t, "turns": [Turn(**u) for u in t["turns"]]}) for t in b]) for b in facts["batches"]]
    assert len(batches) == steps and all(len(b) == 4 for b in batches), [len(b) for b in batches]
    check_turns(tokenizer, batches)
    kit = kit_update(model_dir, facts, kit_order or CASES[name]["order"]).state_dict()
    gaps = {k: float((trained[k] - kit[k]).abs().max()) for k in kit}
    where = max(gaps, key=gaps.get)
    print(f"  (largest at {where})", flush=True)
    return gaps[where]


def in_processes(model_dir: Path, out: Path, name: str, processes: int, steps: int, train: dict) -> tuple[dict, dict]:
    """Run the case in `processes` CPU processes (torch.distributed.run: DDP over gloo); rank 0's facts and weights."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(Path(__file__).resolve()), "--worker", str(out), "--model-dir", str(model_dir), "--case", name,
               "--steps", str(steps), "--optim", train.get("optim", "sgd"), "--lr", str(train.get("lr", 0.1))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, timeout=1500, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{processes} processes failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    saved = torch.load(result, weights_only=True)
    return saved["facts"], saved["state"]


def worker(out: Path, model_dir: Path, name: str, steps: int, optim: str, lr: float) -> None:
    """One process of `in_processes`: train, then rank 0 saves what the kit's side needs."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    case = dict(CASES[name])
    case.pop("processes")
    trainer = train_in_trl(model_dir, out / "run", case.pop("order"), case.pop("beta"), max_steps=steps, optim=optim, lr=lr,
                           **case)
    assert trainer.accelerator.num_processes == int(os.environ["WORLD_SIZE"]) > 1, trainer.accelerator.num_processes
    assert trainer.state.global_step == steps
    if trainer.accelerator.is_main_process:
        state = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
        torch.save({"facts": run_facts(trainer), "state": state}, out / "result.pt")
    if dist.is_initialized():
        dist.barrier()


def count_forwards(budget: int = 8192, pack_limit: int | None = None) -> dict[str, int]:
    """Forward calls of one SeeUPO step (8 trajectories of 4 turns, KL on) through TRLLearner with a
    stand-in for the GRPOTrainer (its accelerator, optimizer, reference and settings: what the learner
    reads); also the calls of the learner it replaced, by its rule."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from seeupo_gym.agents.models import load_model
    from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
    from seeupo_gym.algorithms.seeupo import SeeUPO
    from seeupo_gym.integrations.trl_seeupo import TRLLearner, kit_config
    from seeupo_gym.training.learner import frozen_copy

    generator = torch.Generator().manual_seed(0)
    ints = lambda n: torch.randint(3, 500, (n,), generator=generator).tolist()  # noqa: E731
    trajectories = []
    for i in range(8):  # a 40-token prompt, 4 turns of 12 tokens, 8-token tool results
        ids, turns = ints(40), []
        for _ in range(4):
            reply = ints(12)
            turns.append(Turn(list(ids), reply, [0.0] * len(reply)))
            ids += reply + ints(8)
        trajectories.append(Trajectory(f"g{i // 2}", f"g{i // 2}", f"r{i}", turns, float(i % 3), False))
    batch = RolloutBatch(trajectories)
    model, _ = load_model("tiny", seed=0)
    model.train()
    trainer = SimpleNamespace(accelerator=Accelerator(cpu=True), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              temperature=1.0, args=SimpleNamespace(max_grad_norm=1.0), ref_model=frozen_copy(model))
    learner = TRLLearner(trainer, model, pad_token_id=0, max_tokens_per_microbatch=budget, pack_limit=pack_limit)
    config = kit_config(SimpleNamespace(seeupo_normalization="batch", seeupo_order="reverse", seeupo_old_policy="step_start",
                                        seeupo_m_clip=None, epsilon=0.2, epsilon_high=None, beta=0.002,
                                        seeupo_kl_estimator="low_var_kl"))
    SeeUPO(config).update(batch, learner, torch.Generator().manual_seed(0))
    samples, pools = len(batch.samples()), batch.max_turns
    later = sum(len(batch.turn_pool(t)) for t in range(1, pools))  # reverse: pools 3..1 follow pool 4
    return {"policy": learner.forwards["policy"], "reference": learner.forwards["reference"],
            "tokens_policy": learner.tokens_fed["policy"], "samples": samples,
            "before_policy": len(batch) + samples + later, "before_reference": len(batch)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: reverse, natural, kl")
    parser.add_argument("--control", action="store_true", help="also TRL natural order against the kit's reverse")
    parser.add_argument("--optim", default="sgd", help="TRL's optim (the kit's learner gets the same optimizer)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="SeeUPO steps per case")
    parser.add_argument("--count-forwards", action="store_true", help="print the forward calls of one step and stop")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker, args.model_dir, args.case[0], args.steps, args.optim, args.lr)
        return 0
    if args.count_forwards:
        print(f"load: {os.getloadavg()[0]:.2f} (1 min)")
        for budget, limit in ((8192, None), (8192, 8192), (112, None)):
            n = count_forwards(budget, limit)
            print(f"one SeeUPO step, 8 trajectories x 4 turns ({n['samples']} turn samples), KL on, budget {budget} tokens, "
                  f"pack limit {limit or 'CPU default 256'}: forward calls {n['policy']} policy + {n['reference']} reference "
                  f"({n['tokens_policy']} policy tokens); the previous learner: {n['before_policy']} policy + "
                  f"{n['before_reference']} reference", flush=True)
        return 0
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny(Path(tmp) / "tiny")
        for name in args.case or ["reverse", "natural", "kl"]:
            x = run_case(model_dir, Path(tmp), name, steps=args.steps, optim=args.optim, lr=args.lr)
            worst = max(worst, x)
            print(f"case {name} ({args.steps} step(s)): max parameter difference vs the kit: {x:.3g}", flush=True)
        if args.control:
            x = run_case(model_dir, Path(tmp), "natural", kit_order="reverse", optim=args.optim, lr=args.lr)
            print(f"control (TRL natural vs the kit's reverse): max parameter difference vs the kit: {x:.3g}", flush=True)
    print(f"max parameter difference vs the kit: {worst:.3g}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
