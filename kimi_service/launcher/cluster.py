"""Several nodes, one engine: vLLM's rendezvous flags and addresses, and how the nodes watch each other.

systemd cannot order units across hosts, so the nodes watch each other over HTTP. A follower runs vLLM
headless and answers /health on the API port while its engine runs; the leader starts its engine only
once every follower answers, and fails when a follower stops answering or comes back as a new instance.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import secrets
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from kimi_service.config import ClusterConfig, ConfigError
from kimi_service.errors import EngineFailed
from kimi_service.untrusted import UntrustedInput, loads_json

# Probes in a row a follower may miss before the leader gives up on the group (a restart is caught
# at once: the follower comes back as another instance).
FOLLOWER_MISSES = 3
SIOCGIFADDR = 0x8915


def cluster_flags(cluster: ClusterConfig, data_parallel_local: int = 0) -> list[str]:
    """vLLM's own multi-node launch: every node gets the same rendezvous, each its own rank.

    TP x PP: torch.distributed's (--nnodes, --node-rank, --master-addr, --master-port). DP+EP
    (`data_parallel_local` ranks per node): the DP handshake at the leader's address on master_port, and
    each follower's first DP rank; the leader starts at rank 0 and serves the API.
    """
    if not data_parallel_local:
        return ["--nnodes", str(cluster.nodes), "--node-rank", str(cluster.node_rank),
                "--master-addr", cluster.master_addr, "--master-port", str(cluster.master_port)]
    flags = ["--data-parallel-address", cluster.master_addr, "--data-parallel-rpc-port", str(cluster.master_port)]
    if not cluster.is_leader:
        flags += ["--data-parallel-start-rank", str(cluster.node_rank * data_parallel_local)]
    return flags


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface of this host (the kernel's SIOCGIFADDR; no tools needed)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def cluster_env(cluster: ClusterConfig, interfaces: Mapping[str, str]) -> dict[str, str]:
    """The node's address for vLLM's message queues, and the interface the collectives use.

    vLLM advertises VLLM_HOST_IP to the other nodes; without it, it guesses from the default route. Gloo
    (CPU) and NCCL's socket transport otherwise pick an interface by host name, which in many images
    resolves to a loopback address the other nodes cannot reach: the interface that holds the node's
    cluster address is the one to use unless the operator named another.
    """
    env = {"VLLM_HOST_IP": cluster.address}
    try:
        literal = ipaddress.ip_address(cluster.address)
    except ValueError:
        literal = None  # a host name: leave the interface to the libraries or the operator
    if literal is not None:
        names = [name for name, address in interfaces.items() if address == cluster.address]
        if not names and literal.version == 4:
            raise ConfigError(
                f"cluster.addresses[{cluster.node_rank}]: {cluster.address} is not an address of this host "
                f"(its addresses: {', '.join(sorted(interfaces.values())) or 'none'}); check node_rank and the "
                "order of the addresses"
            )
        if names:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = names[0]
    env.update(cluster.env)
    return env


def _proc_net_address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` (or the 32-digit IPv6 form) from /proc/net/tcp* -> ("127.0.0.1", 8080)."""
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host byte order (little-endian here).
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def connected_to(tables: Iterable[str], host: str, port: int | None) -> bool:
    """Whether /proc/net/tcp and tcp6 show an established connection to host:port (any port: None)."""
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "01":
                remote_host, remote_port = _proc_net_address(fields[2])
                if remote_host == host and port in (None, remote_port):
                    return True
    return False


def joined(cluster: ClusterConfig, data_parallel: bool = False) -> bool:
    """A follower's engine has joined the group: it holds a connection to the leader's rendezvous
    store (torch.distributed's TCPStore on master_addr:master_port), which it keeps while it is a member.
    A DP+EP follower's engines shake hands on that port and then keep their own connections to the
    leader's front end and DP coordinator (ports the leader picks): any connection to the leader counts."""
    tables = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            tables.append(Path(name).read_text())
    return connected_to(tables, cluster.master_addr, None if data_parallel else cluster.master_port)


class FollowerStatus:
    """What a follower answers on GET /health (on its API port: it runs no API server)."""

    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster
        # Tells the leader a restarted follower from the one that joined its group.
        self.instance = secrets.token_hex(8)
        self.engine_pid: int | None = None
        self.engine_exit: str | None = None

    def document(self) -> tuple[int, dict[str, Any]]:
        running = self.engine_pid is not None and self.engine_exit is None
        body = {"role": "follower", "node_rank": self.cluster.node_rank, "instance": self.instance,
                "engine": "running" if running else (self.engine_exit or "not started"),
                "master": f"{self.cluster.master_addr}:{self.cluster.master_port}"}
        return (200 if running else 503), body


class FollowerWatch:
    """The leader's view of its followers: each must answer /health, as the same instance throughout."""

    def __init__(self, cluster: ClusterConfig, port: int, timeout: float):
        self.cluster = cluster
        self.port = port
        self.timeout = timeout
        self.instances: dict[str, str] = {}
        self.misses: dict[str, int] = dict.fromkeys(cluster.followers, 0)

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{self.port}/health"

    def probe(self, client: httpx.Client, address: str) -> tuple[str | None, str]:
        """(instance, "") when the follower's engine runs, else (None, why not)."""
        try:
            response = client.get(self.url(address), timeout=self.timeout)
        except httpx.HTTPError as exc:
            return None, f"not answering ({type(exc).__name__})"
        try:
            body = loads_json(response.content, response.request.url.path)
        except UntrustedInput:
            body = None
        body = body if isinstance(body, dict) else {}
        if response.status_code != 200:
            return None, f"engine {body.get('engine', 'down')} (HTTP {response.status_code})"
        return str(body.get("instance")), ""

    def name(self, address: str) -> str:
        return f"node {self.cluster.addresses.index(address)} ({address})"

    def waiting_for(self, client: httpx.Client) -> list[str]:
        """Before the leader's engine starts: the followers not up yet, with why."""
        missing = []
        for address in self.cluster.followers:
            instance, why = self.probe(client, address)
            if instance is None:
                missing.append(f"{self.name(address)}: {why}")
            else:
                self.instances[address] = instance
        return missing

    def check(self, client: httpx.Client) -> None:
        """While the group runs: raise EngineFailed when a follower is gone or was restarted."""
        for address in self.cluster.followers:
            instance, why = self.probe(client, address)
            if instance is None:
                self.misses[address] += 1
                if self.misses[address] >= FOLLOWER_MISSES:
                    raise EngineFailed(f"follower {self.name(address)} is down: {why}; the engine spans it, "
                                       "so this node stops too and the group re-forms on restart")
                continue
            self.misses[address] = 0
            if instance != self.instances.get(address):
                raise EngineFailed(f"follower {self.name(address)} restarted (instance {instance}, joined as "
                                   f"{self.instances.get(address)}): its place in the group is lost")
