"""The `fedlora` command line. Each subcommand lives in `fedlora.commands.<name>` and exposes
``register(subparsers)``; this file only wires them and turns bad input into exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from fedlora import __version__
from fedlora.errors import FedloraError

# Order is the order of `fedlora --help`.
COMMANDS = (
    "run",
    "eval",
    "export",
    "plan",
    "compare",
    "report",
    "config",
    "flower",
    "profiles",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`fedlora run: error: ...`, exit 2) without
    the usage block above it; `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fedlora",
        description="Federated LoRA fine-tuning over heterogeneous wireless networks.",
    )
    parser.add_argument("--version", action="version", version=f"fedlora {__version__}")
    parser.add_argument(
        "--verbose", action="store_true", help="show other libraries' warnings and progress bars"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"fedlora.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # overrides may follow options (`run --out X a.b=1 --data-dir D c.d=2`): argparse
        # leaves those after the first option unparsed
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    from fedlora.commands.terminal import quiet_libraries

    quiet_libraries(args.verbose)
    try:
        return int(args.func(args) or 0)
    except FedloraError as e:
        print(f"fedlora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an unwritable path: one line, not a traceback
        from fedlora.federation.runfiles import os_error_message

        print(f"fedlora {args.command}: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedlora {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
