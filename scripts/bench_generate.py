"""Multi-turn generation speed: our continuous engine, our lockstep loop, plain `model.generate`,
and transformers' own continuous batching, on the same episodes.

Each episode: a random first prompt of --prompt tokens; each turn samples --new-tokens tokens;
the next turn's prompt is the previous prompt + the response + a short observation
(--observation tokens). The variants:

  submit    `HFBackend.submit`: each episode's next turn is submitted the moment its last one
            returns (continuous batching + prefix cache: a turn prefills only what is new)
  lockstep  `HFBackend.generate` over every episode's turn t at once (prefix cache too)
  plain     `model.generate` over every episode's turn t at once, re-prefilling whole contexts
  hf-cb     transformers' continuous batching (`init_continuous_batching`, paged KV,
            return_logprobs), turns submitted as in `submit`, where the installed release has it

Variants alternate within one run (--repeats rounds, after one warm-up round), so the load of
the machine falls on each alike; every figure is printed with the load average beside it.
Prints tokens/s (generated tokens over wall time) and KV bytes copied per generated token:
`rows` = what the backend copies to cut, join and stack rows (`kv_rows.KV_COPIES`), `grow` =
what transformers' DynamicCache copies when it concatenates new positions (every decode step
copies the whole batch cache).

    .venv/bin/python scripts/bench_generate.py --model tiny
    .venv/bin/python scripts/bench_generate.py --model 0.5b --episodes 4 --prompt 256
    .venv/bin/python scripts/bench_generate.py --quick              # a short dry run
    python scripts/bench_generate.py --model 0.5b --device cuda     # bf16 on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.backends import kv_rows
from seeupo_gym.agents.models import build_tiny, tiny_config

# Qwen2.5-0.5B: hidden, intermediate, layers, heads, kv heads (tied embeddings).
SHAPES = {"0.5b": (896, 4864, 24, 14, 2)}
VARIANTS = ("submit", "lockstep", "plain", "hf-cb")


def rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def build(name: str, device: str, dtype: torch.dtype):
    model, tokenizer = build_tiny(0, dtype)
    if name != "tiny":
        from transformers import AutoModelForCausalLM

        hidden, inter, layers, heads, kv = SHAPES[name]
        config = tiny_config(tokenizer)
        config.update({"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
                       "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
                       "layer_types": ["full_attention"] * layers})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # random init: time depends on shapes
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
    return model.to(device).eval(), tokenizer


class Episodes:
    """The episodes' fixed inputs: first prompts and the observation after each turn."""

    def __init__(self, episodes: int, turns: int, prompt: int, observation: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.first = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(episodes)]
        self.observations = [[torch.randint(0, vocab, (observation,), generator=g).tolist() for _ in range(turns)]
                             for _ in range(episodes)]
        self.turns = turns


def sampling_for(args: argparse.Namespace, seed: int) -> SamplingParams:
    # An id the model never samples as the only stop: every turn runs its full length on each variant.
    return SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=(-1,), seed=seed)


def run_submit(backend: HFBackend, data: Episodes, args: argparse.Namespace) -> int:
    prompts = [list(p) for p in data.first]
    turn = [0] * len(prompts)
    futures = {backend.submit(p, sampling_for(args, e)): e for e, p in enumerate(prompts)}
    tokens = 0
    while futures:
        done, _ = wait(list(futures), timeout=600, return_when=FIRST_COMPLETED)
        if not done:
            raise TimeoutError("no turn finished within 600 s")
        for future in done:
            e = futures.pop(future)
            completion = future.result()
            tokens += len(completion.token_ids)
            prompts[e] = prompts[e] + completion.token_ids + data.observations[e][turn[e]]
            turn[e] += 1
            if turn[e] < data.turns:
                futures[backend.submit(prompts[e], sampling_for(args, 1000 * turn[e] + e))] = e
    return tokens


def run_lockstep(backend: HFBackend, data: Episodes, args: argparse.Namespace) -> int:
    prompts = [list(p) for p in data.first]
    tokens = 0
    for t in range(data.turns):
        completions = backend.generate(prompts, sampling_for(args, t))
        tokens += sum(len(c.token_ids) for c in completions)
        prompts = [p + c.token_ids + data.observations[e][t] for e, (p, c) in enumerate(zip(prompts, completions))]
    return tokens


def run_plain(model, tokenizer, data: Episodes, args: argparse.Namespace) -> int:
    """`model.generate` as a user without an engine would call it: whole contexts, left-padded."""
    device = next(model.parameters()).device
    prompts = [list(p) for p in data.first]
    tokens = 0
    for t in range(data.turns):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.pad_token_id)
        responses = out[:, width:].tolist()
        tokens += sum(len(r) for r in responses)
        prompts = [p + r + data.observations[e][t] for e, (p, r) in enumerate(zip(prompts, responses))]
    return tokens


def hf_cb_manager(model, args: argparse.Namespace):
    """transformers' continuous batching manager, or None where this release has none."""
    if not hasattr(model, "init_continuous_batching"):
        return None
    import copy

    from transformers import GenerationConfig

    # Its own copy: the manager switches the model's attention to its paged kernels, which a
    # plain forward (every other variant) then refuses.
    model = copy.deepcopy(model)

    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=True, top_k=0, top_p=1.0, eos_token_id=-1,
                              pad_token_id=model.generation_config.pad_token_id)
    try:
        from transformers import ContinuousBatchingConfig

        manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))
    except ImportError:  # releases where these settings live on GenerationConfig
        manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    return manager


def run_hf_cb(manager, data: Episodes, args: argparse.Namespace) -> int:
    prompts = [list(p) for p in data.first]
    turn = [0] * len(prompts)
    owner = {manager.add_request(p, request_id=f"e{e}t0", max_new_tokens=args.new_tokens): e
             for e, p in enumerate(prompts)}
    tokens = 0
    deadline = time.monotonic() + 600
    while owner:
        result = manager.get_result(timeout=1)
        if time.monotonic() > deadline:
            raise TimeoutError("transformers' continuous batching returned nothing for 600 s")
        if result is None or result.request_id not in owner or not result.is_finished():
            continue
        e = owner.pop(result.request_id)
        response = list(result.generated_tokens)
        tokens += len(response)
        prompts[e] = prompts[e] + response + data.observations[e][turn[e]]
        turn[e] += 1
        if turn[e] < data.turns:
            request = manager.add_request(prompts[e], request_id=f"e{e}t{turn[e]}", max_new_tokens=args.new_tokens)
            owner[request] = e
    return tokens


def count_growth() -> list[int]:
    """Count the bytes DynamicCache copies when it appends positions (torch.cat of old + new)."""
    from transformers.cache_utils import DynamicLayer

    grown = [0]
    update = DynamicLayer.update

    def counted(self, key_states, value_states, *a, **k):
        had = getattr(self, "keys", None) is not None and self.keys.numel() > 0
        keys, values = update(self, key_states, value_states, *a, **k)
        if had:
            grown[0] += keys.numel() * keys.element_size() + values.numel() * values.element_size()
        return keys, values

    DynamicLayer.update = counted
    return grown


def profile_submit(model, tokenizer, data: Episodes, args: argparse.Namespace) -> None:
    """One submit round with the engine thread under cProfile: where its wall time goes."""
    import cProfile
    import pstats

    from seeupo_gym.agents.backends.hf_engine import HFEngine

    profiler = cProfile.Profile()
    loop = HFEngine._loop

    def profiled(self) -> None:
        profiler.enable()
        try:
            loop(self)
        finally:
            profiler.disable()

    HFEngine._loop = profiled
    try:
        backend = HFBackend(model, tokenizer)
        start = time.perf_counter()
        tokens = run_submit(backend, data, args)
        print(f"profiled submit round: {tokens} tokens in {time.perf_counter() - start:.2f} s, load {load()}", flush=True)
        backend._engine.close(timeout=60)
    finally:
        HFEngine._loop = loop
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512, help="tokens of each episode's first prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per turn")
    parser.add_argument("--observation", type=int, default=8, help="tokens appended after each response")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant after the warm-up")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, one more submit round under cProfile (engine thread): top 20 by own time")
    parser.add_argument("--quick", action="store_true", help="a short dry run: 2 episodes, 2 turns, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.turns, args.prompt, args.new_tokens, args.repeats = 2, 2, 64, 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    torch.set_grad_enabled(False)
    model, tokenizer = build(args.model, args.device, dtype)
    variants = [v for v in args.variants.split(",") if v]
    manager = None
    if "hf-cb" in variants:
        try:
            manager = hf_cb_manager(model, args)
        except Exception as error:  # e.g. an attention kernel this machine lacks: measure the others
            print(f"hf-cb: transformers' continuous batching did not start ({type(error).__name__}: {error}); "
                  "skipped", flush=True)
        if manager is None:
            print("hf-cb: not measured (no continuous batching in this transformers release, or it failed)", flush=True)
            variants.remove("hf-cb")
    grown = count_growth()
    data = Episodes(args.episodes, args.turns, args.prompt, args.observation, model.config.vocab_size)
    print(f"model={args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype}) "
          f"device={args.device} threads={torch.get_num_threads()} episodes={args.episodes} turns={args.turns} "
          f"prompt={args.prompt} new_tokens={args.new_tokens} observation={args.observation} load={load()}", flush=True)

    def one(variant: str) -> tuple[float, int, int, int]:
        # A fresh backend each round: its prefix cache starts empty, as at a new collect after a weight update.
        backend = HFBackend(model, tokenizer)
        kv_rows.KV_COPIES.bytes, grown[0] = 0, 0
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        if variant == "submit":
            tokens = run_submit(backend, data, args)
        elif variant == "lockstep":
            tokens = run_lockstep(backend, data, args)
        elif variant == "plain":
            tokens = run_plain(model, tokenizer, data, args)
        else:
            tokens = run_hf_cb(manager, data, args)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if backend._engine is not None:
            backend._engine.close(timeout=60)
        return seconds, tokens, kv_rows.KV_COPIES.bytes, grown[0]

    for variant in variants:  # warm-up: allocator, kernels, lazy imports
        one(variant)
    results: dict[str, list[tuple[float, int, int, int, str]]] = {v: [] for v in variants}
    for round_ in range(args.repeats):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            seconds, tokens, rows, grow = one(variant)
            results[variant].append((seconds, tokens, rows, grow, load()))
            print(f"  round {round_} {variant}: {tokens} tokens in {seconds:.2f} s = {rate(tokens / seconds)} tokens/s, "
                  f"KV copied per token rows {rows / tokens:,.0f} B grow {grow / tokens:,.0f} B, load {load()}",
                  flush=True)
    if manager is not None:
        manager.stop(block=True, timeout=10)
    if args.profile:
        profile_submit(model, tokenizer, data, args)
    plain = statistics.median(r[1] / r[0] for r in results["plain"]) if results.get("plain") else None
    print(f"| variant | tokens/s (median of {args.repeats}) | runs | vs plain | KV rows B/token | KV grow B/token | load |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        speeds = [tokens / seconds for seconds, tokens, *_ in runs]
        median = statistics.median(speeds)
        ratio = f"{median / plain:.2f}x" if plain else "-"
        print(f"| {variant} | {rate(median)} | {', '.join(rate(s) for s in speeds)} | {ratio} | "
              f"{statistics.median(r[2] / r[1] for r in runs):,.0f} | {statistics.median(r[3] / r[1] for r in runs):,.0f} | "
              f"{', '.join(r[4].split('/')[0] for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
