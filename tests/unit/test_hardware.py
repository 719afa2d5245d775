"""GPU specs and NVML discovery -> GpuInventory."""

from __future__ import annotations

import types

import pytest

from kimi_service import hardware
from kimi_service.errors import KimiError, UsageError
from kimi_service.hardware import GIB, GpuInventory, parse_gpu_spec


@pytest.mark.parametrize(
    ("spec", "name", "count", "memory_gib"),
    [
        ("A100-SXM4-80GB:4", "A100-SXM4-80GB", 4, 80.0),
        ("8xH200", "H200", 8, 143771 / 1024),
        ("8 x h200", "H200", 8, 143771 / 1024),
        ("L40S:2:48GiB", "L40S", 2, 48.0),
        ("NVIDIA H100 80GB HBM3:8", "H100-SXM", 8, 81559 / 1024),
        ("A10:1", "A10", 1, 23028 / 1024),
    ],
)
def test_specs_parse(spec, name, count, memory_gib):
    gpus = parse_gpu_spec(spec)
    assert (gpus.name, gpus.count) == (name, count)
    assert gpus.memory_bytes / GIB == pytest.approx(memory_gib)


def test_fp8_and_interconnect_follow_the_table():
    assert parse_gpu_spec("H200:8").fp8 and parse_gpu_spec("L40S:1").fp8 and parse_gpu_spec("RTX-4090:1").fp8
    assert not parse_gpu_spec("A100-SXM4-80GB:8").fp8 and not parse_gpu_spec("A10:1").fp8
    assert parse_gpu_spec("A100-SXM4-80GB:8").nvswitch
    assert not parse_gpu_spec("A100-PCIE-80GB:4").nvlink
    # One GPU has nothing to link to.
    assert not parse_gpu_spec("H200:1").nvlink


def test_issue_table_is_covered():
    for name in (
        "A100-PCIE-40GB",
        "A100-SXM4-40GB",
        "A100-PCIE-80GB",
        "A100-SXM4-80GB",
        "H100-PCIE",
        "H100-SXM",
        "H200",
        "H20",
        "L40S",
        "L4",
        "A10",
        "RTX-4090",
        "B200",
    ):
        assert hardware.known_gpu(name) is not None, name


def test_cpu_spec():
    gpus = parse_gpu_spec("cpu:64GiB")
    assert gpus.is_cpu and gpus.count == 0 and gpus.host_memory_bytes == 64 * GIB


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty"),
        ("A100-SXM4-80GB", "cannot read"),
        ("A100-SXM4-80GB:0", "positive whole number"),
        ("A100-SXM4-80GB:four", "positive whole number"),
        ("TPUv5:4", "unknown GPU"),
        ("L40S:2:lots", "memory size"),
        ("A100:1:2:3", "cannot read"),
    ],
)
def test_bad_specs_say_what_to_write(spec, fragment):
    with pytest.raises(UsageError, match=fragment) as info:
        parse_gpu_spec(spec)
    assert "e.g." in str(info.value) or "write it like" in str(info.value)


def test_unknown_gpu_with_memory_is_planned_cautiously():
    gpus = parse_gpu_spec("MI300X:8:192GiB")
    assert gpus.memory_bytes == 192 * GIB and not gpus.fp8 and not gpus.nvlink


def test_host_memory_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24605120 kB\nMemFree:  1 kB\n")
    no_numa = tmp_path / "no-nodes"
    assert hardware.host_memory_bytes(meminfo, no_numa) == 24605120 * 1024
    assert hardware.host_memory_bytes(tmp_path / "absent", no_numa) is None


def test_host_memory_is_limited_by_the_smallest_numa_node(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24605120 kB\n")
    for node, kib in (("node0", 17786616), ("node1", 6000000)):
        (tmp_path / "nodes" / node).mkdir(parents=True)
        (tmp_path / "nodes" / node / "meminfo").write_text(f"Node {node[-1]} MemTotal:       {kib} kB\n")
    assert hardware.host_memory_bytes(meminfo, tmp_path / "nodes") == 6000000 * 1024


# NVML can't run without a GPU here: a stand-in module with pynvml's names, the only test double.
class _NvmlError(Exception):
    pass


def _fake_nvml(names, memory_mib=143771, cc=(9, 0), nvlink=True, init_fails=False):
    calls = {"shutdown": 0}

    def init():
        if init_fails:
            raise _NvmlError("NVML_ERROR_LIBRARY_NOT_FOUND")

    def nvlink_state(handle, link):
        if not nvlink:
            raise _NvmlError("NotSupported")
        return 1

    def shutdown():
        calls["shutdown"] += 1

    module = types.SimpleNamespace(
        NVMLError=_NvmlError,
        NVML_NVLINK_MAX_LINKS=18,
        NVML_FEATURE_ENABLED=1,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(names),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h].encode(),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=memory_mib * 2**20),
        nvmlDeviceGetCudaComputeCapability=lambda h: cc,
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlSystemGetDriverVersion=lambda: "580.159.04",
    )
    return module, calls


def test_discover_h200_board():
    nvml, calls = _fake_nvml(["NVIDIA H200"] * 8)
    gpus = hardware.discover_gpus(nvml)
    assert (gpus.name, gpus.count, gpus.compute_capability, gpus.fp8) == ("H200", 8, (9, 0), True)
    assert gpus.memory_bytes == 143771 * 2**20
    assert gpus.nvlink and gpus.nvswitch and gpus.driver_version == "580.159.04"
    assert calls["shutdown"] == 1


def test_discover_treats_nvlink_not_supported_as_absent():
    nvml, _ = _fake_nvml(["NVIDIA H200"] * 2, nvlink=False)
    gpus = hardware.discover_gpus(nvml)
    assert not gpus.nvlink and not gpus.nvswitch


def test_discover_without_gpu_or_driver_plans_for_cpu():
    nvml, _ = _fake_nvml([])
    assert hardware.discover_gpus(nvml).is_cpu
    broken, _ = _fake_nvml(["NVIDIA H200"], init_fails=True)
    assert hardware.discover_gpus(broken) == GpuInventory.cpu(hardware.host_memory_bytes())


def test_discover_refuses_mixed_gpus():
    nvml, calls = _fake_nvml(["NVIDIA H200", "NVIDIA L40S"])
    with pytest.raises(KimiError, match="CUDA_VISIBLE_DEVICES"):
        hardware.discover_gpus(nvml)
    assert calls["shutdown"] == 1


def test_discover_on_this_machine_has_no_gpu():
    # The real pynvml here finds no driver: the CPU inventory, with this host's RAM.
    gpus = hardware.discover_gpus()
    assert gpus.is_cpu and (gpus.host_memory_bytes or 0) > GIB
