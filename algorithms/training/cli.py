"""`seeupo-train --config FILE [dotted.key=value ...]`: train with one of the four algorithms or a plug-in.

Examples:
    seeupo-train --config configs/tiny-cpu.yaml
    seeupo-train --config configs/tiny-cpu.yaml algorithm.name=grpo train.steps=5
    seeupo-train --config configs/bfcl-seeupo.yaml --plugin my_algo.py algorithm.name=my_algo
    accelerate launch --num_processes 2 -m scripts.train --config configs/tiny-cpu.yaml

Distribution (DDP, FSDP, DeepSpeed, mixed precision) comes from `accelerate config` /
`accelerate launch` flags, not from this file.
"""

from __future__ import annotations

import argparse
import logging
import sys

from algorithms.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seeupo-train",
        description="Train an LLM agent with PPO, GRPO, GSPO, SeeUPO or a plug-in algorithm.",
    )
    parser.add_argument("--config", help="YAML config file (see configs/); defaults apply without one")
    parser.add_argument("--plugin", action="append", default=[], help="Python file registering algorithms (repeatable)")
    parser.add_argument("--resume", help="checkpoint folder, or 'latest' (the newest under log.output_dir)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=1e-5")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"resume_from={args.resume}")
    try:
        config = load_config(args.config, overrides)
        config.plugins = config.plugins + args.plugin
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        from algorithms.trainer import Trainer

        trainer = Trainer(config)
    except ConfigError as error:
        print(f"seeupo-train: bad config: {error}", file=sys.stderr)
        return 2
    with trainer:
        records = trainer.train()
    last = [r for r in records if "rollout/reward_mean" in r]
    if trainer.is_main and last:
        print(f"done: step {trainer.state.step}, last reward {last[-1]['rollout/reward_mean']:.4f}, "
              f"run folder {trainer.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
