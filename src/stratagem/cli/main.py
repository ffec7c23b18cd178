"""Entry point of the ``stratagem`` command: one module per sub-command.

Each sub-command module defines ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (sub-command, module under stratagem.cli)
COMMANDS = [
    ("devices", "devices"),
    ("doctor", "doctor"),
    ("train", "train"),
    ("launch", "launch"),
    ("bench", "bench"),
    ("checkpoint", "checkpoint"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="Train PyTorch models with tf.distribute-style strategies; never a silent fallback.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what stratagem decides")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, module_name in COMMANDS:
        module = importlib.import_module(f"stratagem.cli.{module_name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = "stratagem"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = f"stratagem {args.command}" if args.command else command
        args.argv = list(sys.argv[1:] if argv is None else argv)  # for commands that relaunch themselves
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
        )
        if args.command is None:
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C: as tidy as SIGTERM. Each command's own clean-up (closing a strategy, stopping a launched
        # cluster's tasks) ran on the way out.
        print(f"{command}: interrupted (Ctrl-C); stopped.", file=sys.stderr, flush=True)
        return 130
    except OSError as error:
        # A file the command reads or writes that the system refuses: one line, not a traceback.
        print(f"{command}: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
