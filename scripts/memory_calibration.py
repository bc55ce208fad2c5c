"""What one learner micro-batch holds on the device, by model shape, tokens and checkpointing:
the figures `seeupo_gym/training/memory_plan.py` is calibrated against.

Random-init Qwen2.5 shapes (memory depends on shapes, not values), bf16 on CUDA (float32 on
CPU), one packed row of multi-turn-sized sequences scored with the learner's own
`packed_logprobs` (chunked LM head), then backpropagated. For each case it prints one JSON line:
bytes held after the forward (what autograd saved), the peak of forward + backward above the
weights, the gradients' bytes, and the plan's estimate of the same quantities.

    python scripts/memory_calibration.py --shape 1.5b --tokens 4096,8192,16384
    python scripts/memory_calibration.py --shape 7b --lora 32 --tokens 4096,8192 --gc both
    python scripts/memory_calibration.py --shape tiny --tokens 512          # CPU: a dry run

It imports only torch, transformers (and peft for --lora) and two files of this repository by
path, so it runs on a GPU machine where the project itself is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # Qwen2.5 shapes: hidden, intermediate, layers, heads, kv heads, tied, vocab
    "tiny": (64, 128, 2, 2, 1, True, 151936),
    "0.5b": (896, 4864, 24, 14, 2, True, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, True, 151936),
    "7b": (3584, 18944, 28, 28, 4, False, 152064),
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(shape: str, dtype: torch.dtype, device: str, lora: int, gc: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, layers, heads, kv, tied, vocab = SHAPES[shape]
    config = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                  head_dim=hidden // heads, tie_word_embeddings=tied, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    if gc:  # as the trainer does for model.gradient_checkpointing (training/policy.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model.enable_input_require_grads()
    model.train(gc)
    return model, config


def sequences(scoring, tokens: int, seq_len: int, response_fraction: float, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out, left = [], tokens
    while left > 0:
        n = min(seq_len, left)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        r = max(1, int(n * response_fraction))
        out.append(scoring.PackedSequence(ids, spans=[(len(out), n - r, r)]))
        left -= n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch (comma-separated)")
    parser.add_argument("--gc", choices=("on", "off", "both"), default="both")
    parser.add_argument("--seq-len", type=int, default=2700, help="tokens per packed sequence (multi-turn episode)")
    parser.add_argument("--response-fraction", type=float, default=0.4)
    args = parser.parse_args()
    scoring = _load("seeupo_scoring", ROOT / "agents" / "scoring.py")
    try:
        plan = _load("seeupo_memory_plan", ROOT / "seeupo_gym" / "training" / "memory_plan.py")
    except (ImportError, OSError):  # the measurements alone
        plan = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, inter, layers, heads, kv, tied, vocab = SHAPES[args.shape]
    shape = plan and plan.ModelShape(hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
                            num_kv_heads=kv, head_dim=hidden // heads, vocab_size=vocab, tied_embeddings=tied,
                            attention_bias=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                      "load": os.getloadavg()}), flush=True)
    for gc in {"on": [True], "off": [False], "both": [False, True]}[args.gc]:
        model, _ = build(args.shape, dtype, device, args.lora, gc)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            seqs = sequences(scoring, tokens, args.seq_len, args.response_fraction, vocab, tokens)
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device == "cuda" else 0
            started = time.perf_counter()
            try:
                logprobs = scoring.packed_logprobs(model, seqs)
                held = (torch.cuda.memory_allocated() - base) if device == "cuda" else 0
                logprobs.sum().backward()
                if device == "cuda":
                    torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0
                error = None
            except torch.OutOfMemoryError as oom:
                held = peak = 0
                error = " ".join(str(oom).split())[:160]
            logprobs = None
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
            model.zero_grad(set_to_none=True)
            estimate = plan.activation_bytes(shape, tokens, gradient_checkpointing=gc,
                                             dtype_bytes=torch.finfo(dtype).bits // 8) if plan else float("nan")
            print(json.dumps({
                "shape": args.shape, "lora": args.lora, "gc": gc, "tokens": tokens, "sequences": len(seqs),
                "held_after_forward_gib": round(held / 2**30, 2), "peak_above_weights_gib": round(peak / 2**30, 2),
                "grads_gib": round(grads / 2**30, 2),
                "held_per_token_layer_kib": round(held / tokens / layers / 1024, 1),
                "plan_activation_gib": round(estimate / 2**30, 2), "seconds": round(time.perf_counter() - started, 2),
                "error": error,
            }), flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
