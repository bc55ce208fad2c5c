"""GPU figures at real model shapes, random init (time and memory depend on shapes, not values):
one SeeUPO and one GRPO update, and vLLM generation through `VLLMBackend`. Parts of scripts/gpu_check.sh.

    python scripts/bench_gpu.py update --shape 1.5b --gc          # full fine-tuning, gradient checkpointing
    python scripts/bench_gpu.py update --shape 7b --lora 32 --gc  # LoRA r=32 on every layer
    python scripts/bench_gpu.py update --shape tiny --tasks 1 --group 2 --turns 2 --context 64   # CPU dry run
    python scripts/bench_gpu.py vllm --shape 0.5b --prompts 32    # needs vllm
The last line is `RESULT <json>`: the figures gpu_check.sh puts in its table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # Qwen2.5 shapes: hidden, intermediate, layers, heads, kv heads, tied embeddings
    "tiny": (64, 128, 2, 2, 1, True),
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, True),
    "7b": (3584, 18944, 28, 28, 4, False),
}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build(shape: str, lora: int, checkpointing: bool):
    """A random-init Qwen2.5-shaped model on this machine's device (bf16 on CUDA), with the tiny
    model's tokenizer (its vocabulary: 151k ids, Qwen2.5's)."""
    from transformers import AutoModelForCausalLM

    from seeupo_gym.agents.models import _apply_lora, build_tiny, tiny_config

    _, tokenizer = build_tiny()
    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    config = tiny_config(tokenizer)
    config.update({"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
                   "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
                   "layer_types": ["full_attention"] * layers, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if lora:
        model = _apply_lora(model, {"r": lora, "alpha": 2 * lora})
    if checkpointing:  # as the trainer does for model.gradient_checkpointing (training/policy.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(True)
    return model, tokenizer, config


def update(args: argparse.Namespace) -> dict:
    from bench_update import UpdateBench, multi_turn_batch, packed_length

    from seeupo_gym.algorithms.rollout import RolloutBatch

    model, tokenizer, _ = build(args.shape, args.lora, args.gc)
    batch = multi_turn_batch(args.tasks, args.group, args.turns, args.context, args.response, args.observation,
                             32000, 0, min_turns=max(1, args.turns // 2))
    packed = sum(packed_length(t) for t in batch)
    print(f"batch: {len(batch)} trajectories, {len(batch.samples())} turn samples, {packed} packed tokens", flush=True)
    bench = UpdateBench(model, tokenizer, batch, bool(args.lora), 1e-6, args.max_tokens, False)
    options = {"minibatch_size": args.minibatch, "epochs": 1, "kl_coef": 0.002, "kl_estimator": "low_var_kl"}
    full = bench.batch
    bench.batch = RolloutBatch(full.trajectories[:2])
    for name in ("grpo", "seeupo"):  # warm-up: allocator, kernels
        bench.run(name, options)
    bench.batch = full
    result: dict = {"shape": args.shape, "lora": args.lora, "checkpointing": args.gc, "trajectories": len(batch),
                    "packed_tokens": packed}
    for name in ("grpo", "seeupo"):
        if device() == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds, metrics, learner = bench.run(name, options)
        if device() == "cuda":
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device() == "cuda" else 0.0
        print(f"  {name}: {seconds:.2f} s, tokens fed {dict(learner.tokens_fed)}, peak {peak:.1f} GiB", flush=True)
        result[name] = {"seconds": round(seconds, 3), "peak_gib": round(peak, 2), "tokens_fed": dict(learner.tokens_fed)}
    return result


def vllm(args: argparse.Namespace) -> dict:
    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.backends.vllm import VLLMBackend

    model, tokenizer, _ = build(args.shape, 0, False)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        backend = VLLMBackend(folder, gpu_memory_utilization=args.memory, max_model_len=1024, enforce_eager=True)
        prompts = [[(7 * i + j) % 30000 + 100 for j in range(args.prompt)] for i in range(args.prompts)]
        sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)  # no stop ids: full length
        backend.generate(prompts[:2], sampling)  # warm-up
        started = time.perf_counter()
        completions = backend.generate(prompts, sampling)
        seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in completions)
    return {"shape": args.shape, "prompts": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["update", "vllm"])
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=1500, help="first-prompt tokens")
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--observation", type=int, default=128)
    parser.add_argument("--minibatch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16384, help="max_tokens_per_microbatch")
    parser.add_argument("--prompts", type=int, default=32, help="vllm: prompts in one generate")
    parser.add_argument("--prompt", type=int, default=256, help="vllm: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="vllm: tokens sampled per prompt")
    parser.add_argument("--memory", type=float, default=0.3, help="vllm: gpu_memory_utilization")
    args = parser.parse_args()
    print(json.dumps({"device": device(), "torch": torch.__version__}), flush=True)
    result = (update if args.what == "update" else vllm)(args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
