"""Sources of model weights, each reduced to a `Listing`: paths, sizes and the hashes it publishes.

The hub, ModelScope, a plain mirror's manifest and a local directory all end here, so the rest of
`kimi-service fetch` has one code path. What a source answers is not trusted: a listing that is not
JSON, has the wrong types, misses fields or lists negative sizes is refused with one line naming the
problem (exit 2), never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote

import httpx

from kimi_service.credentials import bearer
from kimi_service.engine_flags import has_control
from kimi_service.errors import KimiError, UsageError
from kimi_service.safedir import SafeDir, UnsafePath

MARKER_NAME = ".kimi-weights.json"
MANIFEST_NAME = "kimi-manifest.json"
INCOMPLETE_SUFFIX = ".incomplete"
# The resume state of `<file>.incomplete`: which byte ranges are done, against which commit and ETag.
STATE_SUFFIX = INCOMPLETE_SUFFIX + ".json"
_RESERVED_SUFFIXES = (INCOMPLETE_SUFFIX, STATE_SUFFIX, STATE_SUFFIX + ".tmp")
_HEX = re.compile(r"[0-9a-f]+")
_REVISION = re.compile(r"[\x21-\x7e]{1,256}")
# Unicode's directional marks, embeddings, overrides and isolates.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
SOURCES = ("hf", "modelscope", "http")
DEFAULT_ENDPOINTS = {"hf": "https://huggingface.co", "modelscope": "https://www.modelscope.cn"}
TRANSFER_TIMEOUT = httpx.Timeout(60.0, connect=15.0)
# Where a hub token comes from, for the messages that ask for one.
TOKEN_HINT = ("HF_TOKEN (MODELSCOPE_API_TOKEN for ModelScope) in the environment, --token-file, or kimi_hf_token "
              "in the inventory")


class FetchError(KimiError):
    """The source could not be listed or a file could not be downloaded or verified."""


class BadListing(FetchError):
    """The source's listing is malformed: bad input, not a transient failure."""

    exit_code = 2


class LocalSourceRefused(BadListing):
    """A local source holds a link (or changed into one): root reads none of it."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model repository as its source describes it."""

    path: str
    size: int
    url: str
    sha256: str | None = None
    # Small files on the hub are plain git blobs: their only published hash is the git blob id.
    git_sha1: str | None = None

    @property
    def published_hash(self) -> bool:
        return bool(self.sha256 or self.git_sha1)


@dataclass(frozen=True)
class Listing:
    repo: str
    revision: str
    commit: str
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def safe_relpath(path: str) -> str:
    """A repository path that stays inside the destination, written one way only, or a FetchError
    (sources are not trusted): no `.` or `..` component, no empty one, no control, line-separator or
    bidirectional-override character (a name that shows as another in a terminal)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or any(part in (".", "..", "") for part in path.split("/")) \
            or "\\" in path or has_control(path) or _BIDI.search(path):
        raise BadListing(f"the source listed an unsafe file path {path!r}; refusing to write outside the "
                         "model directory or under a name that reads as another")
    if pure.name in (MARKER_NAME, MARKER_NAME + ".tmp") or pure.name.endswith(_RESERVED_SUFFIXES):
        raise BadListing(f"the source listed {path!r}, a name kimi-service reserves; refusing it")
    return str(pure)


# ---------------------------------------------------------------------------------------------
# Checked fields of a listing


def _field(entry: object, key: str, kind: type, where: str, *, required: bool = True):
    if not isinstance(entry, dict):
        raise BadListing(f"{where}: expected a JSON object, got {type(entry).__name__}")
    value = entry.get(key)
    if value is None and not required:
        return None
    # bool is an int in Python; a size of `true` is still malformed.
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "nothing" if value is None else type(value).__name__
        raise BadListing(f"{where}: field {key!r} should be {kind.__name__}, got {got}")
    return value


def _size(entry: object, key: str, where: str, *, required: bool = True) -> int | None:
    size = _field(entry, key, int, where, required=required)
    if size is not None and size < 0:
        raise BadListing(f"{where}: field {key!r} is negative ({size})")
    return size


def _digest(entry: object, key: str, length: int, where: str) -> str | None:
    value = _field(entry, key, str, where, required=False)
    if not value:
        return None
    value = value.lower()
    if len(value) != length or not _HEX.fullmatch(value):
        raise BadListing(f"{where}: field {key!r} is not a {length}-digit hex digest")
    return value


def _path(entry: object, key: str, where: str) -> str:
    return safe_relpath(_field(entry, key, str, where))


def _commit(value: object, fallback: str, where: str) -> str:
    if value in (None, ""):
        return fallback
    if not isinstance(value, str) or not _REVISION.fullmatch(value):
        raise BadListing(f"{where}: the commit is not one word of printable characters")
    return value


def _list(value: object, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadListing(f"{where}: expected a JSON list, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Sources → Listing


def _get_json(client: httpx.Client, url: str, what: str) -> object:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot reach {url} to list {what}: {exc}; check the endpoint and the "
                         "network") from exc
    if response.status_code in (401, 403):
        raise FetchError(f"{url} answered {response.status_code}: {what} needs a token with access "
                         f"({TOKEN_HINT})")
    if response.status_code == 404:
        raise FetchError(f"{url} answered 404: {what} does not exist; check the repo id and the revision")
    if response.status_code != 200:
        raise FetchError(f"{url} answered {response.status_code} while listing {what}")
    try:
        return json.loads(response.content.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadListing(f"{url} answered bytes that are not UTF-8 while listing {what}") from None
    except (ValueError, RecursionError):
        raise BadListing(f"{url} did not answer JSON while listing {what}") from None


def default_endpoint(source: str, env: Mapping[str, str] = os.environ) -> str:
    """The hub's base URL when no --endpoint is given: HF_ENDPOINT as huggingface_hub reads it, else the public
    hub (ModelScope's own for ModelScope; a plain mirror has none)."""
    if source == "hf" and env.get("HF_ENDPOINT"):
        return env["HF_ENDPOINT"].rstrip("/")
    return DEFAULT_ENDPOINTS.get(source, "")


def hub_client(token: str, *, connections: int = 1, timeout: httpx.Timeout = TRANSFER_TIMEOUT) -> httpx.Client:
    """The HTTP client every hub request goes through. httpx drops Authorization on a redirect to another
    origin (the hub's CDN), so the token reaches the endpoint's host only."""
    return httpx.Client(headers={"User-Agent": "kimi-service", **bearer(token)}, follow_redirects=True,
                        timeout=timeout, limits=httpx.Limits(max_connections=connections,
                                                             max_keepalive_connections=connections))


def list_remote(client: httpx.Client, source: str, endpoint: str, manifest_url: str, repo: str,
                revision: str) -> Listing:
    """The listing of a repository on the hub, ModelScope or a plain mirror: one tree of distinct files."""
    if source == "hf":
        listing = list_hf(client, endpoint, repo, revision)
    elif source == "modelscope":
        listing = list_modelscope(client, endpoint, repo, revision)
    else:
        listing = list_http(client, endpoint, manifest_url, repo, revision)
    return one_tree(listing)


def one_tree(listing: Listing) -> Listing:
    """`listing` when its paths make one tree: no path twice (in any letter case: a case-insensitive disk
    would merge them), none both a file and a directory."""
    files = {f.path for f in listing.files}
    seen: dict[str, str] = {}
    for remote in listing.files:
        folded = remote.path.casefold()
        if folded in seen:
            raise BadListing(f"the listing of {listing.repo} names {remote.path!r} twice"
                             + (f" (also as {seen[folded]!r})" if seen[folded] != remote.path else "")
                             + "; refusing a listing whose files would overwrite each other")
        seen[folded] = remote.path
        parents = [str(parent) for parent in PurePosixPath(remote.path).parents][:-1]
        if clash := next((parent for parent in parents if parent in files), None):
            raise BadListing(f"the listing of {listing.repo} names {clash!r} both as a file and as the directory "
                             f"of {remote.path!r}; refusing it")
    return listing


def list_hf(client: httpx.Client, endpoint: str, repo: str, revision: str) -> Listing:
    base = endpoint.rstrip("/")
    url = f"{base}/api/models/{repo}/revision/{quote(revision, safe='')}?blobs=true"
    info = _get_json(client, url, f"{repo}@{revision}")
    if not isinstance(info, dict):
        raise BadListing(f"{url}: expected a JSON object, got {type(info).__name__}")
    commit = _commit(info.get("sha"), revision, url)
    files = []
    for index, sibling in enumerate(_list(info.get("siblings"), f"{url} siblings")):
        where = f"{url} siblings[{index}]"
        path = _path(sibling, "rfilename", where)
        lfs = _field(sibling, "lfs", dict, where, required=False) or {}
        size = _size(lfs, "size", f"{where} lfs", required=False) if lfs else None
        if size is None:
            size = _size(sibling, "size", where, required=False)
        if size is None:
            raise BadListing(f"the hub listed {path} without a size; does the endpoint support ?blobs=true?")
        files.append(RemoteFile(
            path=path, size=size, url=f"{base}/{repo}/resolve/{quote(commit, safe='')}/{quote(path)}",
            sha256=_digest(lfs, "sha256", 64, f"{where} lfs") if lfs else None,
            git_sha1=None if lfs else _digest(sibling, "blobId", 40, where),
        ))
    return Listing(repo=repo, revision=revision, commit=commit, files=tuple(files))


def list_modelscope(client: httpx.Client, endpoint: str, repo: str, revision: str) -> Listing:
    base = endpoint.rstrip("/")
    rev = quote(revision, safe="")
    url = f"{base}/api/v1/models/{repo}/repo/files?Revision={rev}&Recursive=true"
    data = _get_json(client, url, f"{repo}@{revision}")
    payload = _field(data, "Data", dict, url, required=False) or {}
    files = []
    for index, entry in enumerate(_list(payload.get("Files"), f"{url} Files")):
        where = f"{url} Files[{index}]"
        if _field(entry, "Type", str, where, required=False) == "tree":
            continue
        path = _path(entry, "Path", where)
        files.append(RemoteFile(
            path=path, size=_size(entry, "Size", where), sha256=_digest(entry, "Sha256", 64, where),
            url=f"{base}/api/v1/models/{repo}/repo?Revision={rev}&FilePath={quote(path, safe='')}",
        ))
    return Listing(repo=repo, revision=revision, commit=revision, files=tuple(files))


def list_http(client: httpx.Client, base_url: str, manifest_url: str, repo: str, revision: str) -> Listing:
    """A plain mirror: the model's file tree under `base_url` plus a manifest of paths, sizes, sha256."""
    base = base_url.rstrip("/")
    url = manifest_url or f"{base}/{MANIFEST_NAME}"
    manifest = _get_json(client, url, "the mirror's manifest")
    entries = _list(_field(manifest, "files", list, url), f"{url} files")
    files = []
    for index, entry in enumerate(entries):
        where = f"{url} files[{index}]"
        path = _path(entry, "path", where)
        files.append(RemoteFile(path=path, size=_size(entry, "size", where), url=f"{base}/{quote(path)}",
                                sha256=_digest(entry, "sha256", 64, where)))
    commit = _commit(manifest.get("commit"), revision, url)  # type: ignore[union-attr]
    return Listing(repo=repo, revision=revision, commit=commit, files=tuple(files))


def open_local(root: Path) -> SafeDir:
    """A local model directory, opened for reading the way root may: it can lie in the engine's user's
    state directory, so a link that user owns on the way there is refused, not followed."""
    try:
        tree = SafeDir.open(Path(os.path.abspath(root)), create=False)
    except UnsafePath as exc:
        raise LocalSourceRefused(f"local model directory: {exc}") from None
    if tree is None:
        raise UsageError(f"local model directory {root} does not exist or is not a directory")
    return tree


def list_local(tree: SafeDir, repo: str, revision: str) -> Listing:
    """The plain files under an open local directory, found without following a link.

    Root copies what is listed here into a directory the engine reads, so a link in the source (to
    /etc/shadow, say) is refused rather than copied; the copy then reads through the same directory
    descriptors, so a directory swapped for a link after the listing leads nowhere else either.
    """
    files = []
    pending = ["."]
    while pending:
        directory = pending.pop()
        entries = tree.entries(directory)
        if entries is None:
            raise LocalSourceRefused(f"{tree.path / directory} was replaced while it was listed; refusing to "
                                     "read through it as root")
        for name, st in entries:
            rel = str(PurePosixPath(directory, name))
            if stat.S_ISLNK(st.st_mode):
                raise LocalSourceRefused(
                    f"{tree.path / rel} is a symbolic link (owned by uid {st.st_uid}); fetch runs as root and "
                    "copies only plain files from a local source: replace it with the file itself (cp -L)")
            if stat.S_ISDIR(st.st_mode):
                pending.append(rel)
            elif stat.S_ISREG(st.st_mode) and rel != MARKER_NAME and not rel.endswith(_RESERVED_SUFFIXES):
                files.append(RemoteFile(path=rel, size=st.st_size, url=(tree.path / rel).as_uri()))
    if not files:
        raise UsageError(f"local model directory {tree.path} holds no files")
    files.sort(key=lambda f: PurePosixPath(f.path).parts)
    return Listing(repo=repo, revision=revision, commit=revision, files=tuple(files))
