"""Requests that reached this host but that vLLM has not seen yet, from the kernel's socket tables.

vLLM's GET /load and /metrics count only what its API server has read. A request still in the listen
socket's accept queue, or whose bytes the API server has not read (its event loop starved on a busy
machine), is counted nowhere; a drain that stopped the engine then would cut it with a 500. The kernel
knows: in /proc/net/tcp{,6}, a LISTEN socket's rx_queue is its accept backlog, and an established
socket's rx_queue is the bytes received and not yet read. A connection still in the accept queue is listed
as well, established with inode 0 (no process has a socket for it yet): the backlog counts it once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

ESTABLISHED, SYN_RECV, LISTEN = "01", "03", "0A"
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def waiting_in_table(lines: Iterable[str], port: int) -> int:
    """Connections to local `port` that wait for the server, in one /proc/net/tcp-format table:
    the accept backlog of its LISTEN sockets, handshakes under way, and established connections with
    unread bytes."""
    waiting = 0
    for line in lines:
        fields = line.split()
        # "sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode ..."
        # (the first line is that header)
        if len(fields) < 10 or ":" not in fields[1] or fields[0] == "sl":
            continue
        try:
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            rx_queue = int(fields[4].split(":")[1], 16)
            accepted = fields[9] != "0"
        except (IndexError, ValueError):
            continue
        if local_port != port:
            continue
        state = fields[3].upper()
        if state == LISTEN:
            waiting += rx_queue
        elif state == SYN_RECV or (state == ESTABLISHED and rx_queue > 0 and accepted):
            waiting += 1
    return waiting


def waiting_connections(port: int, tables: Iterable[Path] = TABLES) -> int | None:
    """Over IPv4 and IPv6, in this network namespace; None when no table is readable."""
    total, read = 0, False
    for table in tables:
        try:
            lines = table.read_text().splitlines()
        except OSError:
            continue
        read = True
        total += waiting_in_table(lines, port)
    return total if read else None
