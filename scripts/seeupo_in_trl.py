"""Parity: one SeeUPO step through TRL's `SeeUPOTrainer` against the kit's own update, same rollouts.

For each case: the `tiny` model (float32, CPU) is saved once; `SeeUPOTrainer` (GRPOTrainer's loop,
`trainer.train()`, max_steps=1) trains it on TurnBandit through `environment_factory`, with the
model's `generate` replaced by fixed scripted completions with tool calls (INJECTED generation:
the tiny random model never calls a tool). TRL's tool loop runs the calls against the env. Then
the kit's `SeeUPO.update`, with the project's learner (seeupo_gym/training/learner.py `LLMLearner`,
an optimizer of the trainer's class and settings), updates the same initial weights on the same
rollouts (the records the trainer built: each trajectory's turns are checked against the script
first). Prints `max parameter difference vs the kit: X` per case (goal <= 1e-5).

The default optimizer is SGD at lr 0.1 (`optim="sgd"`, the same in both): its step is linear in the
gradient, so X measures the algorithm. With AdamW (TRL's default) X also holds float noise amplified by
Adam's first steps (g / (|g| + eps) on the tied embedding's ~1e-8 gradients): measured 3.2e-6 / 1.0e-5 / 3.3e-6
(reverse / natural / KL) at lr 1e-4, 3e-5 to 1e-4 at lr 1e-3 (`--optim adamw_torch_fused --lr 1e-4`).

    python scripts/seeupo_in_trl.py                       # reverse, natural, reverse + KL
    python scripts/seeupo_in_trl.py --case reverse --control   # also TRL natural vs the kit's reverse (large X)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

CASES = {  # name: (TRL order, beta)
    "reverse": ("reverse", 0.0),
    "natural": ("natural", 0.0),
    "kl": ("reverse", 0.002),
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
                 optim: str = "sgd", lr: float = 0.1, generate=None, batch_size: int = 4):
    """SeeUPOTrainer.train() for max_steps on TurnBandit with scripted completions (generate(tokenizer):
    another stand-in for `model.generate`); the trainer."""
    from trl.chat_template_utils import add_response_schema
    from transformers import AutoTokenizer

    from seeupo_gym.integrations.trl import SeeUPOConfig, SeeUPOTrainer, make

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = SeeUPOConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=batch_size, num_generations=2,
        max_completion_length=256, learning_rate=lr, optim=optim, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        use_cpu=True, bf16=False, save_strategy="no", seed=0, dataloader_num_workers=0, beta=beta, seeupo_order=order,
    )
    trainer = SeeUPOTrainer(model=str(model_dir), args=args, processing_class=add_response_schema(tokenizer),
                            **make("seeupo/TurnBandit-v0", **env))
    trainer.model.generate = generate(tokenizer) if generate else scripted_generate(tokenizer, generate_plan)
    trainer.train()
    return trainer


def check_turns(trainer) -> None:
    """The trainer's records hold the script: turn k's response is the k-th scripted reply, and turn k+1's
    context extends turn k's context + response with a tool result."""
    tokenizer = trainer.processing_class
    for trajectory in trainer.seeupo_last_batch:
        texts = [tokenizer.decode(turn.response_ids) for turn in trajectory.turns]
        assert texts[-1] == "Done.<|im_end|>" and all(t.startswith("<tool_call>") for t in texts[:-1]), texts
        for turn, following in zip(trajectory.turns, trajectory.turns[1:]):
            head = turn.context_ids + turn.response_ids
            assert following.context_ids[: len(head)] == head
            assert "<tool_response>" in tokenizer.decode(following.context_ids[len(head):])


def kit_update(model_dir: Path, trainer, order: str):
    """The kit's SeeUPO.update with the project's learner on the trainer's rollouts, from the saved weights."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from seeupo_gym.algorithms.seeupo import SeeUPO
    from seeupo_gym.integrations.trl_seeupo import kit_config
    from seeupo_gym.training.learner import LLMLearner, frozen_copy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    trl_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    import inspect

    accepted = inspect.signature(type(trl_optimizer)).parameters  # defaults may hold keys the constructor fixes
    optimizer = type(trl_optimizer)(model.parameters(), **{k: v for k, v in trl_optimizer.defaults.items() if k in accepted})
    learner = LLMLearner(Accelerator(cpu=True), model, optimizer, pad_token_id=trainer.processing_class.pad_token_id,
                         reference=frozen_copy(model), max_grad_norm=trainer.args.max_grad_norm,
                         logprob_temperature=trainer.temperature)
    config = kit_config(trainer.args)
    config.order = order
    SeeUPO(config).update(trainer.seeupo_last_batch, learner, torch.Generator().manual_seed(trainer.args.seed))
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module, where: bool = False):
    theirs = dict(b.named_parameters())
    gaps = {name: float((p.detach() - theirs[name].detach()).abs().max()) for name, p in a.named_parameters()}
    worst = max(gaps, key=gaps.get)
    return (gaps[worst], worst) if where else gaps[worst]


def run_case(model_dir: Path, out: Path, name: str, kit_order: str | None = None, **train) -> float:
    order, beta = CASES[name]
    trainer = train_in_trl(model_dir, out / name, order, beta, **train)
    check_turns(trainer)
    kit = kit_update(model_dir, trainer, kit_order or order)
    x, where = max_difference(trainer.model, kit, where=True)
    print(f"  (largest at {where})", flush=True)
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--control", action="store_true", help="also TRL natural order against the kit's reverse")
    parser.add_argument("--optim", default="sgd", help="TRL's optim (the kit's learner gets the same optimizer)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny(Path(tmp) / "tiny")
        for name in args.case or list(CASES):
            x = run_case(model_dir, Path(tmp), name, optim=args.optim, lr=args.lr)
            worst = max(worst, x)
            print(f"case {name}: max parameter difference vs the kit: {x:.3g}", flush=True)
        if args.control:
            x = run_case(model_dir, Path(tmp), "natural", kit_order="reverse", optim=args.optim, lr=args.lr)
            print(f"control (TRL natural vs the kit's reverse): max parameter difference vs the kit: {x:.3g}", flush=True)
    print(f"max parameter difference vs the kit: {worst:.3g}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
