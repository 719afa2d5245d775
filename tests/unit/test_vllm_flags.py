"""Every flag the planner and the launcher emit is an option of the pinned vLLM's `vllm serve` (0.21.0).

engine_flags.vllm_flags() reads the list scripts/vllm_flags.py wrote from the vLLM wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_service import catalog, launcher
from kimi_service.config import parse_config
from kimi_service.engine_flags import vllm_flags
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import inspect_model, spec_from_catalog
from kimi_service.planner import DoesNotFit, plan
from kimi_service.planner.overrides import _ALIASES
from kimi_service.workloads import WORKLOADS

KNOWN = vllm_flags()
RENTALS = [("8xH200", 1), ("H100-SXM:8", 2), ("A100-SXM4-80GB:8", 2), ("A100-SXM4-80GB:4", 1), ("L40S:2", 1),
           ("H200:1", 1)]
CHECKPOINTS = sorted(p for p in Path("tests/fixtures/models").iterdir() if (p / "config.json").is_file())


def _flags(argv: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}


def test_the_flag_list_is_vllms_and_knows_the_data_parallel_launch():
    assert len(KNOWN) > 200
    assert {"--data-parallel-size", "--data-parallel-size-local", "--data-parallel-address",
            "--data-parallel-rpc-port", "--data-parallel-start-rank", "--enable-expert-parallel", "--headless",
            "--kv-cache-dtype"} <= KNOWN
    assert "--data-parallel" not in KNOWN and "--expert-parallel" not in KNOWN


def _plans(spec):
    for gpus, nodes in RENTALS:
        for workload in WORKLOADS:
            try:
                yield plan(spec, parse_gpu_spec(gpus), nodes=nodes, workload=workload)
            except DoesNotFit:
                continue


@pytest.mark.parametrize("spec", [*(spec_from_catalog(e) for e in catalog.ENTRIES),
                                  *(inspect_model(str(p)) for p in CHECKPOINTS)], ids=lambda s: s.name)
def test_every_planned_flag_is_a_vllm_serve_option(spec):
    emitted = set()
    for result in _plans(spec):
        emitted |= _flags(result.argv)
    assert emitted, f"{spec.name} fits none of the rentals"
    assert emitted <= KNOWN, f"not options of vLLM 0.21.0: {sorted(emitted - KNOWN)}"


def test_the_dp_ep_plan_and_both_cluster_launches_use_only_vllm_options():
    kimi = spec_from_catalog(catalog.get("moonshotai/Kimi-K2.5"))
    emitted = set()
    for result, local in ((plan(kimi, parse_gpu_spec("H200:8"), nodes=2,
                                          overrides=["--data-parallel-size", "16"]), 8),
                          (plan(kimi, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2, workload="latency"), 0)):
        for rank in (0, 1):
            cluster = parse_config({"model": {"path": "/m"}, "cluster": {
                "node_rank": rank, "addresses": ["10.0.0.1", "10.0.0.2"]}}).cluster
            emitted |= _flags(launcher.engine_argv(result.argv, "py", 30, cluster, data_parallel_local=local)[3:])
    assert {"--data-parallel-start-rank", "--headless", "--nnodes", "--enable-expert-parallel"} <= emitted
    assert emitted <= KNOWN, sorted(emitted - KNOWN)


def test_override_aliases_name_vllm_options():
    assert set(_ALIASES.values()) <= KNOWN
