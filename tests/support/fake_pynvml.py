"""A stand-in for the `pynvml` module at the NVML boundary (the CI machines have no GPU).

It implements the calls kimi_service makes, with per-GPU values, NotSupported fields, init errors
(missing library, Driver/library version mismatch) and an XID event queue. The same code paths run
against the real NVML in scripts/gpu/validate_nvml.sh.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value: int, text: str):
        super().__init__(text)
        self.value = value


NOT_SUPPORTED = NVMLError(3, "Not Supported")


class FakeNvml:
    """The subset of pynvml the exporter calls, with per-GPU values and injectable failures."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: int = 2, init_error: NVMLError | None = None):
        self.init_error = init_error
        self.gpus = [
            {"name": "NVIDIA H200", "uuid": f"GPU-0000000{i}-aaaa", "bus": f"00000000:{0x18 + i:02X}:00.0",
             "used": (10_000 + i) * MIB, "free": 133_771 * MIB, "util": 40 + i, "mem_util": 7, "temp": 35 + i,
             "power_mw": 120_500, "limit_mw": 700_000, "energy": 123_456_789, "sm": 1980, "mem": 3201,
             "reasons": 0, "replay": 0, "ecc": {(0, 0): 2, (1, 0): 0, (0, 1): 5, (1, 1): 0},
             "remap": (0, 0, False, False), "unsupported": set()} for i in range(gpus)
        ]
        self.events: queue.Queue[SimpleNamespace] = queue.Queue()

    def _gpu(self, handle: int, field: str):
        gpu = self.gpus[handle]
        if field in gpu["unsupported"]:
            raise NOT_SUPPORTED
        if isinstance(gpu.get(field), Exception):
            raise gpu[field]
        return gpu[field]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.gpus[h]["name"].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h]["uuid"]

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.gpus[h]["bus"].encode())

    def nvmlDeviceGetMinorNumber(self, h: int) -> int:
        return h

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        used, free = self._gpu(h, "used"), self._gpu(h, "free")
        return SimpleNamespace(used=used, free=free, total=used + free)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._gpu(h, "util"), memory=self._gpu(h, "mem_util"))

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._gpu(h, "temp")

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "power_mw")

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self._gpu(h, "limit_mw")

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "energy")

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return self._gpu(h, "sm" if clock == self.NVML_CLOCK_SM else "mem")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu(h, "reasons")

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._gpu(h, "replay")

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return self._gpu(h, "ecc")[(kind, counter)]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, bool, bool]:
        return self._gpu(h, "remap")

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, kinds: int, events: str) -> None:
        if "events" in self.gpus[h]["unsupported"]:
            raise NOT_SUPPORTED

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> SimpleNamespace:
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(10, "Timeout") from None

    def xid(self, gpu: int, code: int) -> None:
        self.events.put(SimpleNamespace(device=gpu, eventType=8, eventData=code))
