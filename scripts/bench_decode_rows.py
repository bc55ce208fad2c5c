"""What one decode step costs with 1, 2, 4, ... rows: how much a batch saves over one row at a time.

The per-episode schedule gains where a step of many rows costs much less than that many steps of
one row. This measures it for `HFBackend`'s decode (the model's forward over a KV cache of
`--context` tokens per row, plus sampling one token per row), median of `--steps` steps.

    .venv/bin/python scripts/bench_decode_rows.py --model embedded --context 3000 --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from seeupo_gym.agents.backends import SamplingParams
from seeupo_gym.agents.backends.hf import sample_next
from seeupo_gym.agents.backends.kv_rows import forward, join_rows
from seeupo_gym.agents.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="tiny | embedded | HF id or local path")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=3000, help="cached tokens per row")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype)
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        prompt = torch.randint(0, model.config.vocab_size, (1, args.context), generator=generator)
        _, prompt_cache = forward(model, None, input_ids=prompt, logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in prompt_cache.layers]
        one_row = None
        for rows in (int(r) for r in args.rows.split(",")):
            cache, mask = join_rows([layers] * rows)
            token = torch.randint(0, model.config.vocab_size, (rows,), generator=generator)
            position = torch.full((rows, 1), args.context)
            seconds = []
            for _ in range(args.steps):
                mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
                start = time.perf_counter()
                logits, cache = forward(model, cache, input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=position)
                token, _ = sample_next(logits[:, -1, :], sampling, generator)
                seconds.append(time.perf_counter() - start)
                position = position + 1
            step = statistics.median(seconds)
            one_row = one_row or step
            print(
                f"model={args.model} dtype={args.dtype} threads={args.threads} context={args.context} rows={rows} "
                f"step_ms={step * 1e3:.0f} per_row_ms={step * 1e3 / rows:.0f} vs_one_row={step / one_row:.2f}x "
                f"load={'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
                flush=True,
            )


if __name__ == "__main__":
    main()
