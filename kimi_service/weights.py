"""Fetch model weights: list the files first, check the disk, download resumably, verify, mark.

Sources speak the protocols operators already have: the Hugging Face hub (or a mirror such as
hf-mirror.com), ModelScope, a plain HTTP mirror with a manifest, or a local directory. Every source
is reduced to a `Listing` (paths, sizes and the hashes the source publishes), so the disk check,
the download loop and the verification are one code path for all of them.

A marker file in the destination records what was fetched and verified; a rerun whose marker
matches and whose files still have the recorded size and mtime does no network I/O at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote

import httpx

from kimi_service.credentials import bearer
from kimi_service.errors import KimiError, UsageError
from kimi_service.files import write_atomic

SOURCES = ("hf", "modelscope", "http", "local")
VERIFY_MODES = ("size", "full")
MARKER_NAME = ".kimi-weights.json"
MANIFEST_NAME = "kimi-manifest.json"
INCOMPLETE_SUFFIX = ".incomplete"
CHUNK = 1 << 20
MARKER_VERSION = 1


class FetchError(KimiError):
    """The source could not be listed or a file could not be downloaded or verified."""


class NotEnoughSpace(KimiError):
    """The destination's filesystem cannot hold the files; nothing was written."""

    exit_code = 4


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model repository as its source describes it."""

    path: str
    size: int
    url: str
    sha256: str | None = None
    # Small files on the hub are plain git blobs: their only published hash is the git blob id.
    git_sha1: str | None = None


@dataclass(frozen=True)
class Listing:
    repo: str
    revision: str
    commit: str
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


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


def safe_relpath(path: str) -> str:
    """A repository path that stays inside the destination, or a FetchError (sources are not trusted)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or any(part in ("..", "") for part in pure.parts) or "\\" in path:
        raise FetchError(f"the source listed an unsafe file path {path!r}; refusing to write outside the "
                         "model directory")
    if pure.name in (MARKER_NAME,) or pure.name.endswith(INCOMPLETE_SUFFIX):
        raise FetchError(f"the source listed {path!r}, a name kimi-service reserves; refusing it")
    return str(pure)


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


def stale_files(marker: dict, dest: Path) -> list[str]:
    """Files recorded in the marker whose size or mtime changed (or that vanished) since."""
    stale = []
    for entry in marker.get("files", []):
        try:
            st = (dest / entry["path"]).stat()
        except FileNotFoundError:
            stale.append(entry["path"])
            continue
        if st.st_size != entry["size"] or st.st_mtime_ns != entry["mtime_ns"]:
            stale.append(entry["path"])
    return stale


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------------------------------------
# Sources → Listing


def _client(token: str) -> httpx.Client:
    headers = {"User-Agent": "kimi-service", **bearer(token)}
    # httpx drops Authorization on redirects to another origin (the hub's CDN), as it should.
    return httpx.Client(headers=headers, follow_redirects=True, timeout=httpx.Timeout(60.0, connect=15.0))


def _get_json(client: httpx.Client, url: str, what: str) -> dict:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot reach {url} to list {what}: {exc}; check the endpoint and the "
                         "network") from exc
    if response.status_code in (401, 403):
        raise FetchError(f"{url} answered {response.status_code}: {what} needs a token with access "
                         "(HF_TOKEN in the environment, kimi_hf_token in the inventory)")
    if response.status_code == 404:
        raise FetchError(f"{url} answered 404: {what} does not exist; check the repo id and the revision")
    if response.status_code != 200:
        raise FetchError(f"{url} answered {response.status_code} while listing {what}")
    try:
        return response.json()
    except ValueError as exc:
        raise FetchError(f"{url} did not answer JSON while listing {what}") from exc


def list_hf(client: httpx.Client, endpoint: str, repo: str, revision: str) -> Listing:
    base = endpoint.rstrip("/")
    info = _get_json(client, f"{base}/api/models/{repo}/revision/{quote(revision, safe='')}?blobs=true",
                     f"{repo}@{revision}")
    commit = info.get("sha") or revision
    files = []
    for sibling in info.get("siblings", []):
        path = safe_relpath(sibling["rfilename"])
        lfs = sibling.get("lfs") or {}
        size = lfs.get("size", sibling.get("size"))
        if size is None:
            raise FetchError(f"the hub listed {path} without a size; does the endpoint support ?blobs=true?")
        files.append(RemoteFile(
            path=path, size=int(size), url=f"{base}/{repo}/resolve/{commit}/{quote(path)}",
            sha256=lfs.get("sha256"), git_sha1=None if lfs else sibling.get("blobId"),
        ))
    return Listing(repo=repo, revision=revision, commit=commit, files=tuple(files))


def list_modelscope(client: httpx.Client, endpoint: str, repo: str, revision: str) -> Listing:
    base = endpoint.rstrip("/")
    rev = quote(revision, safe="")
    data = _get_json(client, f"{base}/api/v1/models/{repo}/repo/files?Revision={rev}&Recursive=true",
                     f"{repo}@{revision}")
    files = []
    for entry in (data.get("Data") or {}).get("Files") or []:
        if entry.get("Type") == "tree":
            continue
        path = safe_relpath(entry["Path"])
        files.append(RemoteFile(
            path=path, size=int(entry["Size"]), sha256=entry.get("Sha256") or None,
            url=f"{base}/api/v1/models/{repo}/repo?Revision={rev}&FilePath={quote(path, safe='')}",
        ))
    return Listing(repo=repo, revision=revision, commit=revision, files=tuple(files))


def list_http(client: httpx.Client, base_url: str, manifest_url: str, repo: str, revision: str) -> Listing:
    """A plain mirror: the model's file tree under `base_url` plus a manifest of paths, sizes, sha256."""
    base = base_url.rstrip("/")
    manifest = _get_json(client, manifest_url or f"{base}/{MANIFEST_NAME}", "the mirror's manifest")
    files = tuple(
        RemoteFile(path=safe_relpath(e["path"]), size=int(e["size"]), sha256=e.get("sha256"),
                   url=f"{base}/{quote(e['path'])}")
        for e in manifest.get("files", [])
    )
    return Listing(repo=repo, revision=revision, commit=manifest.get("commit") or revision, files=files)


def list_local(root: Path, repo: str, revision: str) -> Listing:
    if not root.is_dir():
        raise UsageError(f"local model directory {root} does not exist or is not a directory")
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MARKER_NAME or rel.endswith(INCOMPLETE_SUFFIX):
            continue
        files.append(RemoteFile(path=rel, size=path.stat().st_size, url=path.resolve().as_uri()))
    if not files:
        raise UsageError(f"local model directory {root} holds no files")
    return Listing(repo=repo, revision=revision, commit=revision, files=tuple(files))


def list_files(request: FetchRequest, client: httpx.Client) -> Listing:
    if request.source == "hf":
        return list_hf(client, request.endpoint, request.repo, request.revision)
    if request.source == "modelscope":
        return list_modelscope(client, request.endpoint, request.repo, request.revision)
    if request.source == "http":
        return list_http(client, request.endpoint, request.manifest_url, request.repo, request.revision)
    assert request.local_path is not None
    return list_local(request.local_path, request.repo, request.revision)


# ---------------------------------------------------------------------------------------------
# Progress, hashing, markers


class Progress:
    """Bytes done / total and the rate, written atomically to a JSON file at most once a second."""

    def __init__(self, path: Path | None, total: int, files_total: int) -> None:
        self.path, self.total, self.files_total = path, total, files_total
        self.done = 0
        self.files_done = 0
        self.current = ""
        self.started = time.monotonic()
        self._last_write = 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if time.monotonic() - self._last_write >= 1.0:
            self.write()

    def write(self, state: str = "running") -> None:
        self._last_write = time.monotonic()
        if self.path is None:
            return
        elapsed = max(self._last_write - self.started, 1e-6)
        snapshot = {
            "state": state, "bytes_done": self.done, "bytes_total": self.total,
            "files_done": self.files_done, "files_total": self.files_total, "current": self.current,
            "rate_bytes_per_s": int(self.done / elapsed), "elapsed_s": round(elapsed, 1),
        }
        write_atomic(self.path, json.dumps(snapshot))


def hash_file(path: Path, *, git: bool = False) -> str:
    """sha256 of the file, or its git blob id (sha1 over a "blob <size>\\0" header) when `git`."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode()) if git else hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: Path, remote: RemoteFile, mode: str) -> str | None:
    """Check size (always) and the published hash (mode full); return the sha256 when it was computed."""
    size = path.stat().st_size
    if size != remote.size:
        raise FetchError(f"{remote.path}: {size} bytes on disk, the source says {remote.size}")
    if mode != "full":
        return None
    if remote.git_sha1 and not remote.sha256:
        actual = hash_file(path, git=True)
        if actual != remote.git_sha1:
            raise FetchError(f"{remote.path}: git blob id {actual} does not match the source's "
                             f"{remote.git_sha1}")
        return hash_file(path)
    actual = hash_file(path)
    if remote.sha256 and actual != remote.sha256:
        raise FetchError(f"{remote.path}: sha256 {actual} does not match the source's {remote.sha256}")
    return actual


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_marker(dest: Path, listing: Listing, source: str, verify: str,
                 hashes: dict[str, str | None]) -> None:
    entries = []
    for remote in listing.files:
        st = (dest / remote.path).stat()
        entries.append({
            "path": remote.path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": hashes.get(remote.path) or remote.sha256,
            "verified": "full" if hashes.get(remote.path) else "size",
        })
    marker = {
        "version": MARKER_VERSION, "repo": listing.repo, "revision": listing.revision,
        "commit": listing.commit, "source": source, "verify": verify, "files": entries,
    }
    write_atomic(dest / MARKER_NAME, json.dumps(marker, indent=1))


# ---------------------------------------------------------------------------------------------
# Transfers


@contextmanager
def _stream(client: httpx.Client, remote: RemoteFile, offset: int) -> Iterator[tuple[bool, Iterator[bytes]]]:
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    with client.stream("GET", remote.url, headers=headers) as response:
        if response.status_code not in (200, 206):
            raise FetchError(f"{remote.url} answered {response.status_code} for {remote.path}")
        yield response.status_code == 206, response.iter_bytes()


def download_file(client: httpx.Client, remote: RemoteFile, target: Path, progress: Progress) -> int:
    """Download into `<target>.incomplete`, continuing what is there with a Range request.

    Returns the bytes read from the source in this call.
    """
    partial = target.with_name(target.name + INCOMPLETE_SUFFIX)
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.touch()
    offset = partial.stat().st_size
    if offset > remote.size:
        partial.unlink()
        offset = 0
    received = 0
    if remote.url.startswith("file://"):
        received = _copy_local(Path(httpx.URL(remote.url).path), partial, offset, progress)
    elif offset < remote.size:
        with _stream(client, remote, offset) as (resumed, chunks):
            # A server that ignores Range sends the whole file again: start over rather than append.
            if not resumed:
                progress.advance(-offset)
            with partial.open("ab" if resumed else "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    received += len(chunk)
                    progress.advance(len(chunk))
    partial.replace(target)
    return received


def _copy_local(source: Path, partial: Path, offset: int, progress: Progress) -> int:
    copied = 0
    with source.open("rb") as src, partial.open("ab") as out:
        src.seek(offset)
        while chunk := src.read(CHUNK * 8):
            out.write(chunk)
            copied += len(chunk)
            progress.advance(len(chunk))
    return copied


def _fetch_one(client: httpx.Client, remote: RemoteFile, request: FetchRequest, progress: Progress,
               sleep: Callable[[float], None]) -> tuple[int, str | None]:
    target = request.dest / remote.path
    received = 0
    for attempt in range(request.retries + 1):
        try:
            received += download_file(client, remote, target, progress)
            return received, verify_file(target, remote, request.verify)
        except (httpx.HTTPError, FetchError) as exc:
            if isinstance(exc, FetchError) and target.exists():
                # A complete file with the wrong content cannot be resumed: fetch it again whole.
                progress.advance(-target.stat().st_size)
                target.unlink()
            if attempt == request.retries:
                raise FetchError(f"{remote.path}: giving up after {attempt + 1} attempts: {exc}") from exc
            sleep(min(2.0 ** attempt, 30.0))
    raise AssertionError("unreachable")


def _incomplete_bytes(dest: Path, files: list[RemoteFile]) -> int:
    total = 0
    for remote in files:
        partial = dest / (remote.path + INCOMPLETE_SUFFIX)
        if partial.exists():
            total += min(partial.stat().st_size, remote.size)
    return total


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def is_up_to_date(request: FetchRequest) -> bool:
    """The fast path: the marker matches and no recorded file changed; reads no network."""
    marker = read_marker(request.dest)
    if not marker_matches(marker, (request.repo, request.revision)) or request.reverify:
        return False
    if request.verify == "full" and any(f.get("verified") != "full" for f in marker["files"]):
        return False
    return not stale_files(marker, request.dest)


def fetch(request: FetchRequest, *, sleep: Callable[[float], None] = time.sleep) -> FetchResult:
    request.validate()
    started = time.monotonic()
    if is_up_to_date(request):
        marker = read_marker(request.dest) or {}
        files = marker.get("files", [])
        return FetchResult(dest=request.dest, commit=marker.get("commit", ""), files_total=len(files),
                           files_fetched=0, bytes_total=sum(f["size"] for f in files), bytes_downloaded=0,
                           seconds=time.monotonic() - started, up_to_date=True)
    with _client(request.token) as client:
        listing = list_files(request, client)
        if not listing.files:
            raise FetchError(f"{request.repo}@{request.revision} lists no files")
        marker = read_marker(request.dest)
        trusted = _trusted_files(marker, listing, request)
        todo = [f for f in listing.files if f.path not in trusted]
        missing = sum(f.size for f in todo) - _incomplete_bytes(request.dest, todo)
        check_space(request.dest, missing, _free_bytes(request.dest), request.headroom)
        request.dest.mkdir(parents=True, exist_ok=True)
        progress = Progress(request.progress_file, listing.total_bytes, len(listing.files))
        progress.done = listing.total_bytes - missing
        progress.files_done = len(listing.files) - len(todo)
        hashes = dict(trusted)
        downloaded = 0
        for remote in todo:
            progress.current = remote.path
            progress.write()
            received, digest = _fetch_one(client, remote, request, progress, sleep)
            downloaded += received
            hashes[remote.path] = digest
            progress.files_done += 1
        write_marker(request.dest, listing, request.source, request.verify, hashes)
        progress.current = ""
        progress.write("done")
    return FetchResult(dest=request.dest, commit=listing.commit, files_total=len(listing.files),
                       files_fetched=len(todo), bytes_total=listing.total_bytes, bytes_downloaded=downloaded,
                       seconds=time.monotonic() - started, up_to_date=False)


def _trusted_files(marker: dict | None, listing: Listing, request: FetchRequest) -> dict[str, str | None]:
    """Files on disk that need no transfer, with their sha256 when it was checked.

    Either recorded unchanged in a matching marker, or present, unrecorded (an interrupted run, a
    tree copied in beforehand) and verified now. A file that was recorded and has changed since (an
    in-place write keeps its size) is trusted only after its hash matches, whatever the verify mode;
    without a hash to compare it is fetched again. A present file that fails verification is removed.
    """
    recorded: dict[str, dict] = {}
    stale: set[str] = set()
    if marker_matches(marker, (listing.repo, listing.revision)) and not request.reverify:
        stale = set(stale_files(marker, request.dest))
        recorded = {e["path"]: e for e in marker["files"] if e["path"] not in stale}
    trusted: dict[str, str | None] = {}
    for remote in listing.files:
        entry = recorded.get(remote.path)
        full = bool(entry) and entry.get("verified") == "full"
        if entry and entry["size"] == remote.size and (request.verify == "size" or full):
            trusted[remote.path] = entry.get("sha256") if full else None
            continue
        target = request.dest / remote.path
        if not target.exists():
            continue
        changed = remote.path in stale
        if changed and not (remote.sha256 or remote.git_sha1):
            target.unlink()
            continue
        try:
            trusted[remote.path] = verify_file(target, remote, "full" if changed else request.verify)
        except FetchError:
            target.unlink()
    return trusted


def write_manifest(root: Path, out: Path | None = None) -> Path:
    """Write a mirror manifest (paths, sizes, sha256) for the model files under `root`."""
    listing = list_local(root, repo=root.name, revision="")
    manifest = {"files": [
        {"path": f.path, "size": f.size, "sha256": hash_file(root / f.path)}
        for f in listing.files if f.path != MANIFEST_NAME
    ]}
    target = out or root / MANIFEST_NAME
    target.write_text(json.dumps(manifest, indent=1))
    return target


def token_from_env(source: str) -> str:
    """The hub token comes from the environment only, so it never shows in argv or process lists."""
    names = ("MODELSCOPE_API_TOKEN",) if source == "modelscope" else ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    return next((os.environ[n] for n in names if os.environ.get(n)), "")
