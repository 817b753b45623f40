"""`hf-ccl`: run a continual stream from a YAML config, or list what is available."""

from __future__ import annotations

import argparse
import sys

from .config import load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-ccl", description="Continual learning for CLIP models.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="Run a continual stream and print the results matrix.")
    train.add_argument("--config", help="YAML config (see recipes/configs/); default: the built-in defaults.")
    train.add_argument("overrides", nargs="*", help="Config overrides key=value, e.g. training.num_train_epochs=1")
    commands.add_parser("list", help="List the named streams and the methods.")
    return parser


def train_main(config_path: str | None, overrides: list[str]) -> int:
    from .distributed import is_main_process
    from .run import run

    config = load_config(config_path, overrides)
    results = run(config)
    if is_main_process():
        print(results.to_markdown())
        print(f"\nCheckpoints and results: {config.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        from .data.named import NAMED_STREAMS
        from .methods import available_methods

        print("streams:", ", ".join(sorted(NAMED_STREAMS)))
        print("methods:", ", ".join(available_methods()))
        return 0
    return train_main(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
