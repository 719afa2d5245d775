"""Small HTTP listeners (the exporter's /metrics, serve's /ready) that idle clients cannot exhaust.

The standard library's threading servers start one thread per connection and wait forever for a
request line, so every connection opened and left idle held a thread for good. Here a handler gives up
on a client silent for IDLE_TIMEOUT seconds, and at most MAX_HANDLERS connections are handled at once.
When all are taken, a new connection does not wait for one to time out (a balancer's 5 s check or a
scrape would fail behind a handful of idle clients): the oldest open connection is hung up on. Every
answer here takes milliseconds, so the oldest connection is the one that has been silent longest.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from socketserver import BaseServer, ThreadingMixIn
from typing import Any

IDLE_TIMEOUT = 5.0
MAX_HANDLERS = 32
# A backlog of this many connections waits for a free handler instead of being refused.
BACKLOG = 128


class BoundedThreadingMixIn(ThreadingMixIn):
    """Mix in before a socketserver class; its handler class should set `timeout = IDLE_TIMEOUT`."""

    daemon_threads = True
    request_queue_size = BACKLOG
    max_handlers = MAX_HANDLERS

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_handlers)
        self._closing = threading.Event()
        self._open: dict[socket.socket, float] = {}  # connections being handled, by when they came
        self._open_lock = threading.Lock()
        super().server_activate()  # type: ignore[misc]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._hang_up_oldest()
            # The accept loop waits for the hung-up handler's slot, waking to notice a shutdown.
            while not self._slots.acquire(timeout=0.2):
                if self._closing.is_set():
                    self.shutdown_request(request)  # type: ignore[attr-defined]
                    return
                self._hang_up_oldest()
        with self._open_lock:
            self._open[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def _hang_up_oldest(self) -> None:
        """Wake the handler of the longest-open connection with end-of-file; it ends and frees its slot."""
        with self._open_lock:
            if not self._open:
                return
            oldest = min(self._open, key=self._open.__getitem__)
            del self._open[oldest]  # hung up on once; its slot is freed when its handler ends
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # an idle client timed out or one hung up: nothing to report
        super().handle_error(request, client_address)  # type: ignore[misc]

    def shutdown(self) -> None:
        self._closing.set()
        super().shutdown()  # type: ignore[misc]


def server_class(base: type[BaseServer], host: str, name: str) -> type[Any]:
    """`base` (an HTTPServer or WSGIServer) bounded, for `host`'s address family, reusing the address:
    systemd restarts a failed unit while its old socket may sit in TIME_WAIT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return type(name, (BoundedThreadingMixIn, base), {"address_family": family, "allow_reuse_address": True})
