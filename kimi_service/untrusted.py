"""Reading what this service did not write itself: files in state dirs, model directories, engine answers.

Every such read is bounded. A path may name a file that never ends (/dev/zero), a FIFO nobody writes, or
a file far larger than any this service expects; JSON may nest until Python's stack runs out, or hold
numbers that are no numbers (NaN, Infinity, 1e400). Each of those becomes one UntrustedInput with a
one-line reason, which callers turn into exit 2 or a skipped file, never a traceback. The command line's
numbers are read here too: ASCII digits only, finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import time
from pathlib import Path
from typing import Any

# The largest JSON file this service reads (a safetensors index of a 1T-parameter model is ~10 MB).
MAX_JSON_BYTES = 64 << 20
# A file that has not ended after this long is a pipe or a device, not a file someone saved.
READ_TIMEOUT = 5.0


# Seconds beyond this are a typo (and overflow a thread wait): 30 days.
MAX_SECONDS = 30 * 24 * 3600.0
# A count read from outside (vLLM's /metrics, plan.json) beyond this is garbage, not a KV cache or a queue:
# it is the largest whole number a float (what Prometheus carries) holds exactly.
MAX_COUNT = 2**53


class UntrustedInput(ValueError):
    """Input that is too large, never ends, or does not parse; the message is one line."""


def read_bytes(path: Path | str, *, limit: int, timeout: float = READ_TIMEOUT) -> bytes:
    """At most `limit` bytes of `path` within `timeout` seconds, else UntrustedInput; OSError when the
    path cannot be opened (missing, a directory, a name too long). A FIFO never blocks the open."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UntrustedInput(f"{path}: still not at its end after {timeout:g} s; not a regular file?")
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            except BlockingIOError:
                select.select([fd], [], [], remaining)
                continue
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise UntrustedInput(f"{path}: larger than {limit:,} bytes; not a file this service reads")
            chunks.append(chunk)
    finally:
        os.close(fd)


def _refuse_constant(name: str) -> Any:
    raise UntrustedInput(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UntrustedInput(f"{text[:40]} is beyond a float's range")
    return value


def loads_json(data: bytes | str, what: str) -> Any:
    """JSON that nests as deep as Python's stack allows and holds only finite numbers, else UntrustedInput
    naming `what`."""
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise UntrustedInput(f"{what}: JSON nested too deep to read") from None
    except UntrustedInput as exc:
        raise UntrustedInput(f"{what}: {exc}") from None
    except ValueError as exc:  # malformed, not UTF-8, or an integer of thousands of digits
        raise UntrustedInput(f"{what}: not valid JSON: {str(exc).splitlines()[0][:200]}") from None


def read_json(path: Path | str, *, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file read with read_bytes' bounds and loads_json's checks."""
    return loads_json(read_bytes(path, limit=limit), str(path))


def _ascii_number(kind: type) -> Any:
    """An argparse type: `kind` from ASCII digits only (int('٨') is 8), never inf or nan."""
    def convert(text: str) -> Any:
        if not text.isascii():
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number written in ASCII digits")
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a finite number")
        return value

    convert.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return convert


whole = _ascii_number(int)
decimal = _ascii_number(float)


def seconds(text: str) -> float:
    """An argparse type for --wait and --every: finite, not negative, at most MAX_SECONDS (30 days)."""
    value = decimal(text)
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give seconds from 0 to {MAX_SECONDS:g}")
    return value
