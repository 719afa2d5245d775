"""Several hosts, one engine: the planner's split over nodes, the config's cluster section, the command
line and environment of each node, and how leader and followers watch each other (real sockets)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from kimi_service import catalog, launcher
from kimi_service.config import ConfigError, parse_config
from kimi_service.errors import UsageError
from kimi_service.hardware import GIB, GpuInventory, parse_gpu_spec
from kimi_service.model import spec_from_catalog
from kimi_service.planner import check_spans_nodes, plan
from tests.support.ports import free_port

KIMI = spec_from_catalog(catalog.get("moonshotai/Kimi-K2.5"))
QWEN = spec_from_catalog(catalog.get("Qwen/Qwen2.5-7B-Instruct"))
BASE = {"model": {"path": "/m/kimi"}, "paths": {"state_dir": "/srv/kimi"}}


def _cluster_config(rank: int = 0, **cluster) -> dict:
    return {**BASE, "cluster": {"node_rank": rank, "addresses": ["10.0.0.1", "10.0.0.2"], **cluster}}


def test_kimi_on_two_a100_nodes_is_tp8_within_a_node_and_pp2_across():
    # Latency: the smallest TP x PP group (chat goes DP+EP: test_planner_scale.py).
    result = plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2, workload="latency")
    assert (result.tensor_parallel_size, result.pipeline_parallel_size, result.nodes) == (8, 2, 2)
    assert "TP stays inside a node" in result.reasons["--pipeline-parallel-size"]
    check_spans_nodes(result)


def test_a_model_that_fits_one_node_is_refused_for_a_cluster():
    result = plan(KIMI, parse_gpu_spec("H200:8"), nodes=2)
    assert result.pipeline_parallel_size == 1
    with pytest.raises(UsageError, match="fits on fewer than the 2 nodes"):
        check_spans_nodes(result)


def test_the_cpu_engine_spreads_over_nodes_with_tensor_parallelism():
    result = plan(QWEN, GpuInventory.cpu(64 * GIB), nodes=2, overrides=["--kv-cache-memory-bytes", "256M"])
    assert result.tensor_parallel_size == 2 and result.pipeline_parallel_size == 1
    assert result.argv[result.argv.index("--tensor-parallel-size") + 1] == "2"
    assert "pipeline parallelism fails" in result.reasons["--tensor-parallel-size"]
    check_spans_nodes(result)
    assert "TORCH_COMPILE_DISABLE" not in result.env
    eager = plan(QWEN, GpuInventory.cpu(64 * GIB), nodes=2, overrides=["--enforce-eager"])
    assert eager.env["TORCH_COMPILE_DISABLE"] == "1"
    # Qwen2.5-7B has 28 attention heads: 3 nodes cannot share them.
    with pytest.raises(UsageError, match="3 nodes do not divide"):
        plan(QWEN, GpuInventory.cpu(64 * GIB), nodes=3)


def test_a_cluster_section_sets_the_nodes_and_names_the_leader():
    config = parse_config(_cluster_config(1, master_port=29600, env={"NCCL_IB_DISABLE": 1}))
    cluster = config.cluster
    assert config.plan.nodes == 2 and cluster.nodes == 2
    assert (cluster.master_addr, cluster.address, cluster.is_leader) == ("10.0.0.1", "10.0.0.2", False)
    assert cluster.followers == ("10.0.0.2",)
    assert dict(cluster.env) == {"NCCL_IB_DISABLE": "1"} and cluster.master_port == 29600
    assert parse_config(BASE).cluster is None


@pytest.mark.parametrize(
    ("cluster", "extra", "fragment"),
    [
        ({"addresses": ["10.0.0.1"]}, {}, "at least two node addresses"),
        ({"addresses": "10.0.0.1,10.0.0.2"}, {}, "at least two node addresses"),
        ({"addresses": ["10.0.0.1", "10.0.0.1"]}, {}, "10.0.0.1 listed twice"),
        ({"addresses": ["10.0.0.1", "0.0.0.0"]}, {}, "cluster.addresses[1]: 0.0.0.0 is a wildcard"),
        ({"addresses": ["10.0.0.1", "a b"]}, {}, "cluster.addresses[1]: 'a b' is not an IP address"),
        ({"node_rank": 2}, {}, "cluster.node_rank: expected this node's index in addresses (0 to 1)"),
        ({"node_rank": None}, {}, "cluster.node_rank"),
        ({"master_port": 8000}, {}, "cluster.master_port: 8000 is also the api, exporter or ready port"),
        ({"env": {"PATH": "/tmp"}}, {}, "cluster.env.PATH: only the collective libraries' variables"),
        ({"env": {"NCCL_DEBUG": True}}, {}, "cluster.env.NCCL_DEBUG: expected a string or integer"),
        ({"leader": "x"}, {}, "cluster.leader: unknown key"),
        ({}, {"plan": {"nodes": 3}}, "plan.nodes: 3, but cluster.addresses lists 2 nodes"),
    ],
)
def test_bad_cluster_values_name_the_key(cluster: dict, extra: dict, fragment: str):
    data = _cluster_config(**{k: v for k, v in cluster.items() if k != "node_rank"}) | extra
    if "node_rank" in cluster:
        data["cluster"]["node_rank"] = cluster["node_rank"]
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert fragment in str(caught.value)


def test_leader_runs_the_api_server_and_a_follower_runs_headless():
    planned = ["vllm", "serve", "/m/kimi", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
    rendezvous = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    leader = launcher.engine_argv(planned, "py", 30, parse_config(_cluster_config(0)).cluster)
    assert leader[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/kimi"]
    assert leader[-8:] == [*rendezvous[:2], "--node-rank", "0", *rendezvous[2:]]
    follower = launcher.engine_argv(planned, "py", 30, parse_config(_cluster_config(1)).cluster)
    assert follower[:5] == ["py", "-m", "kimi_service.vllm_cli", "serve", "/m/kimi"]
    assert follower[-9:] == [*rendezvous[:2], "--node-rank", "1", *rendezvous[2:], "--headless"]


def test_each_node_advertises_its_own_address_on_the_interface_that_holds_it():
    cluster = parse_config(_cluster_config(1, env={"NCCL_SOCKET_IFNAME": "ib0"})).cluster
    env = launcher.cluster_env(cluster, {"lo": "127.0.0.1", "eth1": "10.0.0.2"})
    assert env["VLLM_HOST_IP"] == "10.0.0.2" and env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["NCCL_SOCKET_IFNAME"] == "ib0", "the operator's interface wins"
    with pytest.raises(ConfigError, match=r"cluster.addresses\[1\]: 10.0.0.2 is not an address of this host"):
        launcher.cluster_env(cluster, {"lo": "127.0.0.1", "eth0": "10.0.0.1"})


def test_this_hosts_interfaces_are_read_from_the_kernel():
    assert "127.0.0.1" in launcher.interface_addresses().values()


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def _tables() -> list[str]:
    return [Path("/proc/net/tcp").read_text(), Path("/proc/net/tcp6").read_text()]


def test_joining_is_seen_as_an_established_connection_to_the_rendezvous():
    with _listener() as server:
        port = server.getsockname()[1]
        assert not launcher.connected_to(_tables(), "127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port)):
            assert launcher.connected_to(_tables(), "127.0.0.1", port)
            assert not launcher.connected_to(_tables(), "127.0.0.2", port)


def test_the_leader_watches_its_followers_health_and_instance():
    port = free_port()
    # The follower is this host (127.0.0.1); the leader's own address is never probed.
    cluster = parse_config({**BASE, "api": {"host": "127.0.0.1", "port": port},
                            "cluster": {"node_rank": 1, "addresses": ["127.0.0.2", "127.0.0.1"]}}).cluster
    status = launcher.FollowerStatus(cluster)
    watch = launcher.FollowerWatch(cluster, port, timeout=2)
    with httpx.Client() as client:
        assert watch.waiting_for(client) == ["node 1 (127.0.0.1): not answering (ConnectError)"]
        server = launcher.status_server("127.0.0.1", port, "/health", status.document, "no API")
        try:
            assert watch.waiting_for(client) == ["node 1 (127.0.0.1): engine not started (HTTP 503)"]
            status.engine_pid = 4242
            assert watch.waiting_for(client) == []
            watch.check(client)
            assert client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404
            status.engine_exit = "vLLM exited with status 1"
            for _ in range(launcher.FOLLOWER_MISSES - 1):
                watch.check(client)  # a blip is forgiven
            with pytest.raises(launcher.EngineFailed, match=r"follower node 1 \(127.0.0.1\) is down: engine vLLM "
                               r"exited with status 1 \(HTTP 503\)"):
                watch.check(client)
            status.engine_exit = None
            status.instance = "another"
            with pytest.raises(launcher.EngineFailed, match="restarted"):
                watch.check(client)
        finally:
            server.shutdown()
            server.server_close()
