"""The drain's view of requests vLLM has not read yet, from the kernel's socket tables, against real sockets."""

from __future__ import annotations

import socket
import time

from kimi_service.launcher.sockets import waiting_connections, waiting_in_table


def _settle(port: int, expected: int) -> int:
    """The kernel updates its queues as packets arrive on loopback: look again briefly before deciding."""
    deadline = time.monotonic() + 2
    while (found := waiting_connections(port)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def test_a_connection_not_yet_accepted_then_unread_bytes_then_nothing() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        assert waiting_connections(port) == 0
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
            # In the accept queue: the server has not even seen the connection.
            assert _settle(port, 1) == 1
            accepted, _ = listener.accept()
            with accepted:
                # Accepted, but its bytes not read: a starved event loop.
                assert _settle(port, 1) == 1
                assert accepted.recv(4096).startswith(b"POST")
                # Read: from now on vLLM's own counters see it.
                assert _settle(port, 0) == 0
                # The client side (local port ephemeral, remote port the API port) never counts.
                accepted.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
                assert _settle(port, 0) == 0


def test_two_connections_in_the_accept_queue_count_two() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port)):
            assert _settle(port, 2) == 2


def test_the_table_format_other_ports_and_states() -> None:
    table = [
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode",
        "   0: 00000000:1F40 00000000:0000 0A 00000000:00000003 00:00000000 00000000     0        0 1 1",  # listen, 3
        "   1: 0100007F:1F40 0100007F:C350 01 00000000:0000004E 00:00000000 00000000     0        0 2 1",  # unread
        "   2: 0100007F:1F40 0100007F:C351 01 00000000:00000000 00:00000000 00000000     0        0 3 1",  # read
        "   3: 0100007F:C352 0100007F:1F40 01 00000000:00000010 00:00000000 00000000     0        0 4 1",  # a client
        "   4: 0100007F:1F40 0100007F:C353 03 00000000:00000000 00:00000000 00000000     0        0 5 1",  # handshake
        "   6: 0100007F:1F40 0100007F:C354 01 00000000:00000020 00:00000000 00000000     0        0 0 1",  # queued
        "   5: 00000000:1F41 00000000:0000 0A 00000000:00000009 00:00000000 00000000     0        0 6 1",  # other port
    ]
    assert waiting_in_table(table, 8000) == 3 + 1 + 1
    assert waiting_in_table(table, 8001) == 9


def test_no_readable_table_is_unknown(tmp_path) -> None:
    assert waiting_connections(8000, [tmp_path / "missing"]) is None
