"""vLLM's output passes through serve unchanged (to serve's own stdout and stderr, so the journal or
supervisord's log reads as before), and serve keeps what names the cause when the engine fails to start:
the first exception line of a traceback, e.g. `torch._inductor.exc.InvalidCxxCompiler: No working C++
compiler found ...`, rather than the end of the traceback a tail of the log shows."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import BinaryIO

# vLLM prefixes what its worker processes print with their name: "(EngineCore_DP0 pid=123) ...".
_PROCESS_PREFIX = re.compile(r"^\((?:[\w.:-]+) pid=\d+\) ")
# "ValueError: ...", "torch._inductor.exc.InvalidCxxCompiler: ...", or a bare "KeyboardInterrupt".
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?::\s.*|:?)$")
# argparse: "api_server.py: error: unrecognized arguments: --bogus".
_USAGE_ERROR = re.compile(r"^\S+: error: .+")
# vLLM's log lines: "ERROR 12-04 16:10:00 [core.py:700] EngineCore failed to start."
_ERROR_LOG = re.compile(r"^(?:ERROR|CRITICAL)\b")
MAX_CAUSE = 500


def _strip(line: str) -> str:
    return _PROCESS_PREFIX.sub("", line.rstrip("\r\n"))


class CauseFinder:
    """Reads the engine's output line by line and keeps the best guess at why it failed:
    the first exception line of a traceback, else an argument error, else the first ERROR line,
    else the last line it printed."""

    def __init__(self) -> None:
        self._in_traceback: dict[str, bool] = {}  # per stream: stdout and stderr interleave
        self.exception: str | None = None
        self.usage_error: str | None = None
        self.error_log: str | None = None
        self.last: str | None = None
        self._lock = threading.Lock()

    def feed(self, raw: str, stream: str = "") -> None:
        line = _strip(raw)
        if not line.strip():
            return
        with self._lock:
            self.last = line.strip()
            if line.startswith("Traceback (most recent call last):"):
                self._in_traceback[stream] = True
                return
            if self._in_traceback.get(stream):
                if line[:1].isspace() or line.startswith("^"):
                    return  # a frame, its source line, or the caret marks under it
                self._in_traceback[stream] = False
                if self.exception is None and _EXCEPTION.match(line):
                    self.exception = line.strip()
                    return
            if self.usage_error is None and _USAGE_ERROR.match(line):
                self.usage_error = line.strip()
            elif self.error_log is None and _ERROR_LOG.match(line):
                self.error_log = line.strip()

    def cause(self) -> str | None:
        with self._lock:
            found = self.exception or self.usage_error or self.error_log or self.last
        return found[:MAX_CAUSE] if found else None


def root_cause(lines: Iterable[str]) -> str | None:
    finder = CauseFinder()
    for line in lines:
        finder.feed(line)
    return finder.cause()


def tee(source: BinaryIO, sink: BinaryIO, finder: CauseFinder, stream: str) -> threading.Thread:
    """Copy `source` to `sink` line by line, in a thread, feeding each line to `finder`."""

    def copy() -> None:
        with source:
            for raw in iter(source.readline, b""):
                try:
                    sink.write(raw)
                    sink.flush()
                except (OSError, ValueError):
                    pass  # serve's own output is gone (a closed pipe): keep reading so vLLM never blocks
                finder.feed(raw.decode(errors="replace"), stream)

    thread = threading.Thread(target=copy, name=f"engine-{stream}", daemon=True)
    thread.start()
    return thread
