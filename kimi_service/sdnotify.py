"""sd_notify(3) over $NOTIFY_SOCKET: READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

A few lines of socket code instead of a dependency; outside systemd (no $NOTIFY_SOCKET) every
call is a no-op, so `serve` also runs by hand.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(path: str) -> str | bytes:
    # A leading "@" names a Linux abstract socket, which the kernel spells with a NUL byte.
    return b"\0" + path[1:].encode() if path.startswith("@") else path


def format_message(fields: Mapping[str, object]) -> bytes:
    for key, value in fields.items():
        if "\n" in str(value) or "=" in key:
            raise ValueError(f"sd_notify field {key}={value!r} must be one line")
    return "\n".join(f"{key}={value}" for key, value in fields.items()).encode()


class Notifier:
    def __init__(self, socket_path: str | None):
        self.socket_path = socket_path
        self._sock: socket.socket | None = None
        if socket_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Notifier:
        return cls(env.get("NOTIFY_SOCKET") or None)

    def notify(self, **fields: object) -> None:
        if self._sock is None or self.socket_path is None:
            return
        try:
            self._sock.sendto(format_message(fields), _address(self.socket_path))
        except OSError as exc:
            # systemd gone (e.g. during shutdown) must not take the engine down with it.
            log.warning("sd_notify to %s failed: %s", self.socket_path, exc)
