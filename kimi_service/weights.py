"""Fetch model weights: list the files first, check the disk, download resumably, verify, mark.

Sources speak the protocols operators already have: the Hugging Face hub (or a mirror such as
hf-mirror.com), ModelScope, a plain HTTP mirror with a manifest, or a local directory. Every source
is reduced to a `Listing` (paths, sizes and the hashes the source publishes), so the disk check,
the download loop and the verification are one code path for all of them.

A marker file in the destination records what was fetched and verified; a rerun whose marker
matches and whose files still have the recorded size and mtime does no network I/O at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kimi_service.errors import KimiError, UsageError
from kimi_service.safedir import SafeDir, harden_file
from kimi_service.weights_download import (
    DEFAULT_CONNECTIONS,
    DEFAULT_RANGE_SIZE,
    MAX_CONNECTIONS,
    MIN_RANGE_SIZE,
    Downloader,
    FileJob,
    Progress,
    TransferSettings,
    hash_fd,
    read_state,
    verify_fd,
)
from kimi_service.weights_sources import (
    INCOMPLETE_SUFFIX,
    MANIFEST_NAME,
    MARKER_NAME,
    STATE_SUFFIX,
    BadListing,
    FetchError,
    Listing,
    LocalSourceRefused,
    RemoteFile,
    hub_client,
    list_local,
    list_remote,
    open_local,
    safe_relpath,
)
from kimi_service.weights_sources import SOURCES as REMOTE_SOURCES

__all__ = [
    "INCOMPLETE_SUFFIX",
    "MANIFEST_NAME",
    "MARKER_NAME",
    "MAX_CONNECTIONS",
    "STATE_SUFFIX",
    "BadListing",
    "FetchError",
    "FetchRequest",
    "FetchResult",
    "Listing",
    "NotEnoughSpace",
    "RemoteFile",
    "UsageError",
    "check_space",
    "check_token",
    "fetch",
    "is_up_to_date",
    "safe_relpath",
    "token_from_env",
    "write_manifest",
]

SOURCES = (*REMOTE_SOURCES, "local")
VERIFY_MODES = ("size", "full")
MARKER_VERSION = 1


class CommitMoved(UsageError):
    """The revision names another commit than the one the plan was made for."""


class NotEnoughSpace(KimiError):
    """The destination's filesystem cannot hold the files; nothing was written."""

    exit_code = 4


@dataclass(frozen=True)
class FetchRequest:
    source: str
    repo: str
    revision: str
    dest: Path
    endpoint: str = "https://huggingface.co"
    manifest_url: str = ""
    local_path: Path | None = None
    verify: str = "size"
    reverify: bool = False
    headroom: float = 0.05
    retries: int = 5
    progress_file: Path | None = None
    token: str = field(default="", repr=False)
    connections: int = DEFAULT_CONNECTIONS
    range_size: int = DEFAULT_RANGE_SIZE
    # Hosts a file without a published hash may be redirected to (the mirror's own host always).
    redirect_hosts: tuple[str, ...] = ()
    # The commit the plan was made for: weights of another commit are refused, not fetched.
    expect_commit: str = ""

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise UsageError(f"unknown source {self.source!r}; use one of {', '.join(SOURCES)}")
        if self.verify not in VERIFY_MODES:
            raise UsageError(f"unknown verify mode {self.verify!r}; use one of {', '.join(VERIFY_MODES)}")
        if self.source == "local" and self.local_path is None:
            raise UsageError("source local needs --local-path DIR (the directory holding the model files)")
        if self.source == "http" and not (self.endpoint or self.manifest_url):
            raise UsageError("source http needs --endpoint URL (the mirror's base URL)")
        if self.headroom < 0:
            raise UsageError(f"headroom must be 0 or more (a fraction, e.g. 0.05), got {self.headroom}")
        if self.retries < 0:
            raise UsageError(f"retries must be 0 or more, got {self.retries}")
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise UsageError(f"connections must be 1 to {MAX_CONNECTIONS}, got {self.connections}")
        if self.range_size < MIN_RANGE_SIZE:
            raise UsageError(f"range size must be at least {MIN_RANGE_SIZE} bytes, got {self.range_size}")
        check_token(self.token, "the hub token (HF_TOKEN, MODELSCOPE_API_TOKEN or --token-file)")


@dataclass(frozen=True)
class FetchResult:
    dest: Path
    commit: str
    files_total: int
    files_fetched: int
    bytes_total: int
    bytes_downloaded: int
    seconds: float
    up_to_date: bool

    def to_json(self) -> dict:
        data = asdict(self)
        data["dest"] = str(self.dest)
        return data


# ---------------------------------------------------------------------------------------------
# Pure decisions


def required_space(missing_bytes: int, headroom: float) -> int:
    """Bytes that must be free before downloading `missing_bytes` (headroom for filesystem overhead)."""
    return int(missing_bytes * (1 + headroom))


def check_space(dest: Path, missing_bytes: int, free_bytes: int, headroom: float) -> None:
    need = required_space(missing_bytes, headroom)
    if need > free_bytes:
        raise NotEnoughSpace(
            f"{dest} needs {_human(need)} free ({_human(missing_bytes)} still to download + "
            f"{headroom:.0%} headroom) but its filesystem has {_human(free_bytes)} free; nothing was "
            "downloaded. Free space there, or point kimi_model_dir (--dest) at a larger filesystem."
        )


def marker_matches(marker: dict | None, listing_key: tuple[str, str]) -> bool:
    return bool(marker) and marker.get("version") == MARKER_VERSION and (
        marker.get("repo"), marker.get("revision")) == listing_key


def stale_files(marker: dict, tree: SafeDir | None) -> list[str]:
    """Files recorded in the marker whose size or mtime changed, that vanished or are no plain files."""
    stale = []
    for entry in marker["files"]:
        st = tree.lstat(entry["path"]) if tree else None
        if st is None or not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (
                entry["size"], entry["mtime_ns"]):
            stale.append(entry["path"])
    return stale


def check_token(token: str, where: str) -> str:
    """A token that can go into an HTTP header; the error names where it came from, never its content."""
    if token and not (token.isascii() and token.isprintable() and not any(c.isspace() for c in token)):
        lines = len(token.splitlines())
        found = f" (it has {lines} lines)" if lines > 1 else ""
        raise UsageError(f"{where}: the token must be one line of printable characters without spaces"
                         f"{found}; it is not shown here")
    return token


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------------------------------------
# Sources → Listing


def list_files(request: FetchRequest, client: httpx.Client, local: SafeDir | None) -> Listing:
    if local is not None:
        return list_local(local, request.repo, request.revision)
    return list_remote(client, request.source, request.endpoint, request.manifest_url, request.repo,
                       request.revision)


# ---------------------------------------------------------------------------------------------
# Markers


def read_marker(tree: SafeDir | None) -> dict | None:
    """The marker when it is well formed; anything else counts as no marker (everything is checked)."""
    raw = tree.read_small(MARKER_NAME) if tree else None
    try:
        marker = json.loads(raw) if raw is not None else None
        ok = isinstance(marker, dict) and isinstance(marker.get("files"), list) and all(
            isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
            and isinstance(e.get("mtime_ns"), int) for e in marker["files"])
    except ValueError:
        return None
    return marker if ok else None


def write_marker(tree: SafeDir, listing: Listing, source: str, verify: str,
                 hashes: dict[str, str | None]) -> None:
    entries = []
    for remote in listing.files:
        st = tree.lstat(remote.path)
        assert st is not None
        entries.append({
            "path": remote.path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": hashes.get(remote.path) or remote.sha256,
            "verified": "full" if hashes.get(remote.path) else "size",
        })
    marker = {
        "version": MARKER_VERSION, "repo": listing.repo, "revision": listing.revision,
        "commit": listing.commit, "source": source, "verify": verify, "files": entries,
    }
    tree.write_atomic(MARKER_NAME, json.dumps(marker, indent=1).encode())


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def is_up_to_date(request: FetchRequest) -> bool:
    """The fast path: the marker matches and no recorded file changed; reads no network."""
    if request.reverify:
        return False
    tree = SafeDir.open(request.dest, create=False)
    if tree is None:
        return False
    with tree:
        marker = read_marker(tree)
        if marker is None or not marker_matches(marker, (request.repo, request.revision)):
            return False
        if request.expect_commit and marker.get("commit") != request.expect_commit:
            return False
        if request.verify == "full" and any(f.get("verified") != "full" for f in marker["files"]):
            return False
        return not stale_files(marker, tree)


def _recorded_result(request: FetchRequest, started: float) -> FetchResult:
    tree = SafeDir.open(request.dest, create=False)
    assert tree is not None
    with tree:
        marker = read_marker(tree) or {}
    files = marker.get("files", [])
    return FetchResult(dest=request.dest, commit=str(marker.get("commit", "")), files_total=len(files),
                       files_fetched=0, bytes_total=sum(f["size"] for f in files), bytes_downloaded=0,
                       seconds=time.monotonic() - started, up_to_date=True)


# ---------------------------------------------------------------------------------------------
# The run


def fetch(request: FetchRequest, *, sleep: Callable[[float], None] = time.sleep) -> FetchResult:
    request.validate()
    started = time.monotonic()
    if is_up_to_date(request):
        return _recorded_result(request, started)
    try:
        with hub_client(request.token, connections=request.connections) as client, \
                contextlib.ExitStack() as held:
            # The local source stays open from its listing to the end of the copy (see list_local).
            local = held.enter_context(open_local(request.local_path)) \
                if request.source == "local" and request.local_path else None
            listing = list_files(request, client, local)
            if request.expect_commit and listing.commit != request.expect_commit:
                raise CommitMoved(f"{request.repo}@{request.revision} is commit {listing.commit} now, but the plan "
                                  f"was made for commit {request.expect_commit}; rerun the play to plan the new "
                                  "commit, or pin kimi_model_revision to a commit")
            if not listing.files:
                raise FetchError(f"{request.repo}@{request.revision} lists no files")
            tree = SafeDir.open(request.dest, create=False, harden=True)
            try:
                return _fetch_listed(request, client, listing, tree=tree, local=local, sleep=sleep, started=started)
            finally:
                if tree is not None:
                    tree.close()
    except OSError as exc:
        raise FetchError(f"cannot write the weights under {request.dest}: {exc}") from exc


def _fetch_listed(request: FetchRequest, client: httpx.Client, listing: Listing, *, tree: SafeDir | None,
                  local: SafeDir | None, sleep: Callable[[float], None], started: float) -> FetchResult:
    trusted = _trusted_files(tree, read_marker(tree), listing, request) if tree else {}
    todo = [f for f in listing.files if f.path not in trusted]
    # Partial files count only when their state matches this listing (commit, size, hash).
    states = {f.path: read_state(tree, f, listing.commit) for f in todo} if tree else {}
    missing = sum(f.size for f in todo) - sum(s.done_bytes for s in states.values() if s)
    check_space(request.dest, missing, _free_bytes(request.dest), request.headroom)
    tree = tree or SafeDir.open(request.dest, create=True, harden=True)
    assert tree is not None
    progress_dir, target = None, None
    if request.progress_file is not None:
        progress_dir = SafeDir.open(request.progress_file.parent, create=True)
        target = (progress_dir, request.progress_file.name) if progress_dir else None
    try:
        progress = Progress(target, listing.total_bytes, len(listing.files))
        progress.done = listing.total_bytes - missing
        progress.files_done = len(listing.files) - len(todo)
        progress.write()
        settings = TransferSettings(connections=request.connections, range_size=request.range_size,
                                    retries=request.retries, verify_full=request.verify == "full",
                                    redirect_hosts=frozenset(request.redirect_hosts))
        jobs = [FileJob(tree, f, listing.commit, progress, states.get(f.path)) for f in todo]
        try:
            hashes = {**trusted, **Downloader(client, settings, sleep, local).run(jobs)}
        finally:
            for job in jobs:
                job.close()
        write_marker(tree, listing, request.source, request.verify, hashes)
        progress.current = ""
        progress.write("done")
    finally:
        tree.close()
        if progress_dir is not None:
            progress_dir.close()
    return FetchResult(dest=request.dest, commit=listing.commit, files_total=len(listing.files),
                       files_fetched=len(todo), bytes_total=listing.total_bytes,
                       bytes_downloaded=sum(job.received for job in jobs),
                       seconds=time.monotonic() - started, up_to_date=False)


def _trusted_files(tree: SafeDir, marker: dict | None, listing: Listing,
                   request: FetchRequest) -> dict[str, str | None]:
    """Files on disk that need no transfer, with their sha256 when it was checked.

    Either recorded unchanged in a matching marker, or present, unrecorded (an interrupted run, a
    tree copied in beforehand) and verified now. A file that was recorded and has changed since (an
    in-place write keeps its size) is trusted only after its hash matches, whatever the verify mode;
    without a hash to compare it is fetched again. A present file that fails verification, or a link
    or anything else that is not a plain file, is removed.
    """
    recorded: dict[str, dict] = {}
    stale: set[str] = set()
    if marker_matches(marker, (listing.repo, listing.revision)) and not request.reverify:
        assert marker is not None
        stale = set(stale_files(marker, tree))
        recorded = {e["path"]: e for e in marker["files"] if e["path"] not in stale}
    trusted: dict[str, str | None] = {}
    for remote in listing.files:
        entry = recorded.get(remote.path)
        full = bool(entry) and entry.get("verified") == "full"
        if entry and entry["size"] == remote.size and (request.verify == "size" or full):
            trusted[remote.path] = entry.get("sha256") if full else None
            continue
        changed = remote.path in stale
        fd = tree.open_read(remote.path)
        if fd is None or (changed and not remote.published_hash):
            tree.remove(remote.path)
            continue
        try:
            harden_file(fd)
            trusted[remote.path] = verify_fd(fd, remote, changed or request.verify == "full")
        except FetchError:
            tree.remove(remote.path)
        finally:
            os.close(fd)
    return trusted


def write_manifest(root: Path) -> Path:
    """Write a mirror manifest (paths, sizes, sha256) for the model files under `root`.

    Root may run this on a directory the engine's user can write: the files are read and the manifest
    written through the directory's descriptors, and the manifest replaces whatever is at its name
    (a link included) by a rename instead of writing through it.
    """
    files = []
    with open_local(root) as tree:
        for f in list_local(tree, repo=root.name, revision="").files:
            if f.path == MANIFEST_NAME:
                continue
            fd = tree.open_read(f.path)
            if fd is None:
                raise LocalSourceRefused(f"{root / f.path} is no plain file any more; refusing to read through "
                                         "it as root")
            try:
                files.append({"path": f.path, "size": os.fstat(fd).st_size, "sha256": hash_fd(fd)})
            except OSError as exc:
                raise UsageError(f"manifest of {root}: {root / f.path}: {exc.strerror}") from None
            finally:
                os.close(fd)
        try:
            _publish(tree, MANIFEST_NAME, json.dumps({"files": files}, indent=1).encode())
        except OSError as exc:
            raise UsageError(f"manifest of {root}: {root / MANIFEST_NAME}: {exc.strerror}") from None
    return root / MANIFEST_NAME


def _publish(tree: SafeDir, name: str, data: bytes) -> None:
    """Put `data` at `name` in the tree's top directory: written to a new file (never through a link), renamed
    over whatever plain file or link is there; anything else in the way (a directory) is an error, not removed."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=tree.fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, name, src_dir_fd=tree.fd, dst_dir_fd=tree.fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=tree.fd)
        raise


def token_from_env(source: str) -> str:
    """The hub token comes from the environment only, so it never shows in argv or process lists."""
    names = ("MODELSCOPE_API_TOKEN",) if source == "modelscope" else ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    return next((os.environ[n] for n in names if os.environ.get(n)), "")
