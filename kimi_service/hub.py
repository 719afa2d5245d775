"""Model inspection from the hub: what `plan` needs of a repository it has not downloaded.

The listing (the commit and every file's exact size) and a few small files (config.json, the safetensors
index, the quantization, generation and tokenizer configs), never a weight file. They are cached by
commit, so a rerun reads one listing (none with --offline) and the planner's inputs are those of one
commit. The listing and the HTTP client are fetch's own (weights_sources): the same endpoint, mirror,
ModelScope source and token. Every failure is bad input for the plan (exit 2), one line naming the
repository, the URL or the file; the whole inspection gives up after a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from kimi_service.errors import UsageError
from kimi_service.values import is_repo_id
from kimi_service.weights_download import verify_fd
from kimi_service.weights_sources import FetchError, Listing, RemoteFile, hub_client, list_remote
from kimi_service.weights_transport import open_range

# The files the planner reads (config.json is required). vLLM reads a ModelOpt export's quantization from
# hf_quant_config.json; generation, tokenizer and preprocessor configs tell the defaults and the chat template.
SMALL_FILES = (
    "config.json", "model.safetensors.index.json", "hf_quant_config.json", "quantization_config.json",
    "generation_config.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja",
)
INDEX_NAME = "model.safetensors.index.json"
# A config of a very large model is well under 1 MiB, its index a few MiB; more is no small file.
MAX_SMALL_FILE_BYTES = 16 << 20
REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
META_NAME = ".kimi-hub.json"
# A commit (or, for ModelScope, a revision) as a directory name of the cache.
_COMMIT_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,255}")

T = TypeVar("T")


class HubError(UsageError):
    """The hub could not describe the model: not found, no access, unreachable, or a malformed answer."""


@dataclass(frozen=True)
class Source:
    """Where a repository is listed: the source kind (hf, modelscope, http), its base URL and the token."""

    kind: str
    endpoint: str
    token: str = field(default="", repr=False)
    manifest_url: str = ""


@dataclass(frozen=True)
class HubModel:
    """A repository at one commit: the cached directory of its small files and its weights' size."""

    repo: str
    revision: str
    commit: str
    directory: Path
    weight_bytes: int | None  # the listed sizes of the safetensors files vLLM loads; None: none listed
    source: str
    endpoint: str
    offline_note: str = ""  # with --offline: which cached commit stands for the revision

    def to_json(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "commit": self.commit, "source": self.source,
                "endpoint": self.endpoint, "weight_bytes": self.weight_bytes, "cache": str(self.directory),
                "offline": self.offline_note or None}


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi-service" / "hub"


def inspect(repo: str, revision: str, source: Source, cache_dir: Path, *, deadline: float,
            offline: bool = False) -> HubModel:
    """The repository at `revision`, from the hub (or only from the cache when `offline`)."""
    if not is_repo_id(repo):
        raise HubError(f"--model {repo!r} is neither a directory nor a hub repo id (ORG/NAME)")
    base = cache_dir / source.kind / repo
    if offline:
        return _cached(base, repo, revision, source)
    where = f"{repo}@{revision} on {source.endpoint or source.manifest_url}"
    return _within(deadline, where, lambda: _online(base, repo, revision, source))


def _within(seconds: float, what: str, work: Callable[[], T]) -> T:
    """`work()`, or a HubError once `seconds` have passed: httpx bounds each read, not a trickling answer."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="hub-inspect", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise HubError(f"{what}: no complete answer within {seconds:g} s; check the endpoint and the network "
                       "(--timeout gives it longer)")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _online(base: Path, repo: str, revision: str, source: Source) -> HubModel:
    with hub_client(source.token, timeout=REQUEST_TIMEOUT) as client:
        try:
            listing = list_remote(client, source.kind, source.endpoint, source.manifest_url, repo, revision)
        except FetchError as exc:
            raise HubError(str(exc)) from None
        if not _COMMIT_DIR.fullmatch(listing.commit):
            raise HubError(f"{source.endpoint}: the listing of {repo}@{revision} gives the commit "
                           f"{listing.commit!r}, which cannot name a directory")
        directory = base / listing.commit
        try:
            if _read_meta(directory) is None:
                _download(client, listing, base, directory, source)
            meta = _remember(directory, revision)
        except OSError as exc:
            raise HubError(f"cannot keep the hub's files under {base}: {exc.strerror}; pass --cache-dir DIR") from None
    return HubModel(repo=repo, revision=revision, commit=listing.commit, directory=directory,
                    weight_bytes=meta["weight_bytes"], source=source.kind,
                    endpoint=source.endpoint or source.manifest_url)


def _download(client: httpx.Client, listing: Listing, base: Path, directory: Path, source: Source) -> None:
    """The small files into a staging directory, checked against the listing, then renamed into place."""
    wanted = [f for f in listing.files if f.path in SMALL_FILES]
    if "config.json" not in {f.path for f in wanted}:
        raise HubError(f"{listing.repo}@{listing.revision} (commit {listing.commit}) lists no config.json; "
                       "is it a transformers model?")
    for remote in wanted:
        if remote.size > MAX_SMALL_FILE_BYTES:
            raise HubError(f"{listing.repo}: {remote.path} is listed at {remote.size:,} bytes, more than the "
                           f"{MAX_SMALL_FILE_BYTES:,} a small file may have; refusing to download it")
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=base))
    try:
        for remote in wanted:
            _download_small(client, remote, staging / remote.path)
        meta = {"repo": listing.repo, "commit": listing.commit, "source": source.kind,
                "weight_bytes": listed_weight_bytes(listing, staging), "revisions": {}}
        (staging / META_NAME).write_text(json.dumps(meta, indent=1))
        if directory.exists():  # left without a readable record by an earlier run
            shutil.rmtree(directory)
        os.rename(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download_small(client: httpx.Client, remote: RemoteFile, target: Path) -> None:
    received = 0
    try:
        with open(target, "w+b") as handle, open_range(client, remote, 0, None) as reply:
            for chunk in reply.chunks:
                received += len(chunk)
                if received > remote.size:
                    raise HubError(f"{remote.url} sent more than the {remote.size:,} bytes the listing gives "
                                   f"{remote.path}")
                handle.write(chunk)
            handle.flush()
            verify_fd(handle.fileno(), remote, True)
    except FetchError as exc:
        raise HubError(str(exc)) from None
    except httpx.HTTPError as exc:
        raise HubError(f"cannot download {remote.url}: {exc}; check the endpoint and the network") from None


def listed_weight_bytes(listing: Listing, directory: Path) -> int | None:
    """The listed sizes of the safetensors files vLLM loads: the shards the index names (a repository may
    hold a consolidated copy besides them), else every top-level *.safetensors file."""
    sizes = {f.path: f.size for f in listing.files}
    index = directory / INDEX_NAME
    if not index.is_file():
        return sum(size for path, size in sizes.items()
                   if "/" not in path and path.endswith(".safetensors")) or None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
        shards = set(weight_map.values())
        if not all(isinstance(shard, str) for shard in shards):
            raise TypeError
    except (ValueError, AttributeError, TypeError):
        raise HubError(f"{listing.repo}: {INDEX_NAME} has no weight_map of tensor names to file names") from None
    missing = sorted(shards - sizes.keys())
    if missing:
        raise HubError(f"{listing.repo}: {INDEX_NAME} names {missing[0]}, which the repository does not list")
    return sum(sizes[shard] for shard in shards) or None


def _read_meta(directory: Path) -> dict | None:
    """The record of a cached commit; anything unreadable counts as not cached."""
    try:
        meta = json.loads((directory / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(meta, dict) and isinstance(meta.get("revisions"), dict) and (
        meta.get("weight_bytes") is None or isinstance(meta.get("weight_bytes"), int))
    return meta if ok else None


def _remember(directory: Path, revision: str) -> dict:
    """Note that `revision` named this commit now, for --offline runs that name the revision."""
    meta = _read_meta(directory)
    assert meta is not None
    meta["revisions"][revision] = time.time()
    scratch = directory / (META_NAME + ".tmp")
    scratch.write_text(json.dumps(meta, indent=1))
    os.replace(scratch, directory / META_NAME)
    return meta


def _cached(base: Path, repo: str, revision: str, source: Source) -> HubModel:
    """The cached commit `revision` names: the commit itself, or the one the revision named last."""
    seen: list[tuple[float, Path, dict]] = []
    for directory in sorted(base.iterdir()) if base.is_dir() else []:
        meta = _read_meta(directory)
        if meta is None:
            continue
        if directory.name == revision:
            seen = [(float("inf"), directory, meta)]
            break
        when = meta["revisions"].get(revision)
        if isinstance(when, (int, float)):
            seen.append((when, directory, meta))
    if not seen:
        raise HubError(f"--offline: no cached listing of {repo}@{revision} under {base}; run once without "
                       "--offline")
    when, directory, meta = max(seen, key=lambda item: item[0])
    listed = time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) if when != float("inf") else ""
    note = f"offline: {revision} is commit {directory.name} as listed {listed}" if listed else ""
    return HubModel(repo=repo, revision=revision, commit=directory.name, directory=directory,
                    weight_bytes=meta["weight_bytes"], source=source.kind,
                    endpoint=source.endpoint or source.manifest_url, offline_note=note)
