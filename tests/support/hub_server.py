"""A local HTTP server that speaks the part of the model hubs' protocols downloads use.

It serves one directory as a model repository at one commit:
- Hugging Face: `GET /api/models/{repo}/revision/{rev}` (siblings; with `?blobs=true` sizes, git blob
  ids and LFS sha256), `GET /api/models/{repo}/tree/{rev}` (the recursive listing),
  `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with `X-Repo-Commit`, `ETag`, `X-Linked-Etag` and
  `X-Linked-Size` headers and byte ranges;
- ModelScope: `GET /api/v1/models/{repo}/repo/files?Revision=&Recursive=` and
  `GET /api/v1/models/{repo}/repo?Revision=&FilePath=`;
- a plain mirror: `GET /mirror/{file}` and `/mirror/kimi-manifest.json`.
Faults are injected per file: drop the connection after N bytes, serve corrupted bytes, or send
more than the file holds, for the next K requests; a listing can be replaced by raw bytes. Every
request is logged (method, path, Range, bytes sent), so tests can see what a client really
transferred, and the most file responses in flight at once is kept. `rate` limits each response to
that many bytes per second, like one TCP stream over a long, slow link.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, unquote, urlsplit

# Files at least this large are stored in LFS on the hub; smaller ones are plain git blobs.
LFS_THRESHOLD = 1 << 20
COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def write_test_model(root: Path, big_size: int = 3 * 1024 * 1024 + 17) -> Path:
    """A small model tree: a config, an LFS-sized weights file, a tokenizer and a file in a subdirectory."""
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with (root / "model.safetensors").open("wb") as handle:  # above the hub's LFS threshold
        for start in range(0, big_size, 1 << 24):
            handle.write(os.urandom(min(1 << 24, big_size - start)))
    (root / "tokenizer.json").write_text("{}" * 1000)
    (root / "sub" / "extra.bin").write_bytes(os.urandom(1500))
    return root


@dataclass
class Fault:
    drop_after: int | None = None  # close the connection after sending this many body bytes
    corrupt: bool = False  # flip bytes in the body
    extra: int = 0  # send this many bytes beyond the file's end
    no_length: bool = False  # no Content-Length: the body ends when the connection closes
    times: int = 1  # how many GETs of the file the fault applies to


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    sent: int
    if_range: str | None = None
    arrival: int = 0  # the order requests came in (the log is in the order their answers ended)


@dataclass
class HubServer:
    root: Path
    repo: str
    host: str = "127.0.0.1"
    port: int = 0
    commit: str = COMMIT
    token: str = ""
    # True: the listing answers without the token, the files need it (the hub's gated repositories).
    gated: bool = False
    faults: dict[str, Fault] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    rate: int | None = None  # bytes per second per response
    # Raw bodies served instead of a listing: keys "hf", "modelscope", "mirror".
    listings: dict[str, bytes] = field(default_factory=dict)
    manifest_hashes: bool = True  # False: a plain mirror whose manifest lists no sha256
    ignore_ranges: bool = False  # True: a server that always answers 200 with the whole file
    # How a file's version is told: "strong" (a quoted ETag, as the hub and nginx send), "weak" (W/"..."),
    # "last-modified" (no ETag, as python -m http.server).
    validator: str = "strong"
    # A host name (e.g. "localhost") file requests made under any other name are redirected to, as a
    # mirror hands its files to a CDN.
    redirect_host: str | None = None
    active: int = 0
    max_active: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _arrivals: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _digests: dict[tuple, dict] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())

    def sent_bytes(self, name: str) -> int:
        return sum(r.sent for r in self.log if r.method == "GET" and r.path.endswith("/" + name))

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no file response is in flight, so the log holds every request a client made."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)

    def gets(self, name: str) -> list[Request]:
        """The GETs of a file in the order they came in, once every answer has ended."""
        self.settle()
        return sorted((r for r in self.log if r.method == "GET" and r.path.endswith("/" + name)),
                      key=lambda r: r.arrival)

    def sibling(self, path: Path) -> dict:
        """The hub's entry for a file; hashed once per size and mtime (benchmarks serve large files)."""
        st = path.stat()
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self._digests:
            blob, sha = hashlib.sha1(b"blob %d\0" % st.st_size), hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 22):
                    blob.update(chunk)
                    sha.update(chunk)
            self._digests[key] = {"blobId": blob.hexdigest(), "sha256": sha.hexdigest()}
        digests = self._digests[key]
        entry = {"rfilename": path.relative_to(self.root).as_posix(), "size": st.st_size,
                 "blobId": digests["blobId"]}
        if st.st_size >= LFS_THRESHOLD:
            entry["lfs"] = {"sha256": digests["sha256"], "size": st.st_size, "pointerSize": 134}
        return entry

    def sha256(self, path: Path) -> str:
        self.sibling(path)
        st = path.stat()
        return self._digests[(path, st.st_size, st.st_mtime_ns)]["sha256"]

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output readable
        pass

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    # --- routing -------------------------------------------------------------------------------
    def _dispatch(self, head: bool) -> None:
        hub = self.hub
        self._arrival = next(hub._arrivals)
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parse_qs(parts.query)
        listing = path.startswith("/api/")
        if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}" and not (hub.gated and listing):
            return self._json(401, {"error": "Invalid credentials in Authorization header"}, head)
        repo = hub.repo
        if path.startswith(f"/api/models/{repo}/revision/") and "hf" in hub.listings:
            return self._raw(hub.listings["hf"], head)
        if path == f"/api/v1/models/{repo}/repo/files" and "modelscope" in hub.listings:
            return self._raw(hub.listings["modelscope"], head)
        if path == "/mirror/kimi-manifest.json" and "mirror" in hub.listings:
            return self._raw(hub.listings["mirror"], head)
        if path.startswith(f"/api/models/{repo}/revision/"):
            return self._model_info(query, head)
        if path.startswith(f"/api/models/{repo}/tree/"):
            return self._tree(head)
        if path.startswith(f"/{repo}/resolve/"):
            rev, _, name = path[len(f"/{repo}/resolve/"):].partition("/")
            if rev not in ("main", hub.commit):
                return self._json(404, {"error": f"Revision Not Found: {rev}"}, head)
            return self._file(name, head, hub_headers=True)
        if path == f"/api/v1/models/{repo}/repo/files":
            return self._modelscope_files(head)
        if path == f"/api/v1/models/{repo}/repo":
            return self._file(query.get("FilePath", [""])[0], head, hub_headers=False)
        if path == "/mirror/kimi-manifest.json":
            return self._json(200, {"files": [
                {"path": p.relative_to(hub.root).as_posix(), "size": p.stat().st_size}
                | ({"sha256": hub.sha256(p)} if hub.manifest_hashes else {})
                for p in hub.files()
            ]}, head)
        if path.startswith("/mirror/"):
            return self._file(path[len("/mirror/"):], head, hub_headers=False)
        self._record(404, 0)
        return self._json(404, {"error": "Repository Not Found"}, head)

    def _model_info(self, query: dict, head: bool) -> None:
        hub = self.hub
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path in hub.files():
            entry = hub.sibling(path)
            siblings.append(entry if blobs else {"rfilename": entry["rfilename"]})
        body = {"_id": "kimi-test", "id": hub.repo, "modelId": hub.repo, "sha": hub.commit, "private": False,
                "gated": False, "disabled": False, "tags": [], "siblings": siblings}
        self._json(200, body, head)

    def _tree(self, head: bool) -> None:
        """The recursive listing huggingface_hub's snapshot_download reads (one page, no Link header)."""
        entries, dirs = [], set()
        for path in self.hub.files():
            entry = self.hub.sibling(path)
            rel = PurePosixPath(entry["rfilename"])
            dirs.update(str(p) for p in rel.parents if str(p) != ".")
            item = {"type": "file", "oid": entry["blobId"], "size": entry["size"], "path": str(rel)}
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"], "pointerSize": 134}
            entries.append(item)
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        self._json(200, entries, head)

    def _modelscope_files(self, head: bool) -> None:
        files = []
        for path in self.hub.files():
            rel = path.relative_to(self.hub.root).as_posix()
            files.append({"Name": path.name, "Path": rel, "Type": "blob", "Size": path.stat().st_size,
                          "Sha256": self.hub.sha256(path), "Revision": self.hub.commit})
        self._json(200, {"Code": 200, "Data": {"Files": files}, "Success": True}, head)

    # --- responses -----------------------------------------------------------------------------
    def _record(self, status: int, sent: int) -> None:
        self.hub.log.append(Request(self.command, self.path, self.headers.get("Range"), status, sent,
                                    self.headers.get("If-Range"), self._arrival))

    def _raw(self, data: bytes, head: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _json(self, status: int, body: dict | list, head: bool) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _file(self, name: str, head: bool, *, hub_headers: bool) -> None:
        hub = self.hub
        target = (hub.root / name).resolve()
        if not name or hub.root.resolve() not in target.parents or not target.is_file():
            self._record(404, 0)
            return self._json(404, {"error": "Entry not found"}, head)
        asked = self.headers.get("Host", "").rsplit(":", 1)[0]
        if hub.redirect_host and asked != hub.redirect_host:
            self.send_response(302)
            self.send_header("Location", f"http://{hub.redirect_host}:{hub.port}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return self._record(302, 0)
        size = target.stat().st_size
        start, end = 0, size - 1
        entry = hub.sibling(target)
        # The hub's ETag is the LFS sha256 or the git blob id; a mirror's (nginx) is its own string.
        etag = f'"{entry["lfs"]["sha256"] if "lfs" in entry else entry["blobId"]}"'
        validator = {"strong": ("ETag", etag), "weak": ("ETag", f"W/{etag}"),
                     "last-modified": ("Last-Modified", self.date_time_string(int(target.stat().st_mtime)))
                     }[hub.validator]
        match = None if hub.ignore_ranges else _RANGE.match(self.headers.get("Range", ""))
        if match and self.headers.get("If-Range") not in (None, validator[1]):
            match = None  # RFC 9110 If-Range: another version than the client's: the whole file
        status = 200
        if match:
            start = int(match[1])
            end = min(int(match[2]), size - 1) if match[2] else end
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return self._record(416, 0)
            status = 206
        fault = hub.faults.get(name)
        if not (fault and not head and fault.times > 0):
            fault = None
        elif fault:
            fault.times -= 1
        length = end - start + 1 + (fault.extra if fault else 0)
        self.send_response(status)
        if fault and fault.no_length:
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header(*validator)
        if hub_headers:
            self.send_header("X-Repo-Commit", hub.commit)
            if "lfs" in entry:
                self.send_header("X-Linked-Etag", etag)
                self.send_header("X-Linked-Size", str(size))
        self.end_headers()
        if head:
            return self._record(status, 0)
        with hub._lock:
            hub.active += 1
            hub.max_active = max(hub.max_active, hub.active)
        try:
            self._record(status, self._send_body(target, start, end - start + 1, fault))
        finally:
            with hub._lock:
                hub.active -= 1

    def _send_body(self, target: Path, start: int, count: int, fault: Fault | None) -> int:
        """Send `count` bytes of the file from `start`, with the fault applied, at most `rate` bytes/s."""
        hub = self.hub
        limit = fault.drop_after if fault and fault.drop_after is not None else None
        if limit is not None:
            self.close_connection = True
        block = min(1 << 16, hub.rate // 20) if hub.rate else 1 << 20
        sent, began = 0, time.monotonic()
        try:
            with target.open("rb") as handle:
                handle.seek(start)
                total = count + (fault.extra if fault else 0)
                while sent < total and (limit is None or sent < limit):
                    want = min(block, total - sent, (limit - sent) if limit is not None else block)
                    data = handle.read(min(want, count - sent)) if sent < count else b"\0" * want
                    if fault and fault.corrupt and sent == 0:
                        data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                    if not data:
                        break
                    self.wfile.write(data)
                    sent += len(data)
                    if hub.rate:
                        time.sleep(max(0.0, began + sent / hub.rate - time.monotonic()))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        return sent
