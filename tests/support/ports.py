"""A TCP port nothing listens on, for the servers the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out and released: free now; another process may take it later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
