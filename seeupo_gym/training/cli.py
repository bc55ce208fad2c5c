"""The command lines: `seeupo-train`, `seeupo-eval` and `seeupo-export`.

    seeupo-train --config smoke                                      # the tiny model learns on CPU in ~a minute
    seeupo-train --config tiny-cpu                                   # a preset name or a YAML path
    seeupo-train --config tiny-cpu --config mine.yaml train.steps=5  # files merge in order, overrides last
    seeupo-train --config smoke --out runs/smoke-2                   # a new run needs a folder without a run
    seeupo-train --config smoke train.steps=30 --resume latest       # continue the run in runs/smoke
    seeupo-train --config bfcl-seeupo --plugin my_algo.py algorithm.name=my_algo
    seeupo-train --config paper-bfcl --plan-only --gpus 1 --gpu-memory 80   # memory per GPU, no GPU needed
    accelerate launch --num_processes 2 -m seeupo_gym.training.cli --config tiny-cpu

    seeupo-eval --model embedded --env seeupo/TurnBandit-v0 --env-kwargs '{"variant": "easy"}' -k 4
    seeupo-eval --checkpoint runs/demo/seeupo/seed-0/checkpoints/step-8 -k 4 -n 8 --out eval.json
    seeupo-eval --config bfcl-seeupo --split test --max-tasks 50 -k 1

    seeupo-export runs/x/checkpoints/step-10 out/merged             # a standalone HF folder
    seeupo-export runs/x --format jsonl|hf [OUT]                    # the run's rollouts as a dataset

Distribution (DDP, FSDP, DeepSpeed, mixed precision) comes from `accelerate config` /
`accelerate launch` flags. seeupo-eval reports avg@k and the unbiased pass@k per category; its
settings come from (later wins) the defaults, the checkpoint's config.yaml or --config, dotted
overrides, then the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from seeupo_gym.training.config import Config, ConfigError, config_from_dict, load_config
from seeupo_gym.training.interrupts import EXIT_INTERRUPTED, Interrupts
from seeupo_gym.training.memory_plan import DeviceError
from seeupo_gym.agents.backends.vllm_server import ServeError

# check_model_source and EVAL_MAX_NEW_TOKENS live with the model sources; seeupo-train uses the check too.
from seeupo_gym.training.model_source import EVAL_MAX_NEW_TOKENS, ModelSource, ServerCheckError, check_model_source

def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:400] + " ..."


def quiet_libraries() -> None:
    """What a checkpoint spilled: accelerate's INFO lines, its note that the tied lm_head was left out
    (expected: the embeddings hold it), and transformers' shard-writing bars."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    logging.getLogger("accelerate.utils.other").addFilter(lambda record: "Removed shared tensor" not in record.getMessage())
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def parse_train_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-train",
        description="Train an LLM agent with PPO, GRPO, GSPO, SeeUPO or a plug-in algorithm.",
    )
    parser.add_argument("--config", action="append", help="a preset name (smoke, tiny-cpu, demo, ...) or a YAML "
                        "file; repeat to merge several, a later one winning; defaults apply without one")
    parser.add_argument("--plugin", action="append", default=[], help="Python file registering algorithms (repeatable)")
    parser.add_argument("--out", help="the run's folder (log.output_dir); it must hold no other run")
    parser.add_argument("--resume", help="'latest' (the newest checkpoint of the run in the run folder), or a checkpoint "
                        "folder of that run (in a folder without a run: a new run starting from it)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--plan-only", action="store_true", help="print the memory plan (learner and colocated vLLM, "
                        "per GPU) and exit, on any machine: no weights loaded, no GPU needed; exit 2 when it does not fit")
    parser.add_argument("--gpus", type=int, default=1, help="--plan-only: GPUs of the run, one training process each "
                        "(default 1)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                        help="--plan-only: memory of each GPU in GiB (default 80)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=1e-5")
    return parser.parse_intermixed_args(argv)  # overrides before, between or after the flags


def train_main(argv: list[str] | None = None) -> int:
    args = parse_train_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"resume_from={args.resume}")
    try:
        config = load_config(args.config, overrides)
        config.plugins = config.plugins + args.plugin
        if args.out:
            config.log.output_dir = args.out
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        if args.plan_only:
            return plan_only(config, args.gpus, args.gpu_memory)
        from seeupo_gym.training.memory_plan import check_device_request, check_memory_early
        from seeupo_gym.training.trainer import Trainer

        # A GPU or engine this machine lacks, or a run its memory cannot hold: said before anything
        # loads or is fetched (the trainer plans again on the device accelerate gives it).
        check_device_request(config)
        check_memory_early(config)
        check_model_source(config.model.name_or_path)
        trainer = Trainer(config)
    except DeviceError as error:  # no such device here, or a run that cannot fit it (the memory plan)
        print(f"seeupo-train: {error}", file=sys.stderr)
        return 2
    except ConfigError as error:
        print(f"seeupo-train: bad config: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a model or file that does not load: the cause, not a traceback
        print(f"seeupo-train: {_one_line(error)}", file=sys.stderr)
        return 2
    except (ServeError, ServerCheckError) as error:  # generation.serve did not come up; generation.base_url does not answer
        print(f"seeupo-train: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:  # Ctrl-C while the model loads
        print(interrupted_line("seeupo-train", error, 0, None, ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    from seeupo_gym.training.collection import RolloutError

    with Interrupts() as interrupts:
        try:
            try:
                records = trainer.train()
            finally:
                with interrupts.ignored():  # a second Ctrl-C waits for the envs and servers to close
                    trainer.close()
        except KeyboardInterrupt as error:
            if trainer.is_main:
                print(interrupted_line("seeupo-train", error, trainer.state.step, trainer.last_checkpoint,
                                       resume_command(sys.argv[1:] if argv is None else argv)), file=sys.stderr)
            return EXIT_INTERRUPTED
        except RolloutError as error:  # the env or the model server failed the step (its cause in one line)
            print(f"seeupo-train: {_one_line(error)}", file=sys.stderr)
            return 1
    last = [r for r in records if "rollout/reward_mean" in r]
    if trainer.is_main and last:
        print(f"done: step {trainer.state.step}, last reward {last[-1]['rollout/reward_mean']:.4f}, "
              f"run folder {trainer.output_dir}")
    return 0


def plan_only(config: Config, gpus: int, gpu_memory_gib: float) -> int:
    """seeupo-train --plan-only: the plan from the model's shape alone (its config.json or the table of
    known shapes), on GPUs described by the flags rather than found."""
    from seeupo_gym.algorithms.base import algorithm_class
    from seeupo_gym.training.memory_plan import plan_report

    if gpus < 1 or not gpu_memory_gib > 0:
        raise ConfigError(f"--gpus must be >= 1 and --gpu-memory > 0 GiB (got {gpus}, {gpu_memory_gib})")
    try:
        needs_value_model = bool(getattr(algorithm_class(config.algorithm.name), "needs_value_model", False))
    except ValueError:  # a plug-in's algorithm: its value model, if any, is not counted
        needs_value_model = False
    lines, fits = plan_report(config, gpus=gpus, gpu_memory_gib=gpu_memory_gib, needs_value_model=needs_value_model)
    print("\n".join(lines))
    return 0 if fits else 2


def resume_command(argv: Sequence[str], program: str = "seeupo-train") -> str:
    """The command line that continues an interrupted run: the same one, with `--resume latest`."""
    import shlex

    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    return shlex.join([program, *kept, "--resume", "latest"])


def interrupted_line(program: str, error: BaseException, step: int, checkpoint: Path | None, command: str) -> str:
    """One line after Ctrl-C or SIGTERM: what is kept and the command that continues."""
    signal_name = getattr(error, "signal_name", "SIGINT")
    if step == 0 or checkpoint is None:
        return f"{program}: stopped by {signal_name} before step 1 finished: nothing to keep; run the same command again"
    return f"{program}: stopped by {signal_name}; step {step} is kept in {checkpoint}; continue with: {command}"



def resolve_config(
    config_paths: Sequence[str] | str | None, checkpoint: str | None, overrides: Sequence[str]
) -> Config:
    """Defaults < checkpoint's config.yaml (or the --config files, merged in order) < dotted overrides."""
    if checkpoint is not None:
        saved = Path(checkpoint) / "config.yaml"
        if not Path(checkpoint).is_dir():
            raise ConfigError(f"checkpoint {checkpoint!r} is not a folder (expected e.g. runs/x/checkpoints/step-10)")
        if not config_paths and saved.is_file():
            config_paths = str(saved)
    config = load_config(config_paths, overrides)
    # A checkpoint's config may carry resume_from; evaluation never resumes training.
    config.resume_from = None
    return config


def parse_eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-eval",
        description="avg@k and unbiased pass@k of a model or checkpoint on an env's tasks, per category.",
    )
    source = parser.add_argument_group("what to evaluate")
    source.add_argument("--checkpoint", help="a trainer checkpoint folder (runs/<run>/checkpoints/step-N)")
    source.add_argument("--config", action="append", help="a preset name or a YAML trainer config (model / env / "
                        "sampling settings); repeat to merge several, a later one winning")
    source.add_argument("--model", help="'embedded', 'tiny', a Hugging Face id or a local path (model.name_or_path)")
    source.add_argument("--env", help="env id, e.g. seeupo/TurnBandit-v0 (env.id)")
    source.add_argument("--env-kwargs", type=json.loads, default=None, help="JSON merged into env.kwargs, e.g. '{\"split\": \"test\"}'")
    source.add_argument("--split", help="the env's task split, e.g. test (sets env.kwargs.split; BFCL, AppWorld)")
    source.add_argument("--tasks", help="comma-separated task ids (default: env.eval_tasks, else all of the env's tasks)")
    source.add_argument("--max-tasks", type=int, help="evaluate only the first N tasks")
    server = parser.add_argument_group("a model on an OpenAI-compatible server (vLLM, SGLang, an API)")
    server.add_argument("--base-url", help="the server's URL, e.g. http://127.0.0.1:8000/v1; --model is the served name")
    server.add_argument("--api-key-env", default="OPENAI_API_KEY",
                        help="environment variable holding the API key (default OPENAI_API_KEY; never printed)")
    server.add_argument("--mode", choices=("chat", "tokens"), default="chat",
                        help="chat: messages and tools (any API model); tokens: token ids and logprobs "
                             "(vLLM's completions extensions; needs --tokenizer)")
    server.add_argument("--tokenizer", help="tokens mode: the served model's tokenizer ('tiny', 'embedded', an id or path)")
    server.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    server.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                        help="the deadline of each attempt of a request, headers and body together (default 120 s)")
    server.add_argument("--episode-timeout", type=float, default=1800.0, metavar="S",
                        help="chat mode: the deadline of a whole episode, every turn and retry included; the "
                             "episode ends with an error there (default 1800 s)")
    metric = parser.add_argument_group("how")
    metric.add_argument("--protocol", choices=("paper",),
                        help="paper: the SeeUPO paper's evaluation (its preset's test split, each task 4 times at "
                             "temperature 0, avg@4 and pass@4 in the paper's table layout)")
    metric.add_argument("-k", type=int, default=1, help="k of avg@k / pass@k (default 1)")
    metric.add_argument("-n", type=int, help="rollouts per task, >= k (default k); n > k lowers the variance of pass@k")
    metric.add_argument("--temperature", type=float, help="sampling temperature (default: sampling.temperature)")
    metric.add_argument("--max-new-tokens", type=int,
                        help=f"tokens per response (default: the config's sampling.max_new_tokens; "
                             f"{EVAL_MAX_NEW_TOKENS} without a config)")
    metric.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    metric.add_argument("--num-envs", type=int, help="envs stepped together (default: env.num_envs)")
    output = parser.add_argument_group("output")
    output.add_argument("--out", help="write the result as JSON to this file")
    output.add_argument("--rollouts", help="write one JSON line per rollout (task, reward, actions) to this file")
    output.add_argument("--export-bfcl", metavar="DIR",
                        help="BFCL: also write the episodes as bfcl-eval result files in its layout (DIR/rollout-<r>/"
                             "gpt-4o-2024-11-20/multi_turn/BFCL_v4_multi_turn_<category>_result.json, a prompting "
                             "model's folder), scored by `bfcl evaluate` (docs/training.md)")
    output.add_argument("--json", action="store_true", help="print JSON instead of the table")
    output.add_argument("--no-progress", action="store_true", help="no progress bar (it moves every turn)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. env.kwargs.variant=easy")
    return parser.parse_intermixed_args(argv)


PAPER_PRESETS = {"seeupo/BFCL-v4-v0": "paper-bfcl", "seeupo/BFCL-v4-base-v0": "paper-bfcl", "seeupo/AppWorld-v0": "paper-appworld"}
PAPER_K = 4


def _apply_protocol(args: argparse.Namespace) -> None:
    """--protocol paper: the paper's preset for the env, 4 rollouts per task at temperature 0 (its
    authors' eval_pass_n and verl's validation sampling; see the presets' comments)."""
    if args.protocol != "paper":
        return
    if args.config is None:
        env = args.env or "seeupo/BFCL-v4-v0"
        if env not in PAPER_PRESETS:
            raise ConfigError(f"--protocol paper covers {sorted(PAPER_PRESETS)}, not {env!r}")
        args.config = PAPER_PRESETS[env]
    if (args.k, args.n) not in ((1, None), (PAPER_K, None), (PAPER_K, PAPER_K)):
        raise ConfigError(f"--protocol paper fixes k = n = {PAPER_K}; leave -k and -n out")
    args.k, args.n = PAPER_K, PAPER_K
    if args.temperature is None:
        args.temperature = 0.0
    given = args.env_kwargs if isinstance(args.env_kwargs, dict) else {}
    if (args.base_url and args.mode == "chat" and "action_format" not in given
            and (args.env_kwargs is None or isinstance(args.env_kwargs, dict))
            and not any(o.startswith("env.kwargs.action_format=") for o in args.overrides)):
        # A chat server answers with tool calls, which the ReAct format (the paper's prompt) would drop.
        args.env_kwargs = {**given, "action_format": "tools"}
        print("seeupo-eval: --protocol paper on a chat server: the env's tools format, the way a chat API calls "
              "functions (the paper's prompt is the ReAct text format: --mode tokens keeps it)", file=sys.stderr)


def paper_table(result: Any) -> str:
    """The result as a row of the paper's results table (avg@4 and pass@4, in percent)."""
    bench = "AppWorld" if "AppWorld" in result.env_id else "BFCL"
    return (f"| model | {bench} avg@{result.k} | {bench} pass@{result.k} |\n|---|---|---|\n"
            f"| {result.model} | {100 * result.avg_at_k:.1f} | {100 * result.pass_at_k:.1f} |")


def eval_main(argv: list[str] | None = None) -> int:
    args = parse_eval_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _apply_protocol(args)
        config = resolve_config(args.config, args.checkpoint, args.overrides)
        if args.model:
            config.model.name_or_path = args.model
        if args.env:
            config.env.id = args.env
        # The flags go over the config's eval env (env.kwargs, then env.eval_kwargs).
        flags: dict = {}
        if args.env_kwargs is not None:
            if not isinstance(args.env_kwargs, dict):
                raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
            flags.update(args.env_kwargs)
        if args.split:
            flags["split"] = args.split
        config = config_from_dict(config.to_dict())  # re-check the values the flags set
        from seeupo_gym.training.tasks import eval_env_kwargs, eval_task_ids

        env_kwargs = eval_env_kwargs(config.env, flags)
        if args.export_bfcl and "BFCL" not in config.env.id:
            raise ConfigError(f"--export-bfcl writes bfcl-eval result files: it needs a BFCL env, not {config.env.id}")
        if args.tasks:
            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        else:
            tasks = eval_task_ids(config.env, flags)
        if args.max_tasks is not None:
            if args.max_tasks < 1:
                raise ConfigError(f"--max-tasks must be >= 1, got {args.max_tasks}")
            tasks = tasks[: args.max_tasks]
        n = args.n if args.n is not None else args.k
        if args.k < 1 or n < args.k:
            raise ConfigError(f"need 1 <= k <= n, got k={args.k}, n={n}")
        max_new_tokens = args.max_new_tokens or (
            config.sampling.max_new_tokens if _settings_given(args) else EVAL_MAX_NEW_TOKENS
        )
        source = _eval_source(args, config.model.name_or_path)
        source.check()
        print(f"seeupo-eval: {source.describe()} on {config.env.id}: {len(tasks)} tasks x {n} rollouts, at most "
              f"{max_new_tokens} new tokens per turn (--max-new-tokens)", file=sys.stderr)
        opened = source.open(config)
    except ConfigError as error:
        print(f"seeupo-eval: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a model or checkpoint that does not load: the cause, not a traceback
        print(f"seeupo-eval: {_one_line(error)}", file=sys.stderr)
        return 2
    except ServerCheckError as error:  # --base-url: a dead or mistyped server, before any episode
        print(f"seeupo-eval: {error}", file=sys.stderr)
        return 2
    from seeupo_gym.training.model_source import evaluate_source

    from seeupo_gym.remote import RemoteEnvError

    try:
        result = evaluate_source(
            opened, config, tasks, env_kwargs=env_kwargs, k=args.k, n=n, temperature=args.temperature,
            max_new_tokens=max_new_tokens, seed=args.seed, num_envs=args.num_envs, progress=not args.no_progress,
            keep_rollouts=bool(args.rollouts or args.export_bfcl),
        )
    except RemoteEnvError as error:  # a served env that cannot be made at all (its episodes' errors are scored)
        print(f"seeupo-eval: {_one_line(error)}", file=sys.stderr)
        return 1
    finally:
        opened.close()
    data = result.to_dict()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2, default=str) + "\n")
    if args.rollouts:
        Path(args.rollouts).parent.mkdir(parents=True, exist_ok=True)
        with open(args.rollouts, "w") as f:
            for record in result.rollouts:
                f.write(json.dumps(record, default=str) + "\n")
    if args.export_bfcl:
        from seeupo_gym.bfcl.export import bfcl_evaluate_command, write_results

        written = write_results(result.rollouts, args.export_bfcl, env_kwargs)
        print(f"seeupo-eval: bfcl-eval result files: {', '.join(map(str, written))}; bfcl-eval's own score of the "
              f"first rollouts (make bfcl-eval-venv): {bfcl_evaluate_command(args.export_bfcl, bfcl='.venv-bfcl/bin/bfcl')}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(f"{result.model}{' @ ' + args.checkpoint if args.checkpoint else ''} on {result.env_id} "
              f"{result.env_kwargs}: {len(result.tasks)} tasks x {n} rollouts, T={result.temperature}, "
              f"{result.wall_seconds:.1f} s")
        print(result.table())
        if args.protocol == "paper":
            print(paper_table(result))
    if result.all_failed_on_the_server:
        print(f"seeupo-eval: every episode ({result.backend_errors}) ended with backend_error: the scores above measure "
              f"no model; first: {result.backend_error_episodes[0]}", file=sys.stderr)
        return 1
    return 0


def _eval_source(args: argparse.Namespace, name: str) -> ModelSource:
    """seeupo-eval's flags as a ModelSource: --base-url's served model, else the config's model
    (with --checkpoint's weights)."""
    if args.base_url is None:
        return ModelSource(name, checkpoint=args.checkpoint)
    if args.checkpoint:
        raise ConfigError("--base-url evaluates the served model; load the checkpoint into the server instead of --checkpoint")
    if args.mode == "tokens" and not args.tokenizer:
        raise ConfigError("--mode tokens needs --tokenizer (the served model's: 'tiny', 'embedded', an id or a path)")
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
    source = ModelSource(name, base_url=args.base_url, api_key_env=args.api_key_env, mode=args.mode,
                         tokenizer=args.tokenizer, concurrency=args.concurrency,
                         request_timeout_s=args.request_timeout, episode_timeout_s=args.episode_timeout)
    for flag, value in (("--request-timeout", args.request_timeout), ("--episode-timeout", args.episode_timeout)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    return source


def _settings_given(args: argparse.Namespace) -> bool:
    """Whether a config file (--config, or the checkpoint's) or an override sets the sampling."""
    saved = args.checkpoint is not None and (Path(args.checkpoint) / "config.yaml").is_file()
    return args.config is not None or saved or any(o.startswith("sampling.max_new_tokens=") for o in args.overrides)


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seeupo-export",
        description="Write a checkpoint's policy as a standalone Hugging Face folder (LoRA merged into its base); "
        "with --format, a run's recorded rollouts as a dataset (docs/rollouts.md).",
    )
    parser.add_argument("checkpoint", help="a trainer checkpoint folder (runs/<run>/checkpoints/step-N); "
                        "with --format, a run folder")
    parser.add_argument("out", nargs="?", help="the folder to write (config.json, safetensors, tokenizer); with --format, "
                        "the file (jsonl) or folder (hf) to write (default: in the run folder)")
    parser.add_argument("--format", choices=("jsonl", "hf"), help="export the run's rollouts: one JSON line per episode, "
                        "or a Hugging Face `datasets` folder (load_from_disk)")
    args = parser.parse_intermixed_args(argv)  # RUN_DIR --format jsonl OUT
    if args.format is not None:
        from seeupo_gym.training.rollouts import export_rollouts

        default = "rollouts.jsonl" if args.format == "jsonl" else "rollouts-hf"
        try:
            out = export_rollouts(args.checkpoint, args.out or Path(args.checkpoint) / default, args.format)
        except (FileNotFoundError, ImportError, ValueError) as error:
            print(f"seeupo-export: {_one_line(error)}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0
    if args.out is None:
        parser.error("the folder to write is required when exporting a checkpoint")
    from seeupo_gym.training.checkpoint import export_merged

    try:
        config = resolve_config(None, args.checkpoint, [])
        out = export_merged(config, args.checkpoint, args.out)
    except ConfigError as error:
        print(f"seeupo-export: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"seeupo-export: {_one_line(error)}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
