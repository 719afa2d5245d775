"""Download a model's files over a bounded number of connections, resumably, without following links.

Each file is cut into byte ranges (one range for small files); a fixed pool of threads, one per
connection, works through the ranges of every file in listing order, so several files and the parts
of a large file travel at once. Each partial file `<name>.incomplete` has a state file beside it,
`<name>.incomplete.json`, written atomically: the commit, size and hash the listing gave, the ETag
the source sent, and how far each range got. A later run resumes only against the same commit and
ETag, and fetches only what the ranges still miss. Nothing is ever written beyond a range's end, so
a source cannot write more than it listed.

Bytes from two answers make one file only when that is provable: the source publishes the file's hash
(checked once it is whole), or it sent a strong ETag that each later range request repeats as If-Range
(a changed file then comes back whole) and the Content-Range's total is the listed size. A weak ETag or a
Last-Modified date can stay the same when a file is rewritten within a second: without a hash, such a
file travels as one range and an interrupted transfer starts over.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import httpx

from kimi_service.safedir import SafeDir
from kimi_service.weights_sources import (
    INCOMPLETE_SUFFIX,
    STATE_SUFFIX,
    FetchError,
    LocalSourceRefused,
    RemoteFile,
)
from kimi_service.weights_transport import CHUNK, RedirectRefused, Reply, open_range, strong_validator

STATE_VERSION = 1
MAX_CONNECTIONS = 32
DEFAULT_CONNECTIONS = 8
DEFAULT_RANGE_SIZE = 64 << 20
MIN_RANGE_SIZE = 64 << 10


class SourceMisbehaves(FetchError):
    """The source sent more than it listed: retrying would only do it again."""


class _Stale(Exception):
    """The partial file was written from another version of the file: start it over."""


class _Cancelled(Exception):
    """The file was started over (or the run stopped) while this range was in flight."""


class _NoRanges(Exception):
    """The source answered a range request with the whole file."""


_BEGIN = -1  # the task that opens a file and queues its ranges


# ---------------------------------------------------------------------------------------------
# Progress and verification


class Progress:
    """Bytes done / total and the rate, written atomically to a JSON file at most once a second."""

    def __init__(self, target: tuple[SafeDir, str] | None, total: int, files_total: int) -> None:
        self.target, self.total, self.files_total = target, total, files_total
        self.done = 0
        self.files_done = 0
        self.current = ""
        self.started = time.monotonic()
        self._last_write = 0.0
        self._in_flight: list[str] = []
        self._lock = threading.RLock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if time.monotonic() - self._last_write >= 1.0:
                self.write()

    def started_file(self, path: str) -> None:
        with self._lock:
            self._in_flight.append(path)
            self._show()

    def finished_file(self, path: str, *, done: bool) -> None:
        with self._lock:
            self._in_flight.remove(path)
            self.files_done += int(done)
            self._show()

    def _show(self) -> None:
        first = self._in_flight[0] if self._in_flight else ""
        more = len(self._in_flight) - 1
        self.current = f"{first} (+{more} more)" if more > 0 else first
        self.write()

    def write(self, state: str = "running") -> None:
        with self._lock:
            self._last_write = time.monotonic()
            if self.target is None:
                return
            elapsed = max(self._last_write - self.started, 1e-6)
            snapshot = {
                "state": state, "bytes_done": self.done, "bytes_total": self.total,
                "files_done": self.files_done, "files_total": self.files_total, "current": self.current,
                "rate_bytes_per_s": int(self.done / elapsed), "elapsed_s": round(elapsed, 1),
            }
            tree, name = self.target
            tree.write_atomic(name, json.dumps(snapshot).encode())


def hash_fd(fd: int, *, git: bool = False) -> str:
    """sha256 of an open file, or its git blob id (sha1 over a "blob <size>\\0" header) when `git`."""
    size = os.fstat(fd).st_size
    digest = hashlib.sha1(f"blob {size}\0".encode()) if git else hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, CHUNK * 8, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def verify_fd(fd: int, remote: RemoteFile, full: bool) -> str | None:
    """Check size (always) and, when `full`, the published hash; return the sha256 when computed."""
    size = os.fstat(fd).st_size
    if size != remote.size:
        raise FetchError(f"{remote.path}: {size} bytes on disk, the source says {remote.size}")
    if not full:
        return None
    if remote.git_sha1 and not remote.sha256:
        actual = hash_fd(fd, git=True)
        if actual != remote.git_sha1:
            raise FetchError(f"{remote.path}: git blob id {actual} does not match the source's "
                             f"{remote.git_sha1}")
        return hash_fd(fd)
    actual = hash_fd(fd)
    if remote.sha256 and actual != remote.sha256:
        raise FetchError(f"{remote.path}: sha256 {actual} does not match the source's {remote.sha256}")
    return actual


# ---------------------------------------------------------------------------------------------
# Resume state


def plan_ranges(size: int, range_size: int, connections: int) -> list[list[int]]:
    """[start, end, done] byte ranges: one for a small file or a single connection, else `range_size` each."""
    if connections <= 1 or size <= range_size:
        return [[0, size, 0]]
    return [[start, min(start + range_size, size), 0] for start in range(0, size, range_size)]


@dataclass
class PartialState:
    """What `<name>.incomplete` holds and against what it was written."""

    commit: str
    size: int
    sha256: str | None
    git_sha1: str | None
    etag: str | None
    ranges: list[list[int]]

    @classmethod
    def fresh(cls, remote: RemoteFile, commit: str, ranges: list[list[int]]) -> PartialState:
        return cls(commit, remote.size, remote.sha256, remote.git_sha1, None, ranges)

    @property
    def done_bytes(self) -> int:
        return sum(done for _, _, done in self.ranges)

    def to_bytes(self) -> bytes:
        return json.dumps({"version": STATE_VERSION, "commit": self.commit, "size": self.size,
                           "sha256": self.sha256, "git_sha1": self.git_sha1, "etag": self.etag,
                           "ranges": self.ranges}).encode()

    def matches(self, remote: RemoteFile, commit: str) -> bool:
        return (self.commit, self.size, self.sha256, self.git_sha1) == (
            commit, remote.size, remote.sha256, remote.git_sha1)


def read_state(tree: SafeDir, remote: RemoteFile, commit: str) -> PartialState | None:
    """The resume state of `remote`'s partial file when it is usable against this listing, else None."""
    raw = tree.read_small(remote.path + STATE_SUFFIX, limit=1 << 20)
    partial = tree.lstat(remote.path + INCOMPLETE_SUFFIX)
    if raw is None or partial is None:
        return None
    try:
        data = json.loads(raw)
        state = PartialState(data["commit"], data["size"], data["sha256"], data["git_sha1"], data["etag"],
                             [[int(a), int(b), int(c)] for a, b, c in data["ranges"]])
        valid = data["version"] == STATE_VERSION and state.matches(remote, commit) and _contiguous(
            state.ranges, remote.size)
    except (ValueError, KeyError, TypeError):
        return None
    if not valid:
        return None
    for entry in state.ranges:  # never trust more than the file holds
        entry[2] = max(0, min(entry[2], partial.st_size - entry[0]))
    return state


def _contiguous(ranges: list[list[int]], size: int) -> bool:
    edge = 0
    for start, end, done in ranges:
        if start != edge or end < start or not 0 <= done <= end - start:
            return False
        edge = end
    return edge == size and bool(ranges)


# ---------------------------------------------------------------------------------------------
# One file's ranges


class FileJob:
    """A file in flight: its partial file, resume state, and a generation bumped when it starts over."""

    def __init__(self, tree: SafeDir, remote: RemoteFile, commit: str, progress: Progress,
                 state: PartialState | None) -> None:
        self.tree, self.remote, self.commit, self.progress = tree, remote, commit, progress
        self.partial = remote.path + INCOMPLETE_SUFFIX
        self.lock = threading.RLock()
        self.gen = 0
        self.pending = 0
        self.failures = 0
        self.received = 0
        self.announced = False
        self._saved = 0.0
        # The partial file is opened when the file's turn comes (begin), and closed once it is done: a
        # model of thousands of files holds a few descriptors at a time, not one per file.
        self.fd = -1
        self._resume = state
        self.state = state or PartialState.fresh(remote, commit, [[0, remote.size, 0]])

    def begin(self, layout: list[list[int]], resumable: Callable[[str | None], bool]) -> list[int]:
        """Open the partial file (resuming it where its state and `resumable(etag)` allow, else afresh
        with `layout`); return the indices of the ranges still to fetch."""
        with self.lock:
            fd = self.tree.reopen(self.partial) if self._resume is not None else None
            if fd is None:  # no usable state, or the partial file is not a plain file of ours: start afresh
                if self._resume is not None:
                    self.progress.advance(-self._resume.done_bytes)
                self.tree.remove(self.remote.path + STATE_SUFFIX)
                self.state = PartialState.fresh(self.remote, self.commit, [[0, self.remote.size, 0]])
                fd = self.tree.create(self.partial)
            self.fd, self._resume = fd, None
            keep = self.state.done_bytes and resumable(self.state.etag)
            return self.start(None if keep else layout)

    def start(self, ranges: list[list[int]] | None = None) -> list[int]:
        """Start (over) with `ranges` when given; return the indices of the ranges still to fetch."""
        with self.lock:
            if ranges is not None:
                # A new file, not a truncated one: a range still in flight writes into the old one.
                os.close(self.fd)
                self.fd = self.tree.create(self.partial)
                self.progress.advance(-self.state.done_bytes)
                self.state = PartialState.fresh(self.remote, self.commit, ranges)
                self.gen += 1
            self.save()
            todo = [i for i, (start, end, done) in enumerate(self.state.ranges) if start + done < end]
            self.pending = len(todo)
            return todo

    def save(self) -> None:
        with self.lock:
            self._saved = time.monotonic()
            self.tree.write_atomic(self.remote.path + STATE_SUFFIX, self.state.to_bytes())

    def check_reply(self, gen: int, etag: str | None) -> None:
        """A resume is only valid against the ETag the partial bytes came with."""
        with self.lock:
            if gen != self.gen:
                raise _Cancelled
            if etag != self.state.etag:
                if self.state.done_bytes:
                    raise _Stale("the file changed since its first bytes came")
                self.state.etag = etag
                self.save()

    def wrote(self, gen: int, index: int, nbytes: int) -> None:
        with self.lock:
            if gen != self.gen:
                raise _Cancelled
            self.state.ranges[index][2] += nbytes
            self.received += nbytes
            self.progress.advance(nbytes)
            if time.monotonic() - self._saved >= 1.0:
                self.save()

    def rewind(self, gen: int, index: int) -> None:
        """The source ignored a resume's Range and sends the file from its start: count from 0."""
        with self.lock:
            if gen != self.gen:
                raise _Cancelled
            self.progress.advance(-self.state.ranges[index][2])
            self.state.ranges[index][2] = 0

    def failed(self) -> int:
        """Count a failed attempt at the whole file; return how many there were."""
        with self.lock:
            self.failures += 1
            return self.failures

    def range_done(self, gen: int) -> bool:
        """Count a finished range; True for the one that finished the file."""
        with self.lock:
            if gen != self.gen:
                raise _Cancelled
            self.pending -= 1
            return self.pending == 0

    def finish(self) -> None:
        with self.lock:
            os.close(self.fd)
            self.fd = -1
            self.tree.replace(self.partial, self.remote.path)
            self.tree.remove(self.remote.path + STATE_SUFFIX)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                self.save()
                os.close(self.fd)
                self.fd = -1


class _RangeWriter:
    """Writes a reply's body at its offset in ~1 MiB blocks, and never past the range's end."""

    def __init__(self, job: FileJob, gen: int, index: int, fd: int, offset: int) -> None:
        self.job, self.gen, self.index, self.fd = job, gen, index, fd
        self.pos = offset  # the file offset the buffer starts at
        self.buffer = bytearray()

    def write(self, chunk: bytes, end: int) -> None:
        room = end - self.pos - len(self.buffer)
        if len(chunk) > room:
            self.buffer += chunk[:room]
            self.flush()
            remote = self.job.remote
            raise SourceMisbehaves(f"{remote.path}: the source listed {remote.size} bytes but sent more "
                                   f"({self.pos + len(chunk) - room} bytes received); stopped at the listed size")
        self.buffer += chunk
        if len(self.buffer) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            os.pwrite(self.fd, self.buffer, self.pos)
            self.pos += len(self.buffer)
            size = len(self.buffer)
            self.buffer.clear()
            self.job.wrote(self.gen, self.index, size)


# ---------------------------------------------------------------------------------------------
# The pool


@dataclass(frozen=True)
class TransferSettings:
    connections: int = DEFAULT_CONNECTIONS
    range_size: int = DEFAULT_RANGE_SIZE
    retries: int = 5
    verify_full: bool = False  # hash every file, even those the source publishes no hash for
    redirect_hosts: frozenset[str] = frozenset()  # where a file without a published hash may be redirected


class Downloader:
    """`connections` threads working through the ranges of every file; the first failure stops all."""

    def __init__(self, client: httpx.Client, settings: TransferSettings,
                 sleep: Callable[[float], None] = time.sleep, local: SafeDir | None = None) -> None:
        self.client, self.settings, self.sleep, self.local = client, settings, sleep, local
        self.hashes: dict[str, str | None] = {}
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order: dict[int, int] = {}  # id(job) -> its place in the listing
        self._sequence = itertools.count()  # ties broken by arrival, never by comparing jobs
        self._done = threading.Condition()
        self._remaining = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()

    def layout(self, remote: RemoteFile) -> list[list[int]]:
        if not self._provable(remote):
            return [[0, remote.size, 0]]  # parts of two versions of it could not be told apart
        return plan_ranges(remote.size, self.settings.range_size, self.settings.connections)

    def _provable(self, remote: RemoteFile, validator: str | None = None) -> bool:
        """Whether bytes of `remote` from several answers are provably one file's: a published hash
        checks the whole, a strong ETag (with If-Range) each part; a local source's file is read
        through the descriptor it was listed with."""
        return remote.published_hash or self.local is not None or strong_validator(validator)

    def run(self, jobs: list[FileJob]) -> dict[str, str | None]:
        """Download every job's missing ranges, verify and move each file into place."""
        self._remaining = len(jobs)
        for order, job in enumerate(jobs):
            self._order[id(job)] = order
            self._enqueue(job, _BEGIN, 0)
        workers = [threading.Thread(target=self._work, daemon=True, name=f"fetch-{n}")
                   for n in range(self.settings.connections)]
        for worker in workers:
            worker.start()
        try:
            with self._done:
                self._done.wait_for(lambda: self._remaining == 0 or self._error is not None)
        finally:
            self._stop.set()
            for _ in workers:
                self._enqueue(None, _BEGIN, 0)
            for worker in workers:
                worker.join()
        if self._error is not None:
            raise self._error
        return self.hashes

    def _enqueue(self, job: FileJob | None, index: int | None, gen: int) -> None:
        """Files are worked on in listing order: a file's ranges come before the next file's begin, so
        only the files in flight hold a descriptor. The stop sentinel (job None) sorts last."""
        order = self._order[id(job)] if job is not None else len(self._order)
        slot = -2 if index == _BEGIN else (-1 if index is None else index)
        self._queue.put((order, slot, next(self._sequence), job, index, gen))

    def _put(self, job: FileJob, todo: list[int]) -> None:
        # A file whose ranges are all on disk (a run stopped just before the rename) is only verified.
        for index in todo or [None]:
            self._enqueue(job, index, job.gen)

    def _work(self) -> None:
        while (task := self._queue.get())[3] is not None:
            _, _, _, job, index, gen = task
            if self._stop.is_set():
                continue
            try:
                if index == _BEGIN:
                    self._put(job, job.begin(self.layout(job.remote), partial(self._provable, job.remote)))
                    continue
                self._task(job, index, gen)
            except _Cancelled:
                pass
            except BaseException as exc:  # handed to the main thread, which raises it
                with self._done:
                    self._error = self._error or exc
                    self._done.notify_all()

    def _task(self, job: FileJob, index: int | None, gen: int) -> None:
        with job.lock:
            if not job.announced:
                job.announced = True
                job.progress.started_file(job.remote.path)
        if index is not None:
            self._fetch_range(job, index, gen)
            if not job.range_done(gen):
                return
        self._complete(job, gen)

    def _restart(self, job: FileJob, gen: int, ranges: list[list[int]]) -> None:
        with job.lock:
            if gen != job.gen:
                raise _Cancelled
            self._put(job, job.start(ranges))
        raise _Cancelled  # this task belonged to the old generation

    def _fetch_range(self, job: FileJob, index: int, gen: int) -> None:
        attempt = 0
        while True:
            try:
                return self._transfer(job, index, gen)
            except _Stale as exc:
                failures = job.failed()  # a source whose file keeps changing is not waited for forever
                if failures > 1:
                    self._backoff(job, failures - 1, exc)
                self._restart(job, gen, self.layout(job.remote))
            except _NoRanges:
                self._restart(job, gen, [[0, job.remote.size, 0]])
            except (SourceMisbehaves, LocalSourceRefused, RedirectRefused):  # retrying would only meet it again
                raise
            except (httpx.HTTPError, FetchError) as exc:
                attempt += 1
                self._backoff(job, attempt, exc)

    def _backoff(self, job: FileJob, attempt: int, exc: Exception) -> None:
        if attempt > self.settings.retries:
            raise FetchError(f"{job.remote.path}: giving up after {attempt} attempts: {exc}") from exc
        self.sleep(min(2.0 ** (attempt - 1), 30.0))
        if self._stop.is_set():
            raise _Cancelled

    def _transfer(self, job: FileJob, index: int, gen: int) -> None:
        with job.lock:
            if gen != job.gen:
                raise _Cancelled
            start, end, done = job.state.ranges[index]
            single = len(job.state.ranges) == 1
            validator = job.state.etag if done and strong_validator(job.state.etag) else None
            fd = os.dup(job.fd)
        try:
            if start + done >= end:
                return
            with open_range(self.client, job.remote, start + done, None if single else end,
                            self.local, if_range=validator, redirect_hosts=self.settings.redirect_hosts) as reply:
                body_at = self._accept(job, index, gen, reply, offset=start + done, end=end)
                out = _RangeWriter(job, gen, index, fd, body_at)
                try:
                    for chunk in reply.chunks:
                        if self._stop.is_set():
                            raise _Cancelled
                        out.write(chunk, end)
                finally:
                    out.flush()  # what arrived before a dropped connection is kept for the retry
            if out.pos < end:
                raise FetchError(f"{job.remote.path}: the transfer ended at byte {out.pos} of {end}")
        finally:
            os.close(fd)

    def _accept(self, job: FileJob, index: int, gen: int, reply: Reply, *, offset: int, end: int) -> int:
        """Check a reply before a byte of it is written; return the offset its body starts at."""
        job.check_reply(gen, reply.etag)
        resumed = offset > job.state.ranges[index][0]
        if resumed and reply.status == 206 and not self._provable(job.remote, reply.etag):
            # Nothing proves the bytes on disk are of the version this answer sends.
            raise _Stale("a resume the source cannot vouch for (no published hash, no strong ETag)")
        if reply.status == 200 and (offset or len(job.state.ranges) > 1):
            if len(job.state.ranges) > 1:
                raise _NoRanges
            job.rewind(gen, index)  # the whole file again: start over rather than append
            offset = 0
        elif reply.status == 206 and reply.content_range is not None:
            first, _, total = reply.content_range.removeprefix("bytes ").partition("/")
            if first.split("-", 1)[0] != str(offset):
                raise SourceMisbehaves(f"{job.remote.path}: asked for bytes from {offset}, the source "
                                       f"answered {reply.content_range!r}")
            if total not in ("*", str(job.remote.size)):
                raise SourceMisbehaves(f"{job.remote.path}: listed with {job.remote.size} bytes, the source now "
                                       f"has {total[:40]!r}: the file changed since the listing; run the fetch again")
        if reply.length is not None and reply.length > end - offset:
            raise SourceMisbehaves(
                f"{job.remote.path}: the source listed {job.remote.size} bytes but sends "
                f"{offset + reply.length} (Content-Length {reply.length} from byte {offset}); stopped at "
                "the listed size, nothing beyond it was written")
        return offset

    def _complete(self, job: FileJob, gen: int) -> None:
        """Verify the whole file (the published hash whatever --verify says) and move it into place."""
        remote = job.remote
        fd = job.tree.open_read(job.partial)
        try:
            with job.lock:
                if fd is None or os.fstat(fd).st_ino != os.fstat(job.fd).st_ino:
                    raise FetchError(f"{remote.path}: the partial file was replaced while downloading")
            digest = verify_fd(fd, remote, self.settings.verify_full or remote.published_hash)
        except FetchError as exc:
            self._backoff(job, job.failed(), exc)
            self._restart(job, gen, self.layout(remote))
        finally:
            if fd is not None:
                os.close(fd)
        job.finish()
        job.progress.finished_file(remote.path, done=True)
        with self._done:
            self.hashes[remote.path] = digest
            self._remaining -= 1
            self._done.notify_all()
