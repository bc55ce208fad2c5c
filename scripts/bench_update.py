"""Cost of one algorithm update through the trainer's learner: time, tokens fed, peak memory.

Same model (reset to the same initial weights before every run), same samples, same reuse
(epochs, minibatch_size), same learner as the trainer's. Batches are synthetic but shaped like
multi-turn episodes: turn t's context is turn t-1's context + response + observation.

Default mode: wall and CPU time of each algorithm's update (the paper reports SeeUPO at ~1.5x
GRPO at the step level). `--bfcl-shaped`: a ~1,500-token system prompt and task shared by a
group, 2-6 turns of up to 64-token responses and observations; prints per algorithm the tokens
fed to each model against that algorithm's minimum, and time. `--memory`: peak memory of a GRPO
update at minibatch 2, 8, 32 and 128 under one token budget (each size in a fresh process).
`--lora-last-layers K[,K2...]`: LoRA on the last K layers (the learner then computes the frozen
trunk's states once per trajectory), timed in the same run, interleaved, beside full fine-tuning
(`--no-full-finetuning` leaves that out).
`--model qwen2-102m`: a random-init Qwen2 with the real tokenizer, hidden 512, 8 layers (102M
parameters, 78M of them the tied embedding, used as the LM head at response positions only: the
transformer body dominates a forward); `--layers N` for another depth.

    python scripts/bench_update.py --bfcl-shaped --algorithms grpo,seeupo --lora-last-layers 4 \
        --model qwen2-102m --layers 24 --tasks 1 --group 4 --threads 1 --repeats 1
    python scripts/bench_update.py --bfcl-shaped --algorithms grpo,gspo,ppo,seeupo
    python scripts/bench_update.py --bfcl-shaped --memory
    python scripts/bench_update.py --model embedded --lora 8 --tasks 1 --group 4 --turns 4 \
        --context 1500 --response 64 --observation 64 --minibatch-size 4 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import torch
import yaml
from accelerate import Accelerator

from seeupo_gym.agents.models import build_tiny, load_model, tiny_config
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.training.learner import LLMLearner, ValueModel, frozen_copy, lm_backbone

MEMORY_MINIBATCHES = (2, 8, 32, 128)


def multi_turn_batch(
    tasks: int, group: int, turns: int, context: int, response: int, observation: int, vocab: int, seed: int,
    min_turns: int = 1,
) -> RolloutBatch:
    rng = random.Random(seed)
    trajectories = []
    for task in range(tasks):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        for g in range(group):
            ids = list(prompt)
            turn_list = []
            for _ in range(rng.randint(min_turns, turns)):
                reply = [rng.randrange(vocab) for _ in range(rng.randint(response // 2, response))]
                turn_list.append(Turn(list(ids), reply, [0.0] * len(reply)))
                ids += reply + [rng.randrange(vocab) for _ in range(rng.randint(observation // 2, observation))]
            trajectories.append(Trajectory(f"t{task}", f"t{task}", f"t{task}-{g}", turn_list, rng.random(), False))
    return RolloutBatch(trajectories)


def bfcl_shaped_batch(tasks: int, group: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """~1,500-token prompt per task, 2-6 turns, responses and observations of 32-64 tokens."""
    return multi_turn_batch(tasks, group, 6, 1500, 64, 64, vocab, seed, min_turns=2)


def packed_length(trajectory: Trajectory) -> int:
    last = trajectory.turns[-1]
    return len(last.context_ids) + len(last.response_ids)


def minimum_tokens(name: str, batch: RolloutBatch, options: dict) -> dict[str, int]:
    """Tokens each model must be fed per update, by algorithm.

    grpo / gspo / ppo: an old pass and a gradient pass over each packed trajectory per epoch
    (plus a reference pass when kl_coef > 0; ppo: the same two passes of the value model);
    grpo / gspo with one optimizer step over the batch need no old pass (`core.old_logprobs`).
    seeupo: old and reference passes packed, then the gradient passes of pool t are prefix-length
    (context_t + response_t per trajectory, per epoch) because the parameters change between
    pools; the ratios after pool t score the same prefixes again for trajectories with a pool to come
    (share_ratio_pass=false), or ride in the next pool's first gradient pass (default): there the
    turn-t prefix replaces the turn-(t-1) one, so each shared ratio costs the difference.
    """
    packed = sum(packed_length(t) for t in batch)
    epochs, kl = options.get("epochs", 1), options.get("kl_coef", 0.002) > 0
    out = {"reference": packed if kl else 0}
    if name != "seeupo":
        samples = sum(len(t.turns) for t in batch)
        one_step = name in ("grpo", "gspo") and epochs == 1 and samples <= options.get("minibatch_size", 64)
        out["policy"] = (0 if one_step else packed) + epochs * packed
        if name == "ppo":
            out["value"] = packed + epochs * packed
        return out
    prefix = sum(len(turn.context_ids) + len(turn.response_ids) for t in batch for turn in t.turns)
    # Reverse order: every pool but the last (turn 1) is followed by one that needs its ratios.
    ratios = sum(len(turn.context_ids) + len(turn.response_ids) for t in batch for turn in t.turns[1:])
    out["policy"] = packed + epochs * prefix + ratios
    if options.get("share_ratio_pass", True):
        out["policy"] -= sum(len(turn.context_ids) + len(turn.response_ids) for t in batch for turn in t.turns[:-1])
    return out


def parse_variant(spec: str) -> tuple[str, dict]:
    """`name` or `name+key=value+...` (e.g. `seeupo+share_ratio_pass=false`): an algorithm and its own options."""
    name, *pairs = spec.split("+")
    return name, {key: yaml.safe_load(value) for key, value in (pair.split("=", 1) for pair in pairs)}


class RssPeak:
    """Peak resident memory of this process while inside the block (a polling thread)."""

    def __enter__(self) -> "RssPeak":
        self.peak, self._running = self.now(), True
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()

    def _poll(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def qwen2_random(lora: dict | None, device: str, layers: int = 8):
    """Random-init Qwen2 with the real tokenizer, hidden 512: with 8 layers, 102M parameters (body 24M,
    tied embedding 78M); each layer adds 3.0M."""
    from transformers import AutoModelForCausalLM

    from seeupo_gym.agents.models import _apply_lora

    _, tokenizer = build_tiny()
    config = tiny_config(tokenizer)
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": layers, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 64, "layer_types": ["full_attention"] * layers})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.to(device).eval()
    return (_apply_lora(model, lora) if lora is not None else model), tokenizer


class UpdateBench:
    """One model, reset to the same initial trainable weights before every timed update.

    Only the trainable parameters are snapshot and restored (the LoRA adapter, or every weight
    for full fine-tuning), so the 0.5B model is held once, not copied per run.
    """

    def __init__(self, model, tokenizer, batch: RolloutBatch, lora: bool, lr: float, max_tokens: int, value: bool) -> None:
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.model = self.accelerator.prepare(model)
        self.reference = None if lora else frozen_copy(model)
        self.value_model = None
        if value:
            self.value_model = ValueModel(lm_backbone(frozen_copy(model)), model.config.hidden_size).to(self.accelerator.device)
            self.value_model.head.requires_grad_(True)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.initial = [p.detach().clone() for p in self.trainable]
        self.tokenizer, self.batch, self.lr, self.max_tokens = tokenizer, batch, lr, max_tokens
        self.trunk_cache_mib = 2048

    def run(self, name: str, options: dict) -> tuple[float, dict, LLMLearner]:
        with torch.no_grad():
            for param, value in zip(self.trainable, self.initial):
                param.copy_(value)
        optimizer = self.accelerator.prepare(torch.optim.AdamW(self.trainable, lr=self.lr))
        algorithm = make_algorithm(name, options)
        value_model = self.value_model if algorithm.needs_value_model else None
        value_optimizer = None
        if value_model is not None:
            # The critic trains its head only here: the bench counts its tokens, not its quality.
            value_optimizer = torch.optim.AdamW([p for p in value_model.parameters() if p.requires_grad], lr=self.lr)
        learner = LLMLearner(
            self.accelerator, self.model, optimizer, pad_token_id=self.tokenizer.pad_token_id, reference=self.reference,
            value_model=value_model, value_optimizer=value_optimizer, max_tokens_per_microbatch=self.max_tokens,
            trunk_cache_mib=self.trunk_cache_mib,
        )
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = algorithm.update(self.batch, learner, torch.Generator().manual_seed(0))
        # CPU time beside wall time: on a shared machine the wall time mostly measures the neighbours.
        metrics["cpu_s"] = time.process_time() - cpu_started
        seconds = time.perf_counter() - started
        if learner.trunk is not None:
            learner.tokens_fed["trunk"] = learner.trunk.stats["tokens"]
        optimizer.zero_grad(set_to_none=True)
        self.accelerator._optimizers.clear()  # drop this run's optimizer state
        return seconds, metrics, learner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | embedded | HF id / path")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--lora-last-layers", type=lambda text: [int(k) for k in text.split(",")], default=[],
                        help="K[,K2...]: LoRA (rank --lora or 8) on the last K layers only, timed beside full "
                             "fine-tuning in one run")
    parser.add_argument("--no-full-finetuning", action="store_true",
                        help="with --lora-last-layers: time only the LoRA setups")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of --model qwen2-102m (8: 102M parameters)")
    parser.add_argument("--trunk-cache-mib", type=int, default=2048, help="learner's frozen-trunk cache bound (0: off)")
    parser.add_argument("--bfcl-shaped", action="store_true", help="BFCL-shaped batch; print tokens fed / minimum")
    parser.add_argument("--memory", action="store_true", help="peak memory at minibatch 2, 8, 32, 128 (BFCL-shaped)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="T_max; trajectories have 1..T_max turns")
    parser.add_argument("--context", type=int, default=256, help="first-turn context tokens")
    parser.add_argument("--response", type=int, default=48, help="max response tokens per turn")
    parser.add_argument("--observation", type=int, default=32, help="max observation tokens per turn")
    parser.add_argument("--minibatch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8192, help="learner's max_tokens_per_microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithms", default="grpo,seeupo",
                        help="comma-separated; a variant adds its options: seeupo+share_ratio_pass=false")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def build(args: argparse.Namespace, value: bool, lora_rank: int | None = None, last_layers: int = 0) -> UpdateBench:
    rank = args.lora if lora_rank is None else lora_rank
    lora = {"r": rank, "alpha": 2 * rank} if rank else None
    if lora is not None and last_layers:
        lora["last_layers"] = last_layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model == "qwen2-102m":
        model, tokenizer = qwen2_random(lora, device, args.layers)
    else:
        model, tokenizer = load_model(args.model, lora=lora, device=device)
    vocab = min(len(tokenizer), 32000)
    if args.bfcl_shaped or args.memory or args.memory_child:
        batch = bfcl_shaped_batch(args.tasks, args.group, vocab)
    else:
        batch = multi_turn_batch(args.tasks, args.group, args.turns, args.context, args.response, args.observation, vocab, 0)
    samples = batch.samples()
    lora_text = "off" if lora is None else f"r={rank}" + (f" on the last {last_layers} layers" if last_layers else "")
    print(
        f"model={args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) lora={lora_text} "
        f"trajectories={len(batch)} turn samples={len(samples)} "
        f"T_max={batch.max_turns} response tokens={batch.num_response_tokens()} "
        f"max context={max(len(s.turn.context_ids) for s in samples)} packed tokens={sum(packed_length(t) for t in batch)} "
        f"minibatch={args.minibatch_size} epochs={args.epochs} max_tokens_per_microbatch={args.max_tokens}", flush=True
    )
    bench = UpdateBench(model, tokenizer, batch, lora is not None, 1e-5, args.max_tokens, value)
    bench.trunk_cache_mib = args.trunk_cache_mib
    return bench


def memory_child(args: argparse.Namespace) -> None:
    bench = build(args, value=False)
    options = {"minibatch_size": args.memory_child, "epochs": args.epochs}
    batch, bench.batch = bench.batch, RolloutBatch(bench.batch.trajectories[:1])
    bench.run("grpo", options)  # warm-up on one trajectory: allocator, kernels
    bench.batch = batch
    baseline = RssPeak.now()
    with RssPeak() as peak:
        seconds, metrics, _ = bench.run("grpo", options)
    print(f"MEMORY minibatch={args.memory_child} steps={metrics['optimizer_steps']:.0f} peak_rss={peak.peak} "
          f"growth={peak.peak - baseline} wall={seconds:.1f} cpu={metrics['cpu_s']:.1f}", flush=True)


def memory_sweep(args: argparse.Namespace) -> None:
    peaks = {}
    for size in MEMORY_MINIBATCHES:
        command = [sys.executable, __file__, "--memory-child", str(size), "--model", args.model, "--lora", str(args.lora),
                   "--tasks", str(args.tasks), "--group", str(args.group), "--max-tokens", str(args.max_tokens)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("MEMORY"))
        fields = dict(item.split("=") for item in line.split()[1:])
        peaks[size] = int(fields["peak_rss"])
        print(f"grpo minibatch {size:>4}: optimizer steps {fields['steps']:>3}, peak RSS {int(fields['peak_rss']) / 2**20:8.0f} MiB "
              f"(update adds {int(fields['growth']) / 2**20:6.0f} MiB), wall {fields['wall']} s, CPU {fields['cpu']} s", flush=True)
    ratio = peaks[MEMORY_MINIBATCHES[-1]] / peaks[MEMORY_MINIBATCHES[0]]
    print(f"peak RSS minibatch {MEMORY_MINIBATCHES[-1]} / minibatch {MEMORY_MINIBATCHES[0]}: {ratio:.3f}x "
          f"(budget {args.max_tokens} tokens per micro-batch; goal <= 1.15x)")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args)
    if args.memory:
        return memory_sweep(args)
    names = args.algorithms.split(",")
    variants = {spec: parse_variant(spec) for spec in names}
    options = {"minibatch_size": args.minibatch_size, "epochs": args.epochs}
    value = any(algorithm == "ppo" for algorithm, _ in variants.values())
    if args.lora_last_layers:
        setups = {f"LoRA last {k} layers": build(args, value, args.lora or 8, k) for k in args.lora_last_layers}
        if not args.no_full_finetuning:
            setups["full fine-tuning"] = build(args, value, 0)
    else:
        setups = {"": build(args, value)}
    print(f"load average before: {open('/proc/loadavg').read().strip()}", flush=True)
    for bench in setups.values():  # untimed warm-up (allocator, kernels, imports)
        bench.run(variants[names[0]][0], {**options, **variants[names[0]][1]})
    runs = [(setup, name) for setup in setups for name in names]
    times: dict[tuple, list[float]] = {run: [] for run in runs}
    cpu: dict[tuple, list[float]] = {run: [] for run in runs}
    steps: dict[tuple, float] = {}
    fed: dict[tuple, dict[str, int]] = {}
    for _ in range(args.repeats):
        for setup, name in runs:  # interleaved, so machine load drifts hit all alike
            algorithm, own = variants[name]
            seconds, metrics, learner = setups[setup].run(algorithm, {**options, **own})
            times[setup, name].append(seconds)
            cpu[setup, name].append(metrics["cpu_s"])
            fed[setup, name] = dict(learner.tokens_fed)
            print(f"  {setup + ': ' if setup else ''}{name}: wall {seconds:.2f} s, CPU {metrics['cpu_s']:.2f} s", flush=True)
            steps[setup, name] = metrics.get("optimizer_steps", float("nan"))
    print(f"load average after: {open('/proc/loadavg').read().strip()}")
    for setup in setups:
        if setup:
            print(f"[{setup}]")
        report(setup, setups[setup], names, variants, options, times, cpu, steps, fed)
    if len(setups) > 1 and all((setup, "grpo") in cpu for setup in setups):
        for name in (n for n in names if variants[n][0] == "seeupo"):
            figures = "; ".join(
                f"{setup} CPU {statistics.median(cpu[setup, name]) / statistics.median(cpu[setup, 'grpo']):.2f}x"
                for setup in setups
            )
            print(f"{name} / grpo: {figures}")


def report(setup, bench, names, variants, options, times, cpu, steps, fed) -> None:
    for name in names:
        run = (setup, name)
        print(f"{name:>8}: wall median {statistics.median(times[run]):7.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times[run])}), CPU median {statistics.median(cpu[run]):7.2f} s, "
              f"optimizer steps {steps[run]:.0f}")
    print("tokens fed per update / that algorithm's minimum (see minimum_tokens; trunk: the frozen layers' tokens, "
          "once per trajectory):")
    for name in names:
        algorithm, own = variants[name]
        minimum = minimum_tokens(algorithm, bench.batch, {**options, **own})
        got = fed[setup, name]
        parts = [f"{model} {got.get(model, 0)} / {need} = {got.get(model, 0) / need:.3f}"
                 for model, need in minimum.items() if need]
        total = sum(v for k, v in got.items() if k != "trunk") / sum(minimum.values())
        trunk = f"; trunk {got['trunk']}" if "trunk" in got else ""
        print(f"{name:>8}: {'; '.join(parts)}; all models {total:.3f}{trunk}")
    if (setup, "grpo") in times:
        for name in (n for n in names if variants[n][0] == "seeupo"):
            wall = statistics.median(times[setup, name]) / statistics.median(times[setup, "grpo"])
            cpu_ratio = statistics.median(cpu[setup, name]) / statistics.median(cpu[setup, "grpo"])
            tokens = fed[setup, name].get("policy", 0) / max(fed[setup, "grpo"].get("policy", 0), 1)
            print(f"{name} / grpo: policy tokens {tokens:.2f}x, update time wall {wall:.2f}x, CPU {cpu_ratio:.2f}x "
                  "(paper: ~1.5x time at the step level)")


if __name__ == "__main__":
    main()
