"""What GPUs a host has: from NVML on a real host, or from a `--gpus` spec for planning ahead.

Both paths produce the same `GpuInventory`, so the planner never knows which one it got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from kimi_service.errors import KimiError, UsageError

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class GpuModel:
    """One entry of the table of known GPUs (memory as NVML reports it, per GPU)."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    nvlink: bool
    nvswitch: bool
    aliases: tuple[str, ...] = ()
    # PCI device ids (vendor 10de) of the board, as sysfs writes them: what a host without a driver shows.
    pci_ids: tuple[str, ...] = ()

    @property
    def fp8(self) -> bool:
        return supports_fp8(self.compute_capability)


def supports_fp8(compute_capability: tuple[int, int]) -> bool:
    # FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0); Ampere (8.0, 8.6) has none.
    return compute_capability >= (8, 9)


# The one table of GPUs: the planner reads it, and preflight reads its PCI ids through `kimi-service gpus`
# to name the boards of a host that has no driver yet. Memory is the total NVML reports for each board,
# not the marketing number: the planner's budget starts from what vLLM will see. nvswitch marks boards
# sold in 8-GPU NVSwitch baseboards; NVL and A40 boards link in bridged pairs only, so the planner treats
# them as PCIe (nvlink=False), the cautious choice. PCI ids from the PCI ID repository (pci-ids.ucw.cz).
KNOWN_GPUS: tuple[GpuModel, ...] = (
    GpuModel("A100-PCIE-40GB", 40960 * MIB, (8, 0), nvlink=False, nvswitch=False, pci_ids=("0x20f1",)),
    GpuModel("A100-SXM4-40GB", 40960 * MIB, (8, 0), nvlink=True, nvswitch=True, pci_ids=("0x20b0",)),
    GpuModel(
        "A100-PCIE-80GB", 81920 * MIB, (8, 0), nvlink=False, nvswitch=False, aliases=("A100-80GB-PCIE",),
        pci_ids=("0x20b5",),
    ),
    GpuModel(
        "A100-SXM4-80GB", 81920 * MIB, (8, 0), nvlink=True, nvswitch=True, aliases=("A100-80GB", "A100"),
        pci_ids=("0x20b2",),
    ),
    GpuModel(
        "H100-PCIE", 81559 * MIB, (9, 0), nvlink=False, nvswitch=False, aliases=("H100-PCIE-80GB",),
        pci_ids=("0x2331",),
    ),
    GpuModel(
        "H100-SXM",
        81559 * MIB,
        (9, 0),
        nvlink=True,
        nvswitch=True,
        aliases=("H100-80GB-HBM3", "H100-SXM5", "H100-SXM5-80GB", "H100"),
        pci_ids=("0x2330",),
    ),
    GpuModel("H100-NVL", 95830 * MIB, (9, 0), nvlink=False, nvswitch=False, pci_ids=("0x2321",)),
    GpuModel(
        "H200", 143771 * MIB, (9, 0), nvlink=True, nvswitch=True, aliases=("H200-SXM", "H200-141GB"),
        pci_ids=("0x2335",),
    ),
    GpuModel("H200-NVL", 143771 * MIB, (9, 0), nvlink=False, nvswitch=False, pci_ids=("0x233b",)),
    GpuModel("H20", 97871 * MIB, (9, 0), nvlink=True, nvswitch=True),
    GpuModel("L40S", 46068 * MIB, (8, 9), nvlink=False, nvswitch=False, pci_ids=("0x26b9",)),
    GpuModel("L40", 46068 * MIB, (8, 9), nvlink=False, nvswitch=False, pci_ids=("0x26b5",)),
    GpuModel("L4", 23034 * MIB, (8, 9), nvlink=False, nvswitch=False, pci_ids=("0x27b8",)),
    GpuModel("A10", 23028 * MIB, (8, 6), nvlink=False, nvswitch=False, pci_ids=("0x2236",)),
    GpuModel("A10G", 23028 * MIB, (8, 6), nvlink=False, nvswitch=False, pci_ids=("0x2237",)),
    GpuModel("A40", 46068 * MIB, (8, 6), nvlink=False, nvswitch=False, pci_ids=("0x2235",)),
    GpuModel(
        "RTX-4090", 24564 * MIB, (8, 9), nvlink=False, nvswitch=False, aliases=("GEFORCE-RTX-4090", "4090"),
        pci_ids=("0x2684",),
    ),
    GpuModel(
        "RTX-3090", 24576 * MIB, (8, 6), nvlink=False, nvswitch=False, aliases=("GEFORCE-RTX-3090", "3090"),
        pci_ids=("0x2204",),
    ),
    GpuModel("B200", 183359 * MIB, (10, 0), nvlink=True, nvswitch=True, pci_ids=("0x2901",)),
)


def _normalise(name: str) -> str:
    name = name.strip().upper().replace("_", "-").replace(" ", "-")
    return re.sub(r"^NVIDIA-", "", name)


_BY_NAME: dict[str, GpuModel] = {
    _normalise(alias): gpu for gpu in KNOWN_GPUS for alias in (gpu.name, *gpu.aliases)
}


def known_gpu(name: str) -> GpuModel | None:
    """The table entry for a GPU name as a person or NVML spells it ("NVIDIA H100 80GB HBM3"), or None."""
    return _BY_NAME.get(_normalise(name))


def gpu_table() -> list[dict[str, Any]]:
    """The table as data, for `kimi-service gpus --json` (preflight names driverless boards from it)."""
    return [
        {"name": gpu.name, "aliases": list(gpu.aliases), "pci_ids": list(gpu.pci_ids),
         "memory_mib": gpu.memory_bytes // MIB, "compute_capability": ".".join(map(str, gpu.compute_capability))}
        for gpu in KNOWN_GPUS
    ]


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs of one node; all of one kind (the planner splits work evenly across them)."""

    name: str
    count: int
    memory_bytes: int
    compute_capability: tuple[int, int]
    fp8: bool
    nvlink: bool
    nvswitch: bool
    driver_version: str | None = None
    host_memory_bytes: int | None = None
    # A board outside the table, planned from its stated memory: what the planner had to assume about it.
    assumed: str | None = None

    @classmethod
    def cpu(cls, host_memory_bytes: int | None) -> GpuInventory:
        """No GPU: plan for vLLM's CPU engine with this much host memory."""
        return cls(
            name="cpu",
            count=0,
            memory_bytes=0,
            compute_capability=(0, 0),
            fp8=False,
            nvlink=False,
            nvswitch=False,
            host_memory_bytes=host_memory_bytes,
        )

    @property
    def is_cpu(self) -> bool:
        return self.count == 0

    @property
    def total_memory_bytes(self) -> int:
        return self.count * self.memory_bytes

    def with_count(self, count: int) -> GpuInventory:
        """The same GPUs, a different number of them (for "what would fit" suggestions)."""
        return GpuInventory(
            name=self.name,
            count=count,
            memory_bytes=self.memory_bytes,
            compute_capability=self.compute_capability,
            fp8=self.fp8,
            nvlink=self.nvlink,
            nvswitch=self.nvswitch,
            driver_version=self.driver_version,
            host_memory_bytes=self.host_memory_bytes,
            assumed=self.assumed,
        )

    def describe(self) -> str:
        if self.is_cpu:
            return "CPU only"
        return f"{self.count} x {self.name}"


def inventory_of(gpu: GpuModel, count: int, memory_bytes: int | None = None) -> GpuInventory:
    return GpuInventory(
        name=gpu.name,
        count=count,
        memory_bytes=memory_bytes or gpu.memory_bytes,
        compute_capability=gpu.compute_capability,
        fp8=gpu.fp8,
        nvlink=gpu.nvlink and count > 1,
        nvswitch=gpu.nvswitch and count > 2,
    )


_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*(GIB|GB|MIB|MB|G|M)$", re.ASCII)
_MEMORY_UNITS = {"GIB": GIB, "G": GIB, "GB": 1000**3, "MIB": MIB, "M": MIB, "MB": 1000**2}


def parse_memory(text: str) -> int:
    """`48GiB`, `80GB`, `46068MiB` -> bytes. Raises UsageError."""
    match = _MEMORY.match(text.strip().upper())
    if not match:
        raise UsageError(f"cannot read the memory size {text!r}: write it like 48GiB, 80GB or 46068MiB")
    return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2)])


_SPEC_HELP = (
    "write NAME:COUNT, COUNTxNAME or NAME:COUNT:MEMORY (e.g. A100-SXM4-80GB:4, 8xH200, L40S:2:48GiB), "
    "or cpu[:MEMORY] for the CPU engine; known GPUs: " + ", ".join(gpu.name for gpu in KNOWN_GPUS)
)


def _parse_count(text: str, spec: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # int("٨") is 8
        raise UsageError(
            f"GPU count {text!r} in --gpus {spec!r} is not a positive whole number; {_SPEC_HELP}"
        )
    return int(text)


def parse_gpu_spec(spec: str) -> GpuInventory:
    """`A100-SXM4-80GB:4`, `8xH200`, `L40S:2:48GiB`, `cpu`, `cpu:64GiB` -> GpuInventory. Raises UsageError."""
    text = spec.strip()
    if not text:
        raise UsageError(f"--gpus is empty; {_SPEC_HELP}")
    parts = text.split(":")
    if parts[0].lower() == "cpu":
        if len(parts) > 2:
            raise UsageError(f"cannot read --gpus {spec!r}; {_SPEC_HELP}")
        return GpuInventory.cpu(parse_memory(parts[1]) if len(parts) == 2 else host_memory_bytes())
    count_first = re.match(r"^(\d+)\s*[xX]\s*(.+)$", parts[0], re.ASCII)
    if count_first and len(parts) <= 2:
        count, name = _parse_count(count_first.group(1), spec), count_first.group(2)
        memory_text = parts[1] if len(parts) == 2 else None
    elif 2 <= len(parts) <= 3:
        name, count = parts[0], _parse_count(parts[1], spec)
        memory_text = parts[2] if len(parts) == 3 else None
    else:
        raise UsageError(f"cannot read --gpus {spec!r}; {_SPEC_HELP}")
    memory = parse_memory(memory_text) if memory_text else None
    gpu = known_gpu(name)
    if gpu is None:
        if memory is None:
            raise UsageError(
                f"unknown GPU {name!r} in --gpus {spec!r}: give its memory (e.g. {name}:{count}:48GiB); "
                f"{_SPEC_HELP}"
            )
        # An unknown board with a stated size: plan for it as an Ampere-class part (no FP8, no NVLink),
        # the cautious choice, and say so in every plan.
        gpu = GpuModel(_normalise(name), memory, (8, 0), nvlink=False, nvswitch=False)
        return replace(inventory_of(gpu, count, memory), assumed=(
            f"{gpu.name} is not in the GPU table: planned with the {memory / GIB:,.1f} GiB given, as a PCIe card "
            "without NVLink or FP8 (BF16 weights and KV, no FP8 KV cache); its real compute capability decides "
            "which kernels vLLM runs"
        ))
    return inventory_of(gpu, count, memory)


def host_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"), nodes: Path = Path("/sys/devices/system/node")
) -> int | None:
    """Memory the CPU engine can use: MemTotal, or the smallest NUMA node's when that is less.

    vLLM's CPU engine binds to one NUMA node and sizes its KV cache from that node's memory, so on a
    multi-node host (and on VMs that report a node smaller than MemTotal) the node is the limit.
    None where there is no /proc/meminfo.
    """
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemTotal:\s+(\d+)\s+kB", text, re.MULTILINE)
    if not match:
        return None
    total = int(match.group(1)) * 1024
    node_totals = []
    for node_meminfo in sorted(nodes.glob("node[0-9]*/meminfo")):
        found = re.search(r"MemTotal:\s+(\d+)\s+kB", node_meminfo.read_text())
        if found and int(found.group(1)) > 0:
            node_totals.append(int(found.group(1)) * 1024)
    return min([total, *node_totals])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvlink_active(nvml: ModuleType, handle: Any) -> bool:
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                return True
        except nvml.NVMLError:
            # NotSupported (PCIe boards, some H200 hosts) or an invalid link index: no NVLink there.
            continue
    return False


def discover_gpus(nvml: ModuleType | None = None) -> GpuInventory:
    """The GPUs NVML sees on this host; no NVML library or no GPU -> the CPU inventory.

    `nvml` is the `pynvml` module; tests pass a stand-in because this machine has no GPU.
    """
    if nvml is None:
        try:
            # Imported late: CPU-only hosts plan without the NVML bindings.
            import pynvml as nvml
        except ImportError:
            return GpuInventory.cpu(host_memory_bytes())
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return GpuInventory.cpu(host_memory_bytes())
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return GpuInventory.cpu(host_memory_bytes())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        if len(set(names)) > 1:
            raise KimiError(
                f"this host mixes GPU models ({', '.join(sorted(set(names)))}); the planner splits work evenly "
                "and needs one kind: hide the others with CUDA_VISIBLE_DEVICES"
            )
        memory = min(int(nvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles)
        capability = tuple(int(v) for v in nvml.nvmlDeviceGetCudaComputeCapability(handles[0]))
        nvlink = count > 1 and _nvlink_active(nvml, handles[0])
        table = known_gpu(names[0])
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError as exc:
        raise KimiError(
            f"NVML failed while reading the GPUs ({exc}); check `nvidia-smi` works on this host"
        ) from exc
    finally:
        nvml.nvmlShutdown()
    cc = (capability[0], capability[1])
    return GpuInventory(
        name=table.name if table else _normalise(names[0]),
        count=count,
        memory_bytes=memory,
        compute_capability=cc,
        fp8=supports_fp8(cc),
        nvlink=nvlink,
        # NVML has no direct NVSwitch query on every driver; active NVLink on a board that only ships
        # on NVSwitch baseboards means the switch is there.
        nvswitch=nvlink and count > 2 and bool(table and table.nvswitch),
        driver_version=driver,
        host_memory_bytes=host_memory_bytes(),
    )
