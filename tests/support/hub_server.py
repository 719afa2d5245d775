"""A local HTTP server that speaks the part of the model hubs' protocols downloads use.

It serves one directory as a model repository at one commit:
- Hugging Face: `GET /api/models/{repo}/revision/{rev}` (siblings; with `?blobs=true` sizes, git blob
  ids and LFS sha256), `GET /api/models/{repo}/tree/{rev}` (the recursive listing),
  `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with `X-Repo-Commit`, `ETag`, `X-Linked-Etag` and
  `X-Linked-Size` headers and byte ranges;
- ModelScope: `GET /api/v1/models/{repo}/repo/files?Revision=&Recursive=` and
  `GET /api/v1/models/{repo}/repo?Revision=&FilePath=`;
- a plain mirror: `GET /mirror/{file}` and `/mirror/kimi-manifest.json`.
Faults are injected per file: drop the connection after N bytes, or serve corrupted bytes, for the
next K requests. Every request is logged (method, path, Range, bytes sent), so tests can see what
a client really transferred.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, unquote, urlsplit

# Files at least this large are stored in LFS on the hub; smaller ones are plain git blobs.
LFS_THRESHOLD = 1 << 20
COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class Fault:
    drop_after: int | None = None  # close the connection after sending this many body bytes
    corrupt: bool = False  # flip bytes in the body
    times: int = 1  # how many GETs of the file the fault applies to


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    sent: int


@dataclass
class HubServer:
    root: Path
    repo: str
    host: str = "127.0.0.1"
    port: int = 0
    commit: str = COMMIT
    token: str = ""
    faults: dict[str, Fault] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())

    def sent_bytes(self, name: str) -> int:
        return sum(r.sent for r in self.log if r.method == "GET" and r.path.endswith("/" + name))

    def gets(self, name: str) -> list[Request]:
        return [r for r in self.log if r.method == "GET" and r.path.endswith("/" + name)]

    def sibling(self, path: Path) -> dict:
        rel = path.relative_to(self.root).as_posix()
        data = path.read_bytes()
        entry = {"rfilename": rel, "size": len(data),
                 "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if len(data) >= LFS_THRESHOLD:
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

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
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parse_qs(parts.query)
        if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
            return self._json(401, {"error": "Invalid credentials in Authorization header"}, head)
        repo = hub.repo
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
                {"path": s["rfilename"], "size": s["size"],
                 "sha256": hashlib.sha256((hub.root / s["rfilename"]).read_bytes()).hexdigest()}
                for s in map(hub.sibling, hub.files())
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
            data = path.read_bytes()
            rel = path.relative_to(self.hub.root).as_posix()
            files.append({"Name": path.name, "Path": rel, "Type": "blob", "Size": len(data),
                          "Sha256": hashlib.sha256(data).hexdigest(), "Revision": self.hub.commit})
        self._json(200, {"Code": 200, "Data": {"Files": files}, "Success": True}, head)

    # --- responses -----------------------------------------------------------------------------
    def _record(self, status: int, sent: int) -> None:
        self.hub.log.append(Request(self.command, self.path, self.headers.get("Range"), status, sent))

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
        data = target.read_bytes()
        start, end = 0, len(data) - 1
        match = _RANGE.match(self.headers.get("Range", ""))
        status = 200
        if match:
            start = int(match[1])
            end = int(match[2]) if match[2] else end
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return self._record(416, 0)
            status = 206
        body = data[start:end + 1]
        fault = hub.faults.get(name)
        if fault and not head and fault.times > 0:
            fault.times -= 1
            if fault.corrupt:
                body = bytes(b ^ 0xFF for b in body[:64]) + body[64:]
            if fault.drop_after is not None:
                body = body[:fault.drop_after]
                self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        if hub_headers:
            entry = hub.sibling(target)
            etag = entry["lfs"]["sha256"] if "lfs" in entry else entry["blobId"]
            self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("ETag", f'"{etag}"')
            if "lfs" in entry:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
        self.end_headers()
        if head:
            return self._record(status, 0)
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self._record(status, len(body))
