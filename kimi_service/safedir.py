"""A directory tree that root writes into without following symbolic links.

`kimi-service fetch` runs as root, and the weights directory lies below the service user's state
directory: a compromised engine can plant links there (or swap a whole directory for one) to make
root's next run write somewhere else. Everything here works on directory file descriptors: each path
component is opened with O_NOFOLLOW relative to its parent, links and odd files found inside the
tree are removed rather than followed, and files are created fresh (O_EXCL) or reused only when they
are plain files of ours with one link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from pathlib import Path, PurePosixPath

from kimi_service.errors import KimiError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINK_HOPS = 40


class UnsafePath(KimiError):
    """A path that would make root follow a link someone else controls."""


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _split(rel: str) -> tuple[str, str]:
    pure = PurePosixPath(rel)
    return str(pure.parent), pure.name


class SafeDir:
    """An open directory and the subdirectories opened below it, all without following links."""

    def __init__(self, fd: int, path: Path, *, harden: bool) -> None:
        self.fd, self.path, self.harden = fd, path, harden
        self._subdirs: dict[str, int] = {".": fd}
        self._lock = threading.RLock()  # download threads share one tree

    @classmethod
    def open(cls, path: Path, *, create: bool, harden: bool = False) -> SafeDir | None:
        """Open `path`, creating missing directories when `create`; None when it is missing.

        Links on the way there are followed only when root (or we) own them: the operator may have
        pointed the model directory at another disk, the service user may not. With `harden`, this
        directory and every one opened below it are made root's and not writable by others.
        """
        fd = _walk(Path(os.path.abspath(path)), create)
        if fd is None:
            return None
        tree = cls(fd, path, harden=harden)
        if harden:
            _harden(fd)
        return tree

    def close(self) -> None:
        for fd in set(self._subdirs.values()):
            os.close(fd)
        self._subdirs.clear()

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- directories ---------------------------------------------------------------------------
    def subdir(self, rel: str, *, create: bool) -> int | None:
        """The fd of directory `rel` below the root; a link or file in its place is replaced (create)."""
        rel = str(PurePosixPath(rel))
        with self._lock:
            if rel not in self._subdirs:
                fd = self._open_subdir(rel, create)
                if fd is None:
                    return None
                self._subdirs[rel] = fd
            return self._subdirs[rel]

    def _open_subdir(self, rel: str, create: bool) -> int | None:
        parent_rel, name = _split(rel)
        parent = self.subdir(parent_rel, create=create)
        if parent is None:
            return None
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if not create:
                return None
            _remove(parent, name)
            os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        if self.harden:
            _harden(fd)
        return fd

    # --- entries -------------------------------------------------------------------------------
    def lstat(self, rel: str) -> os.stat_result | None:
        """The entry itself (a link is not followed); None when it or a directory above is missing."""
        parent_rel, name = _split(rel)
        parent = self.subdir(parent_rel, create=False)
        if parent is None:
            return None
        try:
            return os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return None

    def entries(self, rel: str) -> list[tuple[str, os.stat_result]] | None:
        """The names in directory `rel` with what each is (links not followed); None when it is no directory
        of this tree (missing, or a link put in its place)."""
        fd = self.subdir(rel, create=False)
        if fd is None:
            return None
        found = []
        for name in sorted(os.listdir(fd)):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                found.append((name, os.lstat(name, dir_fd=fd)))
        return found

    def remove(self, rel: str) -> None:
        parent_rel, name = _split(rel)
        parent = self.subdir(parent_rel, create=False)
        if parent is not None:
            _remove(parent, name)

    def open_read(self, rel: str) -> int | None:
        """A read fd of the plain file at `rel`; None when it is missing or not a plain file."""
        return self._open_plain(rel, os.O_RDONLY, ours=False)

    def create(self, rel: str, mode: int = 0o644) -> int:
        """A write fd of a new, empty plain file at `rel`; whatever was there is removed first."""
        parent_rel, name = _split(rel)
        parent = self.subdir(parent_rel, create=True)
        assert parent is not None
        _remove(parent, name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=parent)
        os.fchmod(fd, mode)  # whatever the umask
        return fd

    def reopen(self, rel: str) -> int | None:
        """A write fd of an existing file we made (plain, ours, one link); None otherwise."""
        return self._open_plain(rel, os.O_WRONLY, ours=True)

    def _open_plain(self, rel: str, mode: int, *, ours: bool) -> int | None:
        parent_rel, name = _split(rel)
        parent = self.subdir(parent_rel, create=False)
        if parent is None:
            return None
        try:
            # O_NONBLOCK: a FIFO planted here must not hang the run.
            fd = os.open(name, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENXIO):
                return None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (ours and (st.st_uid != os.geteuid() or st.st_nlink != 1)):
            os.close(fd)
            return None
        return fd

    def replace(self, src_rel: str, dst_rel: str) -> None:
        """Rename within the tree; a directory in the way is removed (rename never follows links)."""
        src_parent = self.subdir(_split(src_rel)[0], create=True)
        dst_parent_rel, dst_name = _split(dst_rel)
        dst_parent = self.subdir(dst_parent_rel, create=True)
        st = self.lstat(dst_rel)
        if st is not None and stat.S_ISDIR(st.st_mode):
            _remove(dst_parent, dst_name)
        os.replace(_split(src_rel)[1], dst_name, src_dir_fd=src_parent, dst_dir_fd=dst_parent)

    def read_small(self, rel: str, limit: int = 16 << 20) -> bytes | None:
        fd = self.open_read(rel)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as handle:
            return handle.read(limit)

    def write_atomic(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        """Write a whole file under a temporary name and rename it over `rel`."""
        tmp = rel + ".tmp"
        with os.fdopen(self.create(tmp, mode), "wb") as handle:
            handle.write(data)
        self.replace(tmp, rel)


def harden_file(fd: int) -> None:
    """Make a file found in the tree root's and read-only to others, as the files fetch writes are."""
    _harden(fd)


def _harden(fd: int) -> None:
    """Keep a directory or file read-only to everyone but its owner (root when fetch runs as root)."""
    st = os.fstat(fd)
    if os.geteuid() == 0 and st.st_uid != 0:
        os.fchown(fd, 0, -1)
    if st.st_mode & 0o022:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)


def _remove(parent: int, name: str) -> None:
    """Remove an entry without following it: unlink a file or link, delete a directory tree."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)  # the fd-based rmtree does not follow links
    else:
        os.unlink(name, dir_fd=parent)


def _walk(path: Path, create: bool) -> int | None:
    """Open `path` component by component; follow only links that root (or we) own."""
    hops = 0
    parts = list(path.parts[1:])
    fd = os.open("/", _DIR_FLAGS)
    done: list[str] = []
    try:
        while parts:
            name = parts.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                # Only reached through a link target; resolve it on the names walked so far.
                os.close(fd)
                done = done[:-1]
                fd = _walk_plain(done)
                continue
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    return None
                with contextlib.suppress(FileExistsError):  # made meanwhile: open it below
                    os.mkdir(name, 0o755, dir_fd=fd)
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                here = "/" + "/".join([*done, name])
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.lstat(name, dir_fd=fd)  # Linux answers ENOTDIR for a link with O_DIRECTORY
                if not stat.S_ISLNK(st.st_mode):
                    raise UnsafePath(f"{here} is not a directory") from None
                if not _trusted_owner(st.st_uid):
                    raise UnsafePath(
                        f"{here} is a symbolic link owned by uid {st.st_uid}; refusing to follow it as root. "
                        "Remove it, or point kimi_model_dir (--dest) at the real directory") from None
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise UnsafePath(f"{here}: too many levels of symbolic links") from None
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd, done = os.open("/", _DIR_FLAGS), []
                parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
                continue
            os.close(fd)
            fd = nfd
            done.append(name)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _walk_plain(names: list[str]) -> int:
    fd = os.open("/", _DIR_FLAGS)
    for name in names:
        nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = nfd
    return fd
