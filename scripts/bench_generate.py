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

Variants alternate within one run (--repeats rounds, after one warm-up round on other prompts),
so the load of the machine falls on each alike; every round draws fresh prompts and seeds, the
same for each variant of the round, each on a fresh backend (no prefix cache serves what an
earlier round fed); every figure is printed with the
load average beside it. --ragged gives each episode's turns their own lengths (a quarter to all
of --new-tokens), as a multi-turn episode's responses have: plain `generate` then decodes a batch
to its longest response and the figure counts only the tokens each turn keeps.

--diagnose: where a fixed cost per round of the continuous engine comes from, on the device at
hand (docs/performance.md, "Generation on a GPU"). Plain `generate` against the engine in these
settings (worker thread; cuDNN's attention allowed or not; padded shapes, or exact ones: rows as
they are, prefills unpadded and a KV width one column wider at each step, as the engine had):

  engine          the default: the process's one generation thread, no cuDNN attention, padded shapes
  fresh-thread    a new engine thread each round, cuDNN allowed, exact shapes (the old settings)
  main-thread     the engine stepped in the calling thread, cuDNN allowed, exact shapes
  no-cudnn        a new thread each round, cuDNN's attention excluded (`sdpa_kernel`), exact shapes
  padded          a new thread each round, cuDNN allowed, padded shapes

then one fresh-thread round under torch.profiler (its top kernels) and a `verdict:` line naming
the settings that remove the fixed cost.
Prints tokens/s (generated tokens over wall time) and KV bytes copied per generated token:
`rows` = what the backend copies to cut, join and stack rows (`kv_rows.KV_COPIES`), `grow` =
what transformers' DynamicCache copies when it concatenates new positions (every decode step
copies the whole batch cache).

    .venv/bin/python scripts/bench_generate.py --model tiny
    .venv/bin/python scripts/bench_generate.py --model 0.5b --episodes 4 --prompt 256
    .venv/bin/python scripts/bench_generate.py --quick              # a short dry run
    .venv/bin/python scripts/bench_generate.py --diagnose --quick   # the diagnosis at toy size
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_generate.py --threads 1 --ragged --variants submit,plain
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
from seeupo_gym.agents.backends.hf_engine import WIDTH_BLOCK, HFEngine
from seeupo_gym.agents.models import build_tiny, tiny_config

# Qwen2.5-0.5B: hidden, intermediate, layers, heads, kv heads (tied embeddings).
SHAPES = {"0.5b": (896, 4864, 24, 14, 2)}
VARIANTS = ("submit", "lockstep", "plain", "hf-cb")
# --diagnose: engine settings (worker, cuDNN attention allowed, padded shapes).
DIAGNOSIS = {
    "engine": ("process", False, True),
    "fresh-thread": ("own", True, False),
    "main-thread": ("caller", True, False),
    "no-cudnn": ("own", False, False),
    "padded": ("own", True, True),
}
# A variant within this fraction of plain `generate`'s round time carries no fixed cost.
FIXED_COST_SLACK = 1.25


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
    """The episodes' fixed inputs: first prompts, the observation after each turn, each turn's
    response length and sampling seed. `seed` picks them all: each round draws its own."""

    def __init__(self, args: argparse.Namespace, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        episodes, turns = args.episodes, args.turns
        self.first = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in range(episodes)]
        self.observations = [[torch.randint(0, vocab, (args.observation,), generator=g).tolist() for _ in range(turns)]
                             for _ in range(episodes)]
        low = max(1, args.new_tokens // 4) if args.ragged else args.new_tokens
        self.lengths = [torch.randint(low, args.new_tokens + 1, (turns,), generator=g).tolist() for _ in range(episodes)]
        self.seed = seed
        self.turns = turns

    def sampling(self, episode: int, turn: int, max_new_tokens: int | None = None) -> SamplingParams:
        # An id the model never samples as the only stop: every turn runs its full length on each variant.
        return SamplingParams(max_new_tokens=max_new_tokens or self.lengths[episode][turn], temperature=1.0,
                              stop_token_ids=(-1,), seed=self.seed * 100_000 + 1000 * turn + episode)


def run_submit(backend: HFBackend, data: Episodes, engine: HFEngine | None = None) -> int:
    """Each episode's next turn submitted when its last one returns. `engine` in "caller" mode is
    stepped here, in the calling thread, until the turns are done."""
    submit = engine.submit if engine is not None else backend.submit
    prompts = [list(p) for p in data.first]
    turn = [0] * len(prompts)
    futures = {submit(p, data.sampling(e, 0)): e for e, p in enumerate(prompts)}
    tokens = 0
    while futures:
        if engine is not None and engine.worker_kind == "caller":
            while not any(f.done() for f in futures):
                engine.step()
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
                futures[submit(prompts[e], data.sampling(e, turn[e]))] = e
    return tokens


def run_lockstep(backend: HFBackend, data: Episodes) -> int:
    """`HFBackend.generate` over every episode's turn t; each response cut to its turn's length."""
    prompts = [list(p) for p in data.first]
    tokens = 0
    for t in range(data.turns):
        longest = max(lengths[t] for lengths in data.lengths)
        completions = backend.generate(prompts, data.sampling(0, t, longest))
        responses = [c.token_ids[: data.lengths[e][t]] for e, c in enumerate(completions)]
        tokens += sum(len(r) for r in responses)
        prompts = [p + r + data.observations[e][t] for e, (p, r) in enumerate(zip(prompts, responses))]
    return tokens


def run_plain(model, tokenizer, data: Episodes) -> int:
    """`model.generate` as a user without an engine would call it: whole contexts, left-padded,
    the batch decoded to its longest response, each response cut to its turn's length."""
    device = next(model.parameters()).device
    prompts = [list(p) for p in data.first]
    tokens = 0
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(data.seed)
    for t in range(data.turns):
        longest = max(lengths[t] for lengths in data.lengths)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             max_new_tokens=longest, min_new_tokens=longest, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.pad_token_id)
        responses = [r[: data.lengths[e][t]] for e, r in enumerate(out[:, width:].tolist())]
        tokens += sum(len(r) for r in responses)
        prompts = [p + r + data.observations[e][t] for e, (p, r) in enumerate(zip(prompts, responses))]
    torch.random.set_rng_state(generator_state)
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


def run_hf_cb(manager, data: Episodes) -> int:
    prompts = [list(p) for p in data.first]
    turn = [0] * len(prompts)
    tag = f"r{data.seed}"
    owner = {manager.add_request(p, request_id=f"{tag}e{e}t0", max_new_tokens=data.lengths[e][0]): e
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
            request = manager.add_request(prompts[e], request_id=f"{tag}e{e}t{turn[e]}",
                                          max_new_tokens=data.lengths[e][turn[e]])
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


def profile_submit(model, tokenizer, data: Episodes) -> None:
    """One submit round with the engine thread under cProfile: where its wall time goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    step = HFEngine.step

    def profiled(self) -> bool:
        profiler.enable()
        try:
            return step(self)
        finally:
            profiler.disable()

    HFEngine.step = profiled
    try:
        backend = HFBackend(model, tokenizer)
        start = time.perf_counter()
        tokens = run_submit(backend, data)
        print(f"profiled submit round: {tokens} tokens in {time.perf_counter() - start:.2f} s, load {load()}", flush=True)
        backend._engine.close(timeout=60)
    finally:
        HFEngine.step = step
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


class Runner:
    """One round of a variant (on fresh prompts unless given): (seconds, tokens, KV rows bytes, KV grow bytes)."""

    def __init__(self, model, tokenizer, args: argparse.Namespace, manager=None) -> None:
        self.model, self.tokenizer, self.args, self.manager = model, tokenizer, args, manager
        self.cuda = args.device.startswith("cuda")
        self.grown = count_growth()
        self.rounds = 0

    def episodes(self) -> Episodes:
        self.rounds += 1  # every call its own prompts and seeds
        return Episodes(self.args, self.model.config.vocab_size, seed=self.rounds)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, variant: str, data: Episodes | None = None) -> tuple[float, int, int, int]:
        data = data or self.episodes()
        # A fresh backend each round: its prefix cache starts empty, as at a new collect after a weight update.
        settings = DIAGNOSIS.get(variant)
        backend = HFBackend(self.model, self.tokenizer, cudnn_attention=settings[1] if settings else False)
        engine = None
        if settings is not None:
            # Exact shapes: rows as they are, prefills unpadded, a KV width one column wider each step.
            engine = backend._engine = HFEngine(backend, worker=settings[0], padded_shapes=settings[2],
                                                width_block=WIDTH_BLOCK if settings[2] else 1)
        kv_rows.KV_COPIES.bytes, self.grown[0] = 0, 0
        self.sync()
        start = time.perf_counter()
        if variant == "submit" or settings is not None:
            tokens = run_submit(backend, data, engine)
        elif variant == "lockstep":
            tokens = run_lockstep(backend, data)
        elif variant == "plain":
            tokens = run_plain(self.model, self.tokenizer, data)
        else:
            tokens = run_hf_cb(self.manager, data)
        self.sync()
        seconds = time.perf_counter() - start
        if backend._engine is not None:
            backend._engine.close(timeout=60)
        return seconds, tokens, kv_rows.KV_COPIES.bytes, self.grown[0]


def measure(runner: Runner, variants: list[str], repeats: int) -> dict[str, list[tuple[float, int, int, int, str]]]:
    """A warm-up round of every variant (other prompts), then `repeats` alternating rounds, each
    round on fresh prompts, the same for every variant of the round (each on a fresh backend)."""
    warm_up = runner.episodes()
    for variant in variants:  # warm-up: allocator, kernels, lazy imports
        runner.run(variant, warm_up)
    results: dict[str, list[tuple[float, int, int, int, str]]] = {v: [] for v in variants}
    for round_ in range(repeats):
        data = runner.episodes()
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            seconds, tokens, rows, grow = runner.run(variant, data)
            results[variant].append((seconds, tokens, rows, grow, load()))
            print(f"  round {round_} {variant}: {tokens} tokens in {seconds:.2f} s = {rate(tokens / seconds)} tokens/s, "
                  f"KV copied per token rows {rows / tokens:,.0f} B grow {grow / tokens:,.0f} B, load {load()}",
                  flush=True)
    return results


def table(results: dict[str, list[tuple[float, int, int, int, str]]], repeats: int) -> None:
    plain = statistics.median(r[1] / r[0] for r in results["plain"]) if results.get("plain") else None
    print(f"| variant | tokens/s (median of {repeats}) | runs | vs plain | KV rows B/token | KV grow B/token | load |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        speeds = [tokens / seconds for seconds, tokens, *_ in runs]
        median = statistics.median(speeds)
        ratio = f"{median / plain:.2f}x" if plain else "-"
        print(f"| {variant} | {rate(median)} | {', '.join(rate(s) for s in speeds)} | {ratio} | "
              f"{statistics.median(r[2] / r[1] for r in runs):,.0f} | {statistics.median(r[3] / r[1] for r in runs):,.0f} | "
              f"{', '.join(r[4].split('/')[0] for r in runs)} |", flush=True)


def verdict(seconds: dict[str, float], device: str) -> str:
    """The `verdict:` line: which engine settings remove a fixed cost per round, from the median
    round times (the same prompts' sizes for every variant)."""
    plain = seconds["plain"]
    near = {v: seconds[v] <= FIXED_COST_SLACK * plain for v in DIAGNOSIS}
    extra = {v: seconds[v] - plain for v in DIAGNOSIS}
    if near["fresh-thread"]:
        return (f"verdict: no fixed cost on {device}: the engine's old settings (fresh-thread) take "
                f"{seconds['fresh-thread']:.2f} s a round against plain generate's {plain:.2f} s "
                f"(the default engine {seconds['engine']:.2f} s)")
    fixes = [v for v in ("main-thread", "no-cudnn", "padded", "engine") if near[v]]
    causes = []
    if near["main-thread"]:
        causes.append("per-thread state built again by a fresh thread (main-thread removes it)")
    if near["no-cudnn"]:
        causes.append("cuDNN's attention (no-cudnn removes it)")
    if near["padded"]:
        causes.append("new attention shapes each step (padded removes it)")
    head = f"verdict: fixed cost {extra['fresh-thread']:.2f} s a round on {device} (fresh-thread {seconds['fresh-thread']:.2f} s, plain {plain:.2f} s)"
    if not fixes:
        return head + "; no variant removes it: cause still open, see the profile's top kernels"
    return head + f"; removed by {', '.join(fixes)}: " + "; ".join(causes or ["the engine's settings together"])


def diagnose(model, tokenizer, args: argparse.Namespace) -> None:
    runner = Runner(model, tokenizer, args)
    variants = ["plain", *DIAGNOSIS]
    results = measure(runner, variants, args.repeats)
    table(results, args.repeats)
    medians = {v: statistics.median(r[0] for r in runs) for v, runs in results.items()}
    print("| variant | worker | cuDNN attention | padded shapes | seconds a round (median) | minus plain |")
    print("|---|---|---|---|---|---|")
    for variant, (worker, cudnn, padded) in DIAGNOSIS.items():
        print(f"| {variant} | {worker} | {'allowed' if cudnn else 'excluded'} | {'yes' if padded else 'no'} | "
              f"{medians[variant]:.3f} | {medians[variant] - medians['plain']:+.3f} |")
    profile_kernels(runner)
    device = torch.cuda.get_device_name() if runner.cuda else "cpu"
    print(verdict(medians, device), f"(load {load()})", flush=True)


def profile_kernels(runner: Runner, top: int = 12) -> None:
    """One fresh-thread round under torch.profiler, every thread recorded: the ops with the most
    own CPU time (where kernel planning shows) and, on CUDA, the kernels with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.cuda else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        config = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):  # a torch without it records the calling thread only
        config = {}
        print("profiler: this torch records the calling thread only; the engine's thread is left out")
    with profile(activities=activities, **config) as prof:
        seconds, tokens, *_ = runner.run("fresh-thread")
    print(f"profiled fresh-thread round: {tokens} tokens in {seconds:.2f} s (under the profiler), load {load()}")
    averages = prof.key_averages()
    print(f"top {top} ops by own CPU time:")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60), flush=True)
    if runner.cuda:
        print(f"top {top} by own CUDA time (kernels):")
        print(averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512, help="tokens of each episode's first prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per turn (the most, with --ragged)")
    parser.add_argument("--observation", type=int, default=8, help="tokens appended after each response")
    parser.add_argument("--ragged", action="store_true", help="each turn its own response length (1/4 to all of --new-tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant after the warm-up")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, one more submit round under cProfile (engine steps): top 20 by own time")
    parser.add_argument("--diagnose", action="store_true",
                        help="the engine's fixed cost per round: plain generate against the engine's settings, "
                             "a profiled round, a verdict line")
    parser.add_argument("--quick", action="store_true", help="a short dry run: 2 episodes, 2 turns, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.turns, args.prompt, args.new_tokens, args.repeats = 2, 2, 64, 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    torch.set_grad_enabled(False)
    model, tokenizer = build(args.model, args.device, dtype)
    print(f"model={args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype}) "
          f"device={args.device} torch {torch.__version__} threads={torch.get_num_threads()} episodes={args.episodes} "
          f"turns={args.turns} prompt={args.prompt} new_tokens={args.new_tokens}{' ragged' if args.ragged else ''} "
          f"observation={args.observation} load={load()}", flush=True)
    if args.diagnose:
        diagnose(model, tokenizer, args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS) - set(DIAGNOSIS))
    if unknown:
        parser.error(f"unknown variants {', '.join(unknown)} (known: {', '.join(VARIANTS + tuple(DIAGNOSIS))})")
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
    runner = Runner(model, tokenizer, args, manager)
    results = measure(runner, variants, args.repeats)
    if manager is not None:
        manager.stop(block=True, timeout=10)
    if args.profile:
        profile_submit(model, tokenizer, runner.episodes())
    table(results, args.repeats)


if __name__ == "__main__":
    main()
