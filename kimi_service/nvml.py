"""Reads GPU state through NVML (the `pynvml` module of nvidia-ml-py) for health and the exporter.

Values are keyed by dcgm-exporter's field names and units, so one reading serves both the
Prometheus series and the health checks. A field the board reports as NotSupported is absent.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kimi_service.errors import KimiError

# NVML return codes (nvml.h); compared by value so any pynvml version's classes match.
ERROR_NOT_SUPPORTED = 3
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_LIB_RM_VERSION_MISMATCH = 18

# Clock-event reason bits (nvml.h nvmlClocksEventReason*) that mean the GPU is held back by
# heat or a power emergency rather than by its normal power cap or idling.
THROTTLE_BITS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}


class NvmlUnavailable(KimiError):
    """NVML cannot be used; `kind` is missing (no driver/library), mismatch or error."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int | None
    values: dict[str, float] = field(default_factory=dict)
    # Fields that failed with something other than NotSupported: "FIELD: error".
    errors: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True)
class GpuSnapshot:
    driver_version: str
    gpus: tuple[GpuSample, ...]


def _code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def describe_failure(exc: BaseException) -> NvmlUnavailable:
    """Name what is wrong with NVML and what fixes it."""
    code = _code(exc)
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError) or code in (ERROR_LIBRARY_NOT_FOUND, ERROR_DRIVER_NOT_LOADED):
        return NvmlUnavailable("missing", f"NVML unavailable: {text} (no NVIDIA driver loaded on this host)")
    if code == ERROR_LIB_RM_VERSION_MISMATCH:
        return NvmlUnavailable(
            "mismatch",
            "NVML: Driver/library version mismatch: the loaded nvidia kernel module differs from the "
            "installed user-space driver (usually after a driver upgrade); reboot the host or reload "
            "the nvidia modules",
        )
    return NvmlUnavailable("error", f"NVML error: {text}")


def open_nvml(module: ModuleType | None = None) -> ModuleType:
    """Import and initialise pynvml (or the given stand-in); raise NvmlUnavailable with the reason."""
    try:
        nvml = module or importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:
        raise describe_failure(exc) from None
    return nvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_fields(nvml: ModuleType, handle: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(dcgm field name, reader in dcgm units) for every series we publish."""
    # Renamed in newer NVML; older bindings only have the throttle spelling.
    clocks_reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                      or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    unc = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    cor = nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    mem = [None]

    def memory() -> Any:
        if mem[0] is None:
            mem[0] = nvml.nvmlDeviceGetMemoryInfo(handle)
        return mem[0]

    def remap(i: int) -> Callable[[], Any]:
        return lambda: nvml.nvmlDeviceGetRemappedRows(handle)[i]

    mib = 1024 * 1024
    return [
        ("DCGM_FI_DEV_GPU_UTIL", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory),
        ("DCGM_FI_DEV_FB_USED", lambda: memory().used / mib),
        ("DCGM_FI_DEV_FB_FREE", lambda: memory().free / mib),
        ("DCGM_FI_DEV_FB_TOTAL", lambda: memory().total / mib),
        ("DCGM_FI_DEV_GPU_TEMP", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        ("DCGM_FI_DEV_POWER_USAGE", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT", lambda: nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
        ("DCGM_FI_DEV_SM_CLOCK", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        ("DCGM_FI_DEV_MEM_CLOCK", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", lambda: clocks_reasons(handle)),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle)),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
         lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, cor, nvml.NVML_VOLATILE_ECC)),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
         lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, unc, nvml.NVML_VOLATILE_ECC)),
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
         lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, cor, nvml.NVML_AGGREGATE_ECC)),
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
         lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, unc, nvml.NVML_AGGREGATE_ECC)),
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", remap(0)),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", remap(1)),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", remap(2)),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", remap(3)),
    ]


def _sample_gpu(nvml: ModuleType, index: int) -> GpuSample:
    started = time.monotonic()
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    values: dict[str, float] = {}
    errors: list[str] = []
    for name, read in _read_fields(nvml, handle):
        try:
            values[name] = float(read())
        except Exception as exc:
            if _code(exc) != ERROR_NOT_SUPPORTED:
                errors.append(f"{name}: {exc}")
    try:
        minor: int | None = int(nvml.nvmlDeviceGetMinorNumber(handle))
    except Exception:
        minor = None
    return GpuSample(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        minor=minor,
        values=values,
        errors=tuple(errors),
        seconds=time.monotonic() - started,
    )


def sample(nvml: ModuleType) -> GpuSnapshot:
    """One consistent reading of every GPU; raises NvmlUnavailable if NVML itself fails."""
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        gpus = tuple(_sample_gpu(nvml, i) for i in range(count))
    except NvmlUnavailable:
        raise
    except Exception as exc:
        raise describe_failure(exc) from None
    return GpuSnapshot(driver_version=driver, gpus=gpus)


def throttle_reasons(mask: int) -> list[str]:
    return [text for bit, text in THROTTLE_BITS.items() if mask & bit]
