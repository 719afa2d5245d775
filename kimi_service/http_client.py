"""The one way this package makes an HTTP client for the engine: health, smoke, the exporter, serve's
polls, tune and bench.

- A proxy never sees a request to this host: HTTP_PROXY, HTTPS_PROXY, ALL_PROXY (either case) apply
  only to URLs elsewhere, so the API key never travels to a proxy on its way to the host's own engine.
- A SOCKS or malformed proxy variable for a URL elsewhere is a one-line UsageError, not an ImportError.
- A request to this host's engine is bounded as a whole by its timeout: httpx's own timeouts bound each
  read, so an answer trickling a byte at a time would otherwise stretch a 10-second check without end.
- An answer from this host's engine is bounded in size (MAX_LOCAL_ANSWER) and asked for unencoded: one that
  comes compressed anyway (a bomb) or runs past the bound is an httpx error, as an unreachable one is.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from typing import Any

import httpcore
import httpx

from kimi_service.errors import UsageError

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def is_local(url: str) -> bool:
    """Whether `url` names this host: localhost, a loopback or wildcard address, or one of its own."""
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: resolved elsewhere, maybe through the proxy the operator set
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address.is_loopback or address.is_unspecified:
        return True
    # Here, not at the top: the launcher's package imports the modules that import this one.
    from kimi_service.launcher.cluster import interface_addresses

    return str(address) in interface_addresses().values()


class _Deadline(threading.local):
    """When the request this thread is making must be done (monotonic seconds), or None."""

    at: float | None = None


_deadline = _Deadline()


def _bounded(timeout: float | None) -> float | None:
    if _deadline.at is None:
        return timeout
    left = _deadline.at - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the request's time ran out")
    return left if timeout is None else min(timeout, left)


# httpcore before 0.17 (Debian 12's, under a host's minimal venv) has no pluggable network backend: there the
# module still imports, and local clients keep httpx's per-read timeouts.
_BACKENDS = hasattr(httpcore, "NetworkStream") and hasattr(httpcore, "NetworkBackend")


class _DeadlineStream(httpcore.NetworkStream if _BACKENDS else object):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _bounded(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _bounded(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _bounded(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend if _BACKENDS else object):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_tcp(host, port, _bounded(timeout), local_address,
                                                         socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, _bounded(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


# /metrics of a large deployment is a few hundred KB; every other answer serve and health read is smaller.
MAX_LOCAL_ANSWER = 16 << 20


class AnswerRefused(httpx.HTTPError):
    """The local engine's answer is larger than MAX_LOCAL_ANSWER or encoded though asked not to be."""


class _CappedStream(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, limit: int, url: str) -> None:
        self._stream, self._limit, self._url = stream, limit, url

    def __iter__(self):
        seen = 0
        for chunk in self._stream:
            seen += len(chunk)
            if seen > self._limit:
                raise AnswerRefused(f"{self._url} answered more than {self._limit} bytes")
            yield chunk

    def close(self) -> None:
        self._stream.close()


class _LocalTransport(httpx.HTTPTransport):
    """httpx's transport, for this host's engine: answers unencoded and bounded in size."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = super().handle_request(request)
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            response.close()
            raise AnswerRefused(f"{request.url} answered a {encoding[:20]!r}-encoded body, asked for none")
        response.stream = _CappedStream(response.stream, MAX_LOCAL_ANSWER, str(request.url))
        return response


class _DeadlineTransport(_LocalTransport):
    """The local transport, with each request's read timeout as the bound on the whole request."""

    def __init__(self) -> None:
        super().__init__()
        self._pool.close()
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(),
                                             network_backend=_DeadlineBackend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        read = request.extensions.get("timeout", {}).get("read")
        _deadline.at = None if read is None else time.monotonic() + read
        return super().handle_request(request)


def _proxy_refused(url: str, exc: Exception) -> UsageError:
    return UsageError(f"cannot reach {url} through the proxy the environment names ({', '.join(PROXY_VARIABLES)}): "
                      f"{' '.join(str(exc).split())[:200]}; unset the variable or name an http:// proxy")


def client_for(url: str, **kwargs: Any) -> httpx.Client:
    """A client for requests to `url`'s host: see the module's docstring."""
    if is_local(url):
        transport = _DeadlineTransport() if _BACKENDS else _LocalTransport()
        return httpx.Client(transport=transport, trust_env=False, **kwargs)
    try:
        return httpx.Client(**kwargs)  # the environment's proxies apply, and httpx's per-read timeouts
    except (ImportError, ValueError, httpx.InvalidURL) as exc:
        raise _proxy_refused(url, exc) from None


def async_client_for(url: str, **kwargs: Any) -> httpx.AsyncClient:
    """An async client for `url`'s host (bench's load), by the same proxy rules; timeouts stay per read."""
    try:
        return httpx.AsyncClient(trust_env=not is_local(url), **kwargs)
    except (ImportError, ValueError, httpx.InvalidURL) as exc:
        raise _proxy_refused(url, exc) from None
