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
    ("trace", "trace"),
    ("native", "native"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or with `only` (a sub-command's name) of that one alone: each
    sub-command's module is imported to add its parser, and `stratagem launch` must not pay for the others'
    imports (torch, the strategies) before it starts its tasks."""
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="Train PyTorch models with tf.distribute-style strategies; never a silent fallback.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what stratagem decides")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, module_name in COMMANDS:
        if only is not None and command != only:
            continue
        module = importlib.import_module(f"stratagem.cli.{module_name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = "stratagem"
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser(_command_named(given))
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


def _command_named(argv: list[str]) -> str | None:
    """The sub-command `argv` names (its first argument that is not an option), when it is a known one; None
    otherwise (no command, --help, a misspelt one: then every sub-command's parser is built, for the help)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in {command for command, _ in COMMANDS} else None


if __name__ == "__main__":
    sys.exit(main())
