"""`seeupo-compare`'s command line: parse, plan (checked before any run), run, report.

    seeupo-compare --config demo --algorithms seeupo,grpo --out runs/demo
    seeupo-compare --config tiny-cpu --algorithms seeupo,grpo,gspo,ppo --seeds 0,1 train.steps=4
    # an ablation: a label=name pair runs `name` under `label`, --set gives it options
    seeupo-compare --config demo --algorithms seeupo,natural=seeupo --set natural.order=natural
    seeupo-compare --report-only runs/demo        # rebuild report.md / curves.png from the JSONL
    # every method as many optimizer steps per batch as the one taking the most (SeeUPO's per turn pool)
    seeupo-compare --config smoke-multiturn --algorithms seeupo,gigpo --match steps

    # models side by side (evaluation only, seeupo-eval's protocol): a model per label
    seeupo-compare --model base=embedded --model trained=runs/demo/seeupo/seed-0/checkpoints/step-8 \
        --model gpt=gpt-4o-mini@https://api.openai.com/v1 --env seeupo/BFCL-v4-v0 \
        --eval-env-kwargs '{"action_format": "tools", "split": "test"}' -k 4 --out runs/models
    seeupo-compare --model a=tiny --model served=m@http://127.0.0.1:8000/v1 --set served.mode=tokens \
        --set served.tokenizer=tiny --set served.api_key_env=MY_KEY ...
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from typing import Any

from seeupo_gym.training.compare.match import MATCHES
from seeupo_gym.training.compare.plan import (
    EvalPlan,
    build_models_plan,
    build_plan,
    load_raw,
    parse_algorithms,
    parse_models,
    parse_seeds,
    parse_sets,
)
from seeupo_gym.training.compare.report import RUN_INFO, write_report
from seeupo_gym.training.config import ConfigError, config_from_dict
from seeupo_gym.training.interrupts import EXIT_INTERRUPTED, Interrupts
from seeupo_gym.training.model_source import ServerCheckError, check_training_server

# Without --model: algorithms trained from the shared config.
DEFAULT_ALGORITHMS = "seeupo,grpo"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-compare",
        description="Train several algorithms on the same env, model, seeds and budget; write a report with curves. "
        "With --model: evaluate several models (local, checkpoints, served) side by side instead.",
    )
    parser.add_argument("--config", action="append", help="a preset name (e.g. demo, smoke) or a YAML file; shared by "
                        "every run; repeat to merge several, a later one winning")
    parser.add_argument("--algorithms",
                        help=f"comma-separated registered names, or label=name pairs (default {DEFAULT_ALGORITHMS})")
    parser.add_argument("--model", action="append", default=[], metavar="LABEL=SPEC",
                        help="evaluate models instead of training (repeatable, one per label). SPEC: 'tiny', 'embedded', "
                        "a Hugging Face id or local folder; a checkpoint folder (runs/x/checkpoints/step-N); or "
                        "NAME@URL, a model on an OpenAI-compatible server (--set LABEL.api_key_env / mode / "
                        "tokenizer / concurrency, as seeupo-eval's flags; the key is read from the variable, "
                        "default OPENAI_API_KEY, and never written)")
    parser.add_argument("--set", action="append", default=[], metavar="LABEL.key=value",
                        help="an option for one label only: an algorithm's, e.g. seeupo.order=natural, or a served "
                        "model's, e.g. gpt.api_key_env=MY_KEY (repeatable)")
    parser.add_argument("--env", help="env id, e.g. seeupo/BFCL-v4-v0 (sets env.id)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, the same for every algorithm (default 0)")
    parser.add_argument("--out", help="run folder (default: log.output_dir of the config)")
    parser.add_argument("--plugin", action="append", default=[], help="Python file registering algorithms (repeatable)")
    parser.add_argument("--match", choices=MATCHES,
                        help="the budget held equal: samples (default; the same rollouts, each method its own optimizer "
                        "steps) or steps (also as many optimizer steps per batch as the method taking the most, "
                        "through more epochs)")
    group = parser.add_argument_group("evaluation")
    group.add_argument("--eval-every", type=int, default=EvalPlan.every, help="steps between evaluations (0: start and end only)")
    group.add_argument("-k", "--eval-k", type=int, default=EvalPlan.k, help="k of avg@k / pass@k")
    group.add_argument("-n", "--eval-n", type=int, help="rollouts per eval task (>= k; default k)")
    group.add_argument("--eval-tasks", type=int, default=EvalPlan.max_tasks, help="number of eval tasks (0: all)")
    group.add_argument("--eval-task-ids", help="comma-separated eval task ids (default: env.eval_tasks or the env's tasks)")
    group.add_argument("--eval-temperature", type=float,
                       help=f"default {EvalPlan.temperature}; with --model, the config's sampling.temperature (as seeupo-eval)")
    group.add_argument("--max-new-tokens", type=int,
                       help="with --model: tokens per response (default: the config's sampling.max_new_tokens with "
                       "--config or an override, else 256, as seeupo-eval)")
    group.add_argument("--eval-env-kwargs", type=json.loads, default={},
                       help="JSON merged over env.kwargs for evaluation, e.g. '{\"split\": \"test\"}'")
    group.add_argument("--no-eval-at-start", action="store_true", help="skip the evaluation before training")
    parser.add_argument("--save-checkpoints", action="store_true", help="save each run's final checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--resume", action="store_true", help="continue the comparison in the run folder (the same "
                        "command): finished runs are kept, an interrupted one goes on from its last finished step")
    parser.add_argument("--report-only", metavar="FOLDER", help="rebuild report.md / curves.png of an existing run folder")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the shared config")
    return parser.parse_intermixed_args(argv)  # overrides anywhere on the line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from seeupo_gym.training.cli import quiet_libraries

    quiet_libraries()
    try:
        if args.report_only:
            print(f"report: {write_report(args.report_only)}")
            return 0
        from seeupo_gym.algorithms.base import load_plugin

        overrides = list(args.overrides) + ([f"env.id={args.env}"] if args.env else [])
        raw = load_raw(args.config, overrides)
        if args.model:
            return _compare_models(args, raw, argv)
        if args.max_new_tokens is not None:
            raise ConfigError("--max-new-tokens is for --model comparisons; a training comparison takes "
                              "sampling.max_new_tokens=N")
        # Loaded before any run starts so that a broken plug-in fails the whole plan at once;
        # --plugin files join the config so that each run's config.yaml can be resumed.
        raw["plugins"] = list(raw.get("plugins") or []) + list(args.plugin)
        for plugin in raw["plugins"]:
            try:
                load_plugin(plugin)
            except Exception as error:  # a user's file: say which one and why
                raise ConfigError(f"plugin {plugin!r} failed to load: {type(error).__name__}: {error}") from error
        if not isinstance(args.eval_env_kwargs, dict):
            raise ConfigError(f"--eval-env-kwargs must be a JSON object, got {args.eval_env_kwargs!r}")
        eval_plan = EvalPlan(
            every=args.eval_every,
            k=args.eval_k,
            n=args.eval_n,
            tasks=[t.strip() for t in args.eval_task_ids.split(",") if t.strip()] if args.eval_task_ids else None,
            max_tasks=args.eval_tasks,
            temperature=EvalPlan.temperature if args.eval_temperature is None else args.eval_temperature,
            env_kwargs=dict(args.eval_env_kwargs),
            at_start=not args.no_eval_at_start,
        )
        output = args.out or config_from_dict(raw).log.output_dir
        plan = build_plan(
            raw,
            parse_algorithms(args.algorithms or DEFAULT_ALGORITHMS),
            parse_seeds(args.seeds),
            output,
            eval_plan,
            options=parse_sets(args.set),
            save_checkpoints=args.save_checkpoints,
            match=args.match or "samples",
        )
        check_training_server(plan.runs[0].config)  # generation.backend: openai, before any run
    except ConfigError as error:
        print(f"seeupo-compare: {error}", file=sys.stderr)
        return 2
    except ServerCheckError as error:  # a dead or mistyped server, before any run
        print(f"seeupo-compare: {error}", file=sys.stderr)
        return 2
    runs = ", ".join(f"{r.label}/seed-{r.seed}" for r in plan.runs)
    print(f"seeupo-compare: {len(plan.runs)} run(s) ({runs}), {len(plan.eval_tasks)} eval tasks -> {plan.output_dir}",
          file=sys.stderr)
    warning = long_compare_warning(plan)
    if warning:
        print(warning, file=sys.stderr)
    from seeupo_gym.training.compare.run import run_all

    try:
        with Interrupts():  # SIGTERM as Ctrl-C: the running run keeps its last finished step
            folder = run_all(plan, progress=not args.no_progress, command=_command(argv), resume=args.resume)
    except KeyboardInterrupt as stop:  # CompareInterrupted, or between two runs
        print(_interrupted_line(stop, argv), file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as error:  # --resume into a folder of another plan
        print(f"seeupo-compare: {error}", file=sys.stderr)
        return 2
    print(f"report: {folder / 'report.md'}")
    print(f"curves: {folder / 'curves.png'}")
    return _exit_code(folder, len(plan.runs))


def _compare_models(args: argparse.Namespace, raw: dict[str, Any], argv: list[str] | None) -> int:
    """seeupo-compare --model ...: every model evaluated as seeupo-eval would, one report."""
    from seeupo_gym.training.model_source import EVAL_MAX_NEW_TOKENS

    if args.algorithms:
        raise ConfigError("--model evaluates models and --algorithms trains; give one of them")
    if args.plugin or args.save_checkpoints or args.no_eval_at_start or args.eval_every != EvalPlan.every or args.match:
        raise ConfigError("--plugin, --save-checkpoints, --eval-every, --no-eval-at-start and --match are for training "
                          "comparisons; a --model comparison evaluates once per model and seed")
    if not isinstance(args.eval_env_kwargs, dict):
        raise ConfigError(f"--eval-env-kwargs must be a JSON object, got {args.eval_env_kwargs!r}")
    eval_plan = EvalPlan(
        k=args.eval_k,
        n=args.eval_n,
        tasks=[t.strip() for t in args.eval_task_ids.split(",") if t.strip()] if args.eval_task_ids else None,
        max_tasks=args.eval_tasks,
        temperature=args.eval_temperature,
        env_kwargs=dict(args.eval_env_kwargs),
    )
    config = config_from_dict(raw)
    # seeupo-eval's rule: a config's response budget when one is given, else a short one.
    given = bool(args.config) or any(o.startswith("sampling.max_new_tokens=") for o in args.overrides)
    max_new_tokens = args.max_new_tokens or (config.sampling.max_new_tokens if given else EVAL_MAX_NEW_TOKENS)
    plan = build_models_plan(raw, parse_models(args.model, parse_sets(args.set)), parse_seeds(args.seeds),
                             args.out or config.log.output_dir, eval_plan, max_new_tokens)
    print(f"seeupo-compare: {len(plan.models)} models ({', '.join(r.label for r in plan.models)}) x "
          f"{len(plan.seeds)} seed(s) on {config.env.id}: {len(plan.eval_tasks)} tasks x {eval_plan.n} rollouts, at "
          f"most {max_new_tokens} new tokens per turn -> {plan.output_dir}", file=sys.stderr)
    for run in plan.models:  # every server answers before the first evaluation starts
        if run.source.served:
            try:
                run.source.open(run.config).close()
            except ServerCheckError as error:
                raise ServerCheckError(f"--model {run.label}: {error}") from None
    from seeupo_gym.training.compare.run import evaluate_models

    try:
        with Interrupts():
            folder = evaluate_models(plan, progress=not args.no_progress, command=_command(argv), resume=args.resume)
    except KeyboardInterrupt as stop:  # CompareInterrupted, or between two runs
        print(_interrupted_line(stop, argv), file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as error:  # --resume into a folder of another plan
        print(f"seeupo-compare: {error}", file=sys.stderr)
        return 2
    print(f"report: {folder / 'report.md'}")
    print(f"scores: {folder / 'scores.png'}")
    return _exit_code(folder, len(plan.models))


def _interrupted_line(stop: Any, argv: list[str] | None) -> str:
    """One line after Ctrl-C or SIGTERM: where it stopped and the command that continues the plan."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["seeupo-compare", *args, *([] if "--resume" in args else ["--resume"])])
    where = f" in {stop.run}" if getattr(stop, "run", None) else ""
    kept = f" (its step {stop.step} is kept)" if getattr(stop, "step", 0) else ""
    return (f"seeupo-compare: stopped by {getattr(stop, 'signal_name', 'SIGINT')}{where}{kept}; "
            f"continue with: {command}")


def _exit_code(folder: Any, runs: int) -> int:
    """0 unless every run (or model) failed: one failure is reported beside the others' results."""
    failures = json.loads((folder / RUN_INFO).read_text()).get("failures") or {}
    if len(failures) >= runs:
        print(f"seeupo-compare: every run failed ({len(failures)}); see {folder / 'report.md'}", file=sys.stderr)
        return 1
    return 0


def _command(argv: list[str] | None) -> str:
    """The command line as typed (it names a key's variable, never the key)."""
    return "seeupo-compare " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def long_compare_warning(plan: Any) -> str | None:
    """`evaluation.long_run_warning` for a plan, on a machine without CUDA, for a model of known size."""
    import torch

    from seeupo_gym.training.compare.plan import plan_token_budget
    from seeupo_gym.training.evaluation import KNOWN_PARAMETERS, cpu_tokens_per_second, long_run_warning

    parameters = KNOWN_PARAMETERS.get(plan.runs[0].config.model.name_or_path)
    if parameters is None:  # a model of unknown size: no estimate before loading it
        return None
    return long_run_warning(
        "seeupo-compare", plan_token_budget(plan), cpu_tokens_per_second(parameters),
        on_cpu=not torch.cuda.is_available(),
        hint="fewer steps, tasks per step, group size, seeds, eval tasks or tokens (sampling.max_new_tokens) shorten it",
    )


if __name__ == "__main__":
    sys.exit(main())
