"""The schema of /etc/kimi-service/config.yaml: defaults, and validation that names the bad key.

Secrets never live here: the API key and hub token come from the environment
(systemd's EnvironmentFile=/etc/kimi-service/secrets.env).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_service.engine_flags import RESERVED, check_extra_args, has_control
from kimi_service.envfile import EnvFileError, parse_env_file
from kimi_service.errors import UsageError
from kimi_service.route_gate import FORWARDED_ALLOW_IPS, TRUSTED_CLIENTS_ENV, parse_networks
from kimi_service.untrusted import MAX_SECONDS, UntrustedInput, read_bytes
from kimi_service.values import is_repo_id, path_problem
from kimi_service.workloads import WORKLOADS
from kimi_service.yaml_input import MAX_BYTES, YamlRefused, load_yaml

if TYPE_CHECKING:
    from kimi_service.model import Origin

DEFAULT_CONFIG_PATH = Path("/etc/kimi-service/config.yaml")
ENGINES = ("auto", "cuda", "cpu")
# Flags the supervisor owns: letting extra_args change them would break readiness checks or leak
# the key into argv, where `ps` shows it to every user (engine_flags.RESERVED says where each belongs).
RESERVED_EXTRA_ARGS = tuple(RESERVED)
# Environment a cluster section may set for the engine: the collective libraries' own knobs only.
CLUSTER_ENV_PREFIXES = ("NCCL_", "GLOO_")
# Engine environment plan.extra_env may not set, and where each belongs instead: secrets stay in
# secrets.env (plan.json and config.yaml are readable), serve owns the paths and its systemd link,
# the planner sizes the CPU KV cache.
RESERVED_EXTRA_ENV = {
    "VLLM_API_KEY": "kimi_api_key (secrets.env)",
    "HF_TOKEN": "kimi_hf_token (secrets.env)",
    "HUGGING_FACE_HUB_TOKEN": "kimi_hf_token (secrets.env)",
    "VLLM_CACHE_ROOT": "paths.cache_dir",
    "TORCHINDUCTOR_CACHE_DIR": "paths.cache_dir",
    "TRITON_CACHE_DIR": "paths.cache_dir",
    "XDG_CACHE_HOME": "paths.cache_dir",
    "HF_HOME": "paths.cache_dir",
    "TMPDIR": "paths.tmp_dir",
    "NOTIFY_SOCKET": "the unit (only serve speaks to systemd)",
    "WATCHDOG_USEC": "the unit (only serve speaks to systemd)",
    "VLLM_NO_USAGE_STATS": "kimi-service (always 1)",
    "PYTHONUNBUFFERED": "kimi-service (always 1)",
    TRUSTED_CLIENTS_ENV: "api.trusted_clients (kimi_api_trusted_cidrs)",
    "VLLM_CPU_KVCACHE_SPACE": "--kv-cache-memory-bytes in plan.extra_args",
    # uvicorn would take the client's address from X-Forwarded-For, which the client writes: the route
    # gate must judge the socket's peer.
    FORWARDED_ALLOW_IPS: "nothing: the engine never trusts forwarded client addresses",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# vLLM puts ZeroMQ sockets at TMPDIR/<36-character uuid>; a Unix socket path holds at most 107 bytes.
MAX_TMP_DIR_LENGTH = 107 - 37


class ConfigError(UsageError):
    """config.yaml is unreadable or holds a bad value; the message names the key path."""


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    served_name: str
    # The hub repository and commit the weights are a copy of (the weights stage writes them): the repo id,
    # not the shapes, finds the model's catalog entry.
    repo: str = ""
    commit: str = ""

    @property
    def origin(self) -> Origin | None:
        from kimi_service.model import Origin

        return Origin(self.repo, self.commit) if self.repo else None


@dataclass(frozen=True)
class ApiConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # Addresses or networks besides the host itself that may read /health and /metrics on the API port.
    trusted_clients: tuple[str, ...] = ()

    @property
    def local_url(self) -> str:
        """Where programs on the host reach the API (a wildcard bind answers on loopback)."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1" if host != "::" else "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class PlanConfig:
    engine: str = "auto"
    workload: str = "chat"
    max_model_len: int | None = None
    nodes: int = 1
    extra_args: tuple[str, ...] = ()
    # More engine environment (vLLM's own VLLM_* knobs, OMP_*); validated against RESERVED_EXTRA_ENV.
    extra_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PathsConfig:
    state_dir: Path = Path("/var/lib/kimi-service")
    cache_dir: Path = Path("/var/lib/kimi-service/cache")
    tmp_dir: Path = Path("/var/lib/kimi-service/tmp")
    plan_file: Path = Path("/run/kimi-service/plan.json")


@dataclass(frozen=True)
class ServeConfig:
    """The supervisor: timings in seconds, and its readiness endpoint for load balancers.

    `ready_port` (0: none) answers GET /ready with 200 only while the engine takes requests; on SIGTERM
    it turns 503 at once, and the engine keeps serving for `withdraw_delay` seconds (long enough for the
    balancers' checks to take the node out) before in-flight requests are drained and vLLM is stopped.

    `watchdog_sec` (0: off) is serve's own watchdog where systemd arms none (supervisord, a shell): once
    ready, vLLM not answering /health for that long gets its process group killed and serve exits 1.
    """

    startup_timeout: float = 3600.0
    drain_timeout: float = 30.0
    stop_timeout: float = 30.0
    probe_interval: float = 5.0
    ready_port: int = 0
    withdraw_delay: float = 0.0
    watchdog_sec: int = 0


@dataclass(frozen=True)
class HealthConfig:
    timeout: float = 10.0
    smoke: bool = True
    smoke_max_tokens: int = 4


@dataclass(frozen=True)
class ExporterConfig:
    host: str = "0.0.0.0"
    port: int = 9400
    health_interval: float = 30.0


@dataclass(frozen=True)
class ClusterConfig:
    """One vLLM instance over several hosts: vLLM's own multi-node launch (--nnodes, --node-rank).

    `addresses` lists every node in rank order; node 0 (the leader) runs the OpenAI API and hosts the
    rendezvous on `master_port`; the others (followers) run vLLM headless and answer /health on the
    API port so the leader can tell they are up.
    """

    node_rank: int
    addresses: tuple[str, ...]
    master_port: int = 29500
    join_timeout: float = 600.0
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return len(self.addresses)

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    @property
    def address(self) -> str:
        """This node's own address on the cluster network."""
        return self.addresses[self.node_rank]

    @property
    def followers(self) -> tuple[str, ...]:
        return self.addresses[1:]


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    api: ApiConfig = field(default_factory=ApiConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    cluster: ClusterConfig | None = None


class _Section:
    """Reads one mapping, tracking its key path and refusing keys nobody read."""

    def __init__(self, data: Any, path: str):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or 'the top level'}: expected a mapping of keys, got {_kind(data)}")
        self.data = dict(data)
        self.path = path
        self.known: list[str] = []

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def _take(self, name: str) -> Any:
        self.known.append(name)
        return self.data.get(name)

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def section(self, name: str) -> _Section:
        return _Section(self._take(name), self.key(name))

    def string(self, name: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self._take(name)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.key(name)}: required, but missing; set it to a string")
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{self.key(name)}: expected a string, got {_kind(value)} {_show(value)}")
        if has_control(value):
            raise ConfigError(f"{self.key(name)}: {_show(value)} holds a control character (a newline?); remove it")
        if choices and value not in choices:
            raise ConfigError(f"{self.key(name)}: {_show(value)} is not one of {', '.join(choices)}")
        return value

    def path_value(self, name: str, default: Path | None = None) -> Path:
        value = self.string(name, None if default is None else str(default))
        if rule := path_problem(value):
            raise ConfigError(f"{self.key(name)}: {_show(value)} must be {rule}")
        return Path(value)

    def integer(self, name: str, default: int, minimum: int, maximum: int | None = None) -> int:
        value = self._take(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.key(name)}: expected an integer, got {_kind(value)} {_show(value)}")
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise ConfigError(f"{self.key(name)}: {value} is out of range; use >= {minimum}{upper}")
        return value

    def number(self, name: str, default: float, minimum: float) -> float:
        """Seconds: finite (`.nan` never times out and busy-loops a wait), within [minimum, MAX_SECONDS]."""
        value = self._take(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.key(name)}: expected a number of seconds, got {_kind(value)} {_show(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{self.key(name)}: {value} is not a number of seconds; give a finite number")
        if not minimum <= value <= MAX_SECONDS:
            raise ConfigError(f"{self.key(name)}: {value} is out of range; use >= {minimum} and <= {MAX_SECONDS:.0f}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self._take(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: expected true or false, got {_kind(value)} {_show(value)}")
        return value

    def string_list(self, name: str) -> tuple[str, ...]:
        value = self._take(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ConfigError(f"{self.key(name)}: expected a list of strings, got {_show(value)}")
        return tuple(str(v) for v in value)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - set(self.known))
        if unknown:
            raise ConfigError(
                f"{', '.join(self.key(str(k)) for k in unknown)}: unknown key; "
                f"known keys here are {', '.join(self.known)}"
            )


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short (one line, whatever the file holds)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _host(section: _Section, name: str, default: str) -> str:
    value = section.string(name, default)
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not value or any(c.isspace() or c in "/:@" for c in value):
            raise ConfigError(f"{section.key(name)}: {_show(value)} is not an IP address or host name") from None
    return value


def _networks(section: _Section, name: str) -> tuple[str, ...]:
    items = section.string_list(name)
    try:
        return tuple(str(network) for network in parse_networks(items))
    except ValueError as exc:
        raise ConfigError(f"{section.key(name)}: {exc}") from None


def _extra_args(section: _Section) -> tuple[str, ...]:
    """vLLM flags, refused when any spelling vLLM's parser accepts names a flag kimi-service sets."""
    args = section.string_list("extra_args")
    try:
        check_extra_args(args, section.key("extra_args"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return args


# Longer than any repo id or model path needs, far below what one argv item may hold (128 KiB): a
# longer one would pass the check and fail the engine's exec.
MAX_SERVED_NAME = 1024


def _served_name(section: _Section, default: str) -> str:
    """One argv item after --served-model-name: a leading `-` would read as a flag, a newline as two
    lines of the unit's environment, a lone surrogate as a failed write wherever the name goes."""
    name = section.string("served_name", default)
    if not name.strip() or name.startswith("-") or name != name.strip():
        raise ConfigError(f"{section.key('served_name')}: {_show(name)} cannot be a served model name; use a "
                          "name without surrounding blanks that does not start with '-'")
    if len(name) > MAX_SERVED_NAME:
        raise ConfigError(f"{section.key('served_name')}: a name of {len(name)} characters; use at most "
                          f"{MAX_SERVED_NAME} (clients send it with every request)")
    if not name.isprintable():  # also a lone surrogate, which no UTF-8 writer can encode
        raise ConfigError(f"{section.key('served_name')}: {_show(name)} holds a character that is not printable "
                          "(a lone surrogate, a format or control character); use printable text")
    return name


def _model_repo(section: _Section) -> str:

    repo = section.string("repo", "")
    if repo and not is_repo_id(repo):
        raise ConfigError(f"{section.key('repo')}: {_show(repo)} is not a hub repo id (ORG/NAME)")
    return repo


def _word(section: _Section, name: str) -> str:
    value = section.string(name, "")
    if any(c.isspace() for c in value):
        raise ConfigError(f"{section.key(name)}: {_show(value)} holds a blank; a commit is one word")
    return value


def _env_mapping(section: _Section, name: str) -> dict[str, str]:
    """A mapping of environment variable names to string (or integer) values."""
    data = section._take(name) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{section.key(name)}: expected a mapping of variable names to values, got {_kind(data)}")
    env: dict[str, str] = {}
    for var, value in data.items():
        if not isinstance(var, str) or not _ENV_NAME.fullmatch(var):
            raise ConfigError(f"{section.key(name)}: {var!r} is not an environment variable name")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{section.key(name)}.{var}: expected a string or integer, got {_kind(value)} "
                              f"{_show(value)}")
        if "\0" in str(value) or "\n" in str(value):
            raise ConfigError(f"{section.key(name)}.{var}: a value may not hold a newline or NUL byte")
        env[var] = str(value)
    return env


def _extra_env(section: _Section) -> dict[str, str]:
    env = _env_mapping(section, "extra_env")
    for var in env:
        if var in RESERVED_EXTRA_ENV:
            raise ConfigError(f"{section.key('extra_env')}.{var}: set by kimi-service itself; use "
                              f"{RESERVED_EXTRA_ENV[var]} instead")
        if var.startswith(CLUSTER_ENV_PREFIXES):
            raise ConfigError(f"{section.key('extra_env')}.{var}: the collective libraries' variables belong in "
                              "cluster.env (kimi_nccl_extra_env)")
    return env


def _cluster(top: _Section) -> ClusterConfig | None:
    if not top.has("cluster"):
        top.section("cluster")  # an empty `cluster:` is a single host, like no section at all
        return None
    c = top.section("cluster")
    raw = c._take("addresses")
    if not isinstance(raw, list) or len(raw) < 2:
        raise ConfigError(
            f"{c.key('addresses')}: expected a list of at least two node addresses in rank order (the leader "
            f"first), got {_show(raw)}; a single host needs no cluster section"
        )
    addresses = []
    for index, value in enumerate(raw):
        item = f"addresses[{index}]"
        address = _host(_Section({item: value}, c.path), item, "")
        if address in ("0.0.0.0", "::"):
            raise ConfigError(f"{c.key(item)}: {address} is a wildcard; give the node's own address")
        addresses.append(address)
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ConfigError(f"{c.key('addresses')}: {', '.join(repeated)} listed twice; each node once, in rank order")
    node_rank = c._take("node_rank")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < len(addresses):
        raise ConfigError(
            f"{c.key('node_rank')}: expected this node's index in addresses (0 to {len(addresses) - 1}), "
            f"got {_show(node_rank)}"
        )
    master_port = c.integer("master_port", ClusterConfig.master_port, 1024, 65535)
    join_timeout = c.number("join_timeout", ClusterConfig.join_timeout, 1)
    env = _env_mapping(c, "env")
    for name in env:
        if not name.startswith(CLUSTER_ENV_PREFIXES) or not name.isupper():
            raise ConfigError(
                f"{c.key('env')}.{name}: only the collective libraries' variables belong here "
                f"({', '.join(p + '*' for p in CLUSTER_ENV_PREFIXES)})"
            )
    c.finish()
    return ClusterConfig(node_rank=node_rank, addresses=tuple(addresses), master_port=master_port,
                         join_timeout=join_timeout, env=env)


def _paths(top: _Section) -> PathsConfig:
    d = top.section("paths")
    state = d.path_value("state_dir", PathsConfig.state_dir)
    paths = PathsConfig(
        state_dir=state,
        cache_dir=d.path_value("cache_dir", state / "cache"),
        tmp_dir=d.path_value("tmp_dir", state / "tmp"),
        plan_file=d.path_value("plan_file", PathsConfig.plan_file),
    )
    d.finish()
    if len(str(paths.tmp_dir)) > MAX_TMP_DIR_LENGTH:
        raise ConfigError(
            f"paths.tmp_dir: {str(paths.tmp_dir)!r} is {len(str(paths.tmp_dir))} characters; vLLM's IPC sockets "
            f"live there and need it at most {MAX_TMP_DIR_LENGTH}: choose a shorter directory"
        )
    return paths


def _check_ports(api: ApiConfig, exporter: ExporterConfig, serve: ServeConfig, cluster: ClusterConfig | None) -> None:
    """Every listener of a node needs a port of its own."""
    if exporter.port == api.port:
        raise ConfigError(f"exporter.port: {exporter.port} is also api.port; give the exporter its own port")
    if serve.ready_port in (api.port, exporter.port):
        raise ConfigError(f"serve.ready_port: {serve.ready_port} is also the api or exporter port; readiness "
                          "needs a port of its own (or 0 for none)")
    if cluster and cluster.master_port in (api.port, exporter.port, serve.ready_port):
        raise ConfigError(f"cluster.master_port: {cluster.master_port} is also the api, exporter or ready port; "
                          "the rendezvous needs a port of its own")


def parse_config(data: Any) -> Config:
    """Validate a loaded YAML document; pure, so tests and `plan` can use it without files."""
    top = _Section(data, "")
    m = top.section("model")
    model_path = m.path_value("path")
    model = ModelConfig(path=model_path, served_name=_served_name(m, model_path.name), repo=_model_repo(m),
                        commit=_word(m, "commit"))
    m.finish()

    a = top.section("api")
    api = ApiConfig(host=_host(a, "host", ApiConfig.host), port=a.integer("port", ApiConfig.port, 1, 65535),
                    trusted_clients=_networks(a, "trusted_clients"))
    a.finish()

    p = top.section("plan")
    max_len = p.integer("max_model_len", 0, 0)
    plan = PlanConfig(
        engine=p.string("engine", PlanConfig.engine, ENGINES),
        workload=p.string("workload", PlanConfig.workload, WORKLOADS),
        max_model_len=max_len or None,
        nodes=p.integer("nodes", PlanConfig.nodes, 1, 64),
        extra_args=_extra_args(p),
        extra_env=_extra_env(p),
    )
    p.finish()

    paths = _paths(top)

    s = top.section("serve")
    serve = ServeConfig(
        startup_timeout=s.number("startup_timeout", ServeConfig.startup_timeout, 1),
        drain_timeout=s.number("drain_timeout", ServeConfig.drain_timeout, 0),
        stop_timeout=s.number("stop_timeout", ServeConfig.stop_timeout, 1),
        probe_interval=s.number("probe_interval", ServeConfig.probe_interval, 0.1),
        ready_port=s.integer("ready_port", ServeConfig.ready_port, 0, 65535),
        withdraw_delay=s.number("withdraw_delay", ServeConfig.withdraw_delay, 0),
        watchdog_sec=s.integer("watchdog_sec", ServeConfig.watchdog_sec, 0, int(MAX_SECONDS)),
    )
    s.finish()

    h = top.section("health")
    health = HealthConfig(
        timeout=h.number("timeout", HealthConfig.timeout, 0.1),
        smoke=h.boolean("smoke", HealthConfig.smoke),
        smoke_max_tokens=h.integer("smoke_max_tokens", HealthConfig.smoke_max_tokens, 1, 64),
    )
    h.finish()

    e = top.section("exporter")
    exporter = ExporterConfig(
        host=_host(e, "host", ExporterConfig.host),
        port=e.integer("port", ExporterConfig.port, 1, 65535),
        health_interval=e.number("health_interval", ExporterConfig.health_interval, 1),
    )
    e.finish()
    cluster = _cluster(top)
    top.finish()
    _check_ports(api, exporter, serve, cluster)
    if cluster:
        if p.has("nodes") and plan.nodes != cluster.nodes:
            raise ConfigError(f"plan.nodes: {plan.nodes}, but cluster.addresses lists {cluster.nodes} nodes; "
                              "drop plan.nodes (the cluster section sets it) or make them agree")
        plan = replace(plan, nodes=cluster.nodes)
    elif plan.nodes > 1:
        raise ConfigError(f"plan.nodes: {plan.nodes} needs a cluster section listing the {plan.nodes} nodes' "
                          "addresses (kimi_cluster_group); one host without it runs one node")
    return Config(model=model, api=api, plan=plan, paths=paths, serve=serve, health=health, exporter=exporter,
                  cluster=cluster)


def _read(path: Path, *, missing: str, unreadable: str) -> bytes:
    """A file's bytes, or a ConfigError saying what to do when it is missing or cannot be read."""
    try:
        return read_bytes(path, limit=MAX_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; {missing}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}); {unreadable}") from None
    except UntrustedInput as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: Path = DEFAULT_CONFIG_PATH) -> Config:
    raw = _read(path, missing="pass --config FILE or run the vllm_service role", unreadable="check its owner and mode")
    try:
        data = load_yaml(raw)
    except YamlRefused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_env_file(path: Path) -> dict[str, str]:
    """Variables of a systemd EnvironmentFile, read as systemd reads it for the units (envfile.py).

    Lets a root command on the host take the API key from secrets.env instead of from its environment
    or argv, where a verbose Ansible run or `ps` would show it.
    """
    data = _read(path, missing="it is written by the vllm_service role", unreadable="run as root")
    try:
        return parse_env_file(data)
    except EnvFileError as exc:
        raise ConfigError(f"{path}, {exc}") from None
