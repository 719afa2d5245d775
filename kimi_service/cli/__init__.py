"""Command line: `kimi-service <command>`. Parses arguments and calls one function per command: `model` holds
the commands that need no deployed host, `host` those that run on one, `args` what they share."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
from collections.abc import Sequence

from kimi_service import __version__
from kimi_service.cli import host, model
from kimi_service.errors import KimiError

SIGPIPE_EXIT_STATUS = 128 + signal.SIGPIPE
# A hub token is a few dozen characters: a --token-file far larger is not one.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-service",
        description="Plan, run, check and monitor a vLLM endpoint on NVIDIA GPU hosts.",
    )
    parser.add_argument("--version", action="version", version=f"kimi-service {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    model.add_plan(commands)
    host.add_bench(commands)
    host.add_serve(commands)
    host.add_tune(commands)
    host.add_health(commands)
    host.add_smoke(commands)
    host.add_ctl(commands)
    host.add_exporter(commands)
    model.add_fetch(commands)
    model.add_gpus(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = int(handler(args) or 0)
        sys.stdout.flush()  # a reader that left shows here rather than in the interpreter's exit
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        return _stdout_closed()
    except KimiError as exc:
        print(f"kimi-service: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket nobody reads any more (POLLERR on its write end): a broken pipe
    elsewhere (a child's stdin, a socket) is a fault of its own and keeps its traceback."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _stdout_closed() -> int:
    """`kimi-service plan ... | head -1`: the reader has what it wanted. Quiet, with the status a shell gives
    any command SIGPIPE stops (128 + 13), so `set -o pipefail` still sees the output was cut short; stdout
    goes to /dev/null so the interpreter's own flush at exit finds no pipe to break again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_EXIT_STATUS
