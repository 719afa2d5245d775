"""How the downloader reads one byte range of a file: over HTTP (with If-Range when it resumes), or from
a local source's tree through the directory descriptors it was listed with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from kimi_service.safedir import SafeDir
from kimi_service.weights_sources import TOKEN_HINT, FetchError, LocalSourceRefused, RemoteFile

CHUNK = 1 << 20


def strong_validator(validator: str | None) -> bool:
    """Whether a reply's ETag promises byte-identical content (RFC 9110 8.8.3): quoted, not W/."""
    return validator is not None and validator.startswith('"')


class RedirectRefused(FetchError):
    """A file nothing can check was redirected to a host nobody named: the source's setup, not a failure
    a retry mends."""

    exit_code = 2


def _check_redirect(remote: RemoteFile, response: httpx.Response, allowed: frozenset[str]) -> None:
    if not response.history or remote.published_hash:
        return  # not redirected, or what arrives is checked against the published hash
    asked, landed = httpx.URL(remote.url).host, response.url.host
    if landed != asked and landed not in allowed:
        raise RedirectRefused(f"{remote.url} redirected to {landed}, a host the listing did not name, and "
                              f"{remote.path} has no published hash to check what it would send: refused "
                              f"(--redirect-host {landed} allows it)")


@dataclass
class Reply:
    status: int
    etag: str | None
    length: int | None
    content_range: str | None
    chunks: Iterator[bytes]


@contextmanager
def open_range(client: httpx.Client, remote: RemoteFile, offset: int, end: int | None,
               local: SafeDir | None = None, *, if_range: str | None = None,
               redirect_hosts: frozenset[str] = frozenset()) -> Iterator[Reply]:
    """GET `remote` from `offset` (to `end`, exclusive, when given), only if it is still `if_range`'s
    version (else the source sends it whole); from the `local` source's tree, when given, the file is
    read through the directory descriptors it was listed with, never by path. A file without a published
    hash is taken only from the host it was listed at or one of `redirect_hosts`."""
    if local is not None:
        fd = local.open_read(remote.path)
        if fd is None:
            raise LocalSourceRefused(f"{local.path / remote.path} is no plain file of the local source any "
                                     "more; refusing to read through it as root")
        with os.fdopen(fd, "rb") as source:
            source.seek(offset)
            yield Reply(206, None, None, None, _read_file(source, None if end is None else end - offset))
        return
    headers = {}
    if offset or end is not None:
        headers["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"
        if if_range is not None:
            headers["If-Range"] = if_range
    with client.stream("GET", remote.url, headers=headers) as response:
        _check_redirect(remote, response, redirect_hosts)
        if response.status_code in (401, 403):
            raise FetchError(f"{remote.url} answered {response.status_code}: {remote.path} needs a token with "
                             f"access ({TOKEN_HINT})")
        if response.status_code not in (200, 206):
            raise FetchError(f"{remote.url} answered {response.status_code} for {remote.path}")
        length = response.headers.get("Content-Length")
        # python -m http.server (the fan-out) sends no ETag, only Last-Modified: either validates a resume.
        validator = response.headers.get("ETag") or response.headers.get("Last-Modified")
        yield Reply(response.status_code, validator,
                    int(length) if length and length.isdigit() else None,
                    response.headers.get("Content-Range"), response.iter_bytes())


def _read_file(source, remaining: int | None) -> Iterator[bytes]:
    while remaining is None or remaining > 0:
        chunk = source.read(CHUNK if remaining is None else min(CHUNK, remaining))
        if not chunk:
            return
        if remaining is not None:
            remaining -= len(chunk)
        yield chunk
