"""Whose listener is on the API port: serve sends the key only to its own engine.

Any local program that binds the API port before vLLM does (or while it restarts) would otherwise be
taken for the engine and receive `Authorization: Bearer <key>` with serve's first probe. The kernel's
socket tables (/proc/net/tcp, tcp6) give each listening socket's inode and owner; the engine's process
group's file descriptors say which of those sockets are its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kimi_service.launcher.identity import user_name
from kimi_service.launcher.sockets import LISTEN, TABLES

PROC = Path("/proc")


@dataclass(frozen=True)
class Listener:
    inode: int
    uid: int


def listeners(port: int, tables: Iterable[Path] = TABLES) -> list[Listener]:
    """The sockets listening on TCP `port`, any address, in this network namespace."""
    found = []
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3].upper() != LISTEN:
                    continue
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.append(Listener(inode=int(fields[9]), uid=int(fields[7])))
    return found


def group_members(pgid: int, proc: Path = PROC) -> list[int]:
    """The processes of process group `pgid`."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name is in parentheses and may hold spaces: the fields after its last ')'.
            after = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(after[2]) == pgid:
                members.append(int(entry.name))
    return members


def socket_inodes(pid: int, proc: Path = PROC) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _owner(uid: int) -> str:
    name = user_name(uid)
    return f"user {name} (uid {uid})" if name else f"uid {uid}"


def foreign_listener(port: int, pgid: int, proc: Path = PROC) -> str | None:
    """None when every listener on `port` belongs to process group `pgid` (or there is none yet); else
    what holds the port, in words."""
    found = listeners(port)
    if not found:
        return None
    own: set[int] = set()
    for pid in group_members(pgid, proc):
        own |= socket_inodes(pid, proc)
    strangers = [listener for listener in found if listener.inode not in own]
    if not strangers:
        return None
    return "; ".join(f"a socket of {_owner(listener.uid)}" for listener in strangers)
