"""One serve per state directory, and vLLM never outlives it.

A second serve on the same state directory would kill the first one's engine as a leftover: serve holds an
exclusive lock on `<state_dir>/serve.lock` for its whole life (the kernel drops it when serve dies, however it
dies), and a second serve that cannot take it exits without touching anything.

The kernel kills the engine when serve dies (PR_SET_PDEATHSIG), a guard process
then kills the rest of its group, and a start kills an engine process group a serve that died left behind
(recorded in `<state_dir>/run/engine.pgid`).

The death signal reaches only the API server: vLLM's engine core and workers, its children, survive it
(measured on 0.32: reparented to PID 1, holding the model's memory). The guard, in a session of its own so
that a kill of serve's group spares it, waits on a pipe only serve holds open; when serve dies, however it
dies, the pipe closes and the guard kills the engine's whole group.

Under systemd the unit's cgroup already catches strays; under supervisord or a shell nothing else would,
and a stray engine holds the GPUs' memory and the API port, so the next engine cannot start.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kimi_service.errors import UsageError
from kimi_service.files import write_atomic
from kimi_service.untrusted import read_json

log = logging.getLogger(__package__)

_PR_SET_PDEATHSIG = 1

SERVE_LOCK = "serve.lock"
# Never follow a link planted where the lock file goes (serve may still be root), never block on a FIFO,
# and never hand the lock to the engine: it must die with serve.
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@contextlib.contextmanager
def serve_lock(state_dir: Path) -> Iterator[None]:
    """Hold `<state_dir>/serve.lock` (with serve's PID in it) while the block runs; UsageError, with nothing
    else done, when another serve holds it or the path is not a plain file of one link."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / SERVE_LOCK
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o600)
    except OSError as exc:
        why = "it is a symbolic link; remove it" if exc.errno == errno.ELOOP else exc.strerror
        raise UsageError(f"{path}: cannot open serve's lock file: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise UsageError(f"{path}: not a plain file of one link, so not serve's lock file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise UsageError(f"another serve (PID {holder if holder.isdigit() else 'not yet written'}) runs on "
                             f"{state_dir}; stop it first: a second one would kill its engine") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get `signum` when the thread that spawned it exits.

    libc is looked up here, in the parent, so the child between fork and exec only makes one call.
    Spawn from serve's main thread: the signal follows the spawning thread, not the process.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # serve died before the signal was armed
            os.kill(os.getpid(), signum)

    return set_signal


_GUARD = ("import os, signal, sys\n"
          "sys.stdin.buffer.read()\n"  # returns once serve, the only writer, closed the pipe or died
          "try:\n    os.killpg(int(sys.argv[1]), signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n")


def guard_group(pgid: int) -> subprocess.Popen[bytes]:
    """A process that kills process group `pgid` once serve dies, or once serve closes its stdin."""
    return subprocess.Popen([sys.executable, "-c", _GUARD, str(pgid)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


@dataclass(frozen=True)
class GroupMember:
    pid: int
    uid: int
    cmdline: str


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[GroupMember]:
    """Processes of process group `pgid`, read from /proc (those that vanish while read are skipped)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Field 5 is the pgrp; the command name before it is in parentheses and may hold spaces.
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":  # a zombie holds nothing; its reaper is not us
                continue
            uid = int((entry / "status").read_text().split("\nUid:", 1)[1].split()[0])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        members.append(GroupMember(int(entry.name), uid, cmdline))
    return members


def is_engine(member: GroupMember) -> bool:
    """vLLM's API server, its headless launcher, or one of the worker processes they start
    (which vLLM names `VLLM::...`, or which run Python's multiprocessing entry points)."""
    text = member.cmdline.lower()
    return "vllm" in text or "kimi_service.vllm_cli" in text or "multiprocessing" in text


class EngineGroupRecord:
    """The engine's process group, written when vLLM starts and removed once it is stopped."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, pgid: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"pgid": pgid, "uid": os.getuid()}) + "\n", mode=0o644)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def kill_leftover(self, proc: Path = Path("/proc"), wait: float = 10.0) -> int:
        """Kill the group a serve that died left running, if it is still vLLM of our uid; returns how many
        processes it had (0: nothing left, or the pgid now belongs to something else)."""
        try:
            recorded = read_json(self.path)
            pgid, uid = int(recorded["pgid"]), int(recorded["uid"])
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s is unreadable; not killing anything it may name", self.path)
            self.clear()
            return 0
        members = group_members(pgid, proc)
        ours = [m for m in members if m.uid == os.getuid() == uid]
        if not ours or len(ours) != len(members) or not any(is_engine(m) for m in ours):
            self.clear()
            return 0
        log.warning("an engine left by a serve that died still runs (process group %d: pids %s); killing it",
                    pgid, " ".join(str(m.pid) for m in ours))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + wait
        while group_members(pgid, proc) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.clear()
        return len(ours)
