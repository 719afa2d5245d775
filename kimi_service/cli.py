"""Command line: `kimi-service <command>`. Parses arguments and calls one function per command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kimi_service import __version__
from kimi_service.errors import KimiError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-service",
        description="Plan, run, check and monitor a vLLM endpoint on NVIDIA GPU hosts.",
    )
    parser.add_argument("--version", action="version", version=f"kimi-service {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args) or 0)
    except KimiError as exc:
        print(f"kimi-service: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
