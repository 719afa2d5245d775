"""Which of the engine's routes answer which client: an ASGI middleware loaded into vLLM's API server.

vLLM's `--api-key` guards only the OpenAI paths (/v1/...). Its other routes (/invocations runs a full
inference, /tokenize, /pooling, /scale_elastic_ep, the dev-mode control routes, /metrics, /docs) answer
anyone who reaches the port. `serve` starts the engine with `--middleware kimi_service.route_gate.RouteGate`,
and the gate, outermost of the app's middleware, lets through:

- from the host itself (loopback, a Unix socket): every route, as before (health, the exporter, smoke);
- from the addresses in KIMI_API_TRUSTED_CLIENTS (load balancers, Prometheus): also /health and /metrics;
- from anywhere: the OpenAI API under /v1/, where vLLM's own middleware checks the key.

Every other request gets 404, the answer an unknown route gets, so a scan learns nothing from it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

TRUSTED_CLIENTS_ENV = "KIMI_API_TRUSTED_CLIENTS"
# uvicorn's proxy-headers middleware rewrites scope["client"] from X-Forwarded-For when the peer is in
# this list (default 127.0.0.1); the engine never gets it, so the client the gate judges is the socket's peer.
FORWARDED_ALLOW_IPS = "FORWARDED_ALLOW_IPS"
PUBLIC_PREFIX = "/v1/"
MONITORING_PATHS = ("/health", "/metrics")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_NOT_FOUND = b'{"detail":"Not Found"}'


def parse_networks(items: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDRs; a ValueError names the one that is neither."""
    networks = []
    for item in items:
        try:
            networks.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or network (CIDR)") from None
    return tuple(networks)


def client_address(scope: Scope) -> str | None:
    """The peer's address as ASGI reports it; None on a Unix socket, which only this host reaches."""
    client = scope.get("client")
    return str(client[0]) if client else None


def route_allowed(path: str, client: str | None, trusted: tuple[Network, ...]) -> bool:
    if client is None:
        return True
    if path.startswith(PUBLIC_PREFIX):
        return True
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return False  # not an address: nothing to trust it by
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address.is_loopback:
        return True
    monitoring = path in MONITORING_PATHS or path.startswith("/metrics/")
    return monitoring and any(address in network for network in trusted)


class RouteGate:
    """The ASGI middleware: vLLM's `--middleware` instantiates it with the app alone."""

    def __init__(self, app: App, trusted: tuple[Network, ...] | None = None) -> None:
        self.app = app
        if trusted is None:
            trusted = parse_networks(n for n in os.environ.get(TRUSTED_CLIENTS_ENV, "").split(",") if n.strip())
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if route_allowed(path, client_address(scope), self.trusted):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_NOT_FOUND)).encode())]})
        await send({"type": "http.response.body", "body": _NOT_FOUND})
