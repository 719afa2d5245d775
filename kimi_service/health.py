"""`kimi-service health`: is the endpoint alive, ready and answering, and are the GPUs sound?

Every check yields a status (ok, degraded, down, skipped), a value and a message. The worst status
decides the exit code: 0 healthy, 1 degraded, 2 down.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from kimi_service import nvml as nvml_reader
from kimi_service.credentials import bearer
from kimi_service.http_client import client_for
from kimi_service.untrusted import UntrustedInput, loads_json

OK, DEGRADED, DOWN, SKIPPED = "ok", "degraded", "down", "skipped"
_RANK = {SKIPPED: 0, OK: 0, DEGRADED: 1, DOWN: 2}
EXIT_CODES = {OK: 0, DEGRADED: 1, DOWN: 2}
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus."
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)")
KERNEL_LOG = Path("/dev/kmsg")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    value: Any
    message: str


@dataclass(frozen=True)
class HealthReport:
    checks: tuple[Check, ...]

    @property
    def status(self) -> str:
        worst = max((_RANK[c.status] for c in self.checks), default=0)
        return {0: OK, 1: DEGRADED, 2: DOWN}[worst]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "checks": [asdict(c) for c in self.checks]}

    def to_text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"{c.name:<{width}}  {c.status:<8}  {c.message}" for c in self.checks]
        return "\n".join([*lines, f"overall: {self.status}"])

    def to_line(self) -> str:
        """One log line: the verdict, each check's status, and the messages of those not ok."""
        parts = [f"{c.name}={c.status}" for c in self.checks]
        notes = [f"{c.name}: {c.message}" for c in self.checks if c.status in (DEGRADED, DOWN)]
        return " ".join([f"health {self.status}:", *parts]) + ("; " + "; ".join(notes) if notes else "")


@dataclass(frozen=True)
class Target:
    """The endpoint to probe; the API key comes from the environment, never from argv."""

    url: str
    served_name: str | None
    api_key: str | None = None
    timeout: float = 10.0
    smoke: bool = True
    smoke_max_tokens: int = 4
    # A follower node of a cluster runs vLLM headless: its /health says whether its engine runs; the
    # model is listed and answers on the leader only.
    follower: bool = False

    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)


def check_liveness(client: httpx.Client, target: Target) -> Check:
    try:
        response = client.get(f"{target.url}/health", timeout=target.timeout)
    except httpx.HTTPError as exc:
        return Check("liveness", DOWN, None, f"{target.url}/health unreachable: {exc}")
    if response.status_code != 200:
        return Check("liveness", DOWN, response.status_code, f"/health answered {response.status_code}")
    return Check("liveness", OK, 200, "/health answered 200")


def check_readiness(client: httpx.Client, target: Target) -> Check:
    try:
        response = client.get(f"{target.url}/v1/models", headers=target.headers(), timeout=target.timeout)
    except httpx.HTTPError as exc:
        return Check("readiness", DOWN, None, f"/v1/models unreachable: {exc}")
    if response.status_code == 401:
        return Check("readiness", DEGRADED, 401,
                     "/v1/models answered 401: without the server's key; run as root (secrets.env beside "
                     "--config is read), or set VLLM_API_KEY, or pass --env-file")
    if response.status_code != 200:
        return Check("readiness", DEGRADED, response.status_code, f"/v1/models answered {response.status_code}")
    names = _model_ids(response)
    if names is None:
        return Check("readiness", DEGRADED, 200, f"/v1/models answered 200 but not with an OpenAI model list: "
                     f"{_excerpt(response)}")
    if not names:
        return Check("readiness", DEGRADED, names, "/v1/models lists no model")
    if target.served_name and target.served_name not in names:
        return Check("readiness", DEGRADED, names,
                     f"/v1/models lists {names}, not the served name {target.served_name!r}")
    return Check("readiness", OK, names, f"serving {', '.join(map(str, names))}")


@dataclass(frozen=True)
class SmokeResult:
    """One chat completion: whether it answered, how fast, and the start of the reply."""

    ok: bool
    url: str
    model: str
    status_code: int | None
    latency_s: float | None
    reply: str | None
    completion_tokens: int | None
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        if not self.ok:
            return f"smoke failed: {self.error}"
        return f"smoke ok: {self.model} answered in {self.latency_s:.3f} s: {self.reply!r}"


def smoke_completion(client: httpx.Client, target: Target, model: str) -> SmokeResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": target.smoke_max_tokens,
        "temperature": 0,
    }
    started = time.monotonic()
    try:
        response = client.post(f"{target.url}/v1/chat/completions", json=body, headers=target.headers(),
                               timeout=target.timeout)
    except httpx.HTTPError as exc:
        return SmokeResult(False, target.url, model, None, None, None, None, f"chat completion failed: {exc}")
    latency = round(time.monotonic() - started, 4)
    if response.status_code != 200 or not _has_choices(response):
        return SmokeResult(False, target.url, model, response.status_code, latency, None, None,
                           f"chat completion answered {response.status_code}: {_excerpt(response)}")
    answer = _json(response)
    message = answer["choices"][0].get("message") if isinstance(answer["choices"][0], dict) else None
    reply = message.get("content") if isinstance(message, dict) else None
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return SmokeResult(True, target.url, model, 200, latency, str(reply or "")[:200],
                       tokens if isinstance(tokens, int) else None, None)


def check_smoke(client: httpx.Client, target: Target, model: str) -> Check:
    result = smoke_completion(client, target, model)
    if not result.ok:
        return Check("smoke", DEGRADED, None, str(result.error))
    return Check("smoke", OK, result.latency_s, f"chat completion in {result.latency_s:.3f} s")


def _json(response: httpx.Response) -> Any:
    try:
        return loads_json(response.content, response.request.url.path)
    except UntrustedInput:  # not JSON, not UTF-8, nested too deep, or numbers JSON lacks
        return None


def _model_ids(response: httpx.Response) -> list[Any] | None:
    """The ids of /v1/models' `data` list; None when the body is not that shape."""
    body = _json(response)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        return None
    return [m.get("id") for m in data]


def _has_choices(response: httpx.Response) -> bool:
    body = _json(response)
    return isinstance(body, dict) and isinstance(body.get("choices"), list) and bool(body["choices"])


def _excerpt(response: httpx.Response) -> str:
    """The start of a body for a message: one line, printable."""
    text = response.content[:200].decode("utf-8", errors="replace")
    return repr(text) if text else "an empty body"


def probe_endpoint(target: Target, client: httpx.Client | None = None) -> list[Check]:
    own = client is None
    client = client or client_for(target.url)
    try:
        checks = [check_liveness(client, target)]
        if checks[0].status == DOWN or target.follower:
            return checks
        ready = check_readiness(client, target)
        checks.append(ready)
        if target.smoke and ready.status == OK:
            model = target.served_name or ready.value[0]
            checks.append(check_smoke(client, target, model))
        return checks
    finally:
        if own:
            client.close()


def parse_xids(lines: Iterable[str]) -> dict[tuple[str, int], int]:
    """Count XID reports per (PCI address, code) in kernel log lines."""
    counts: dict[tuple[str, int], int] = {}
    for line in lines:
        match = _XID_LINE.search(line)
        if match:
            key = (match["pci"].lower(), int(match["xid"]))
            counts[key] = counts.get(key, 0) + 1
    return counts


def read_kernel_log() -> list[str] | None:
    """Kernel messages of this boot, from the journal (readable to the systemd-journal group, which
    the health unit joins) or else /dev/kmsg; None when neither is readable."""
    journalctl = shutil.which("journalctl")
    if journalctl:
        result = subprocess.run([journalctl, "-k", "-b", "-o", "cat", "--no-pager", "-q"],
                                capture_output=True, text=True, timeout=30, check=False)
        if result.returncode == 0 and result.stdout:
            return result.stdout.splitlines()
    try:
        return _read_kmsg(KERNEL_LOG)
    except OSError:
        return None


def _read_kmsg(path: Path) -> list[str]:
    # /dev/kmsg never ends: read records until the next read would block.
    lines: list[str] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # a record was overwritten while reading; the next read resumes
            if not record:
                break
            lines.append(record.decode(errors="replace"))
    finally:
        os.close(fd)
    return lines


def check_xids(kernel_log: Sequence[str] | None) -> Check:
    if kernel_log is None:
        return Check("gpu_xid", SKIPPED, None,
                     "kernel log unreadable: run as root or in the systemd-journal group")
    counts = parse_xids(kernel_log)
    if not counts:
        return Check("gpu_xid", OK, {}, "no XID errors since boot")
    value = {f"{pci} xid {xid}": n for (pci, xid), n in sorted(counts.items())}
    return Check("gpu_xid", DEGRADED, value,
                 "XID errors since boot: " + ", ".join(f"{k} ({n}x)" for k, n in value.items()))


def gpu_checks(snapshot: nvml_reader.GpuSnapshot) -> list[Check]:
    """Pure: the verdicts on one NVML reading."""
    checks = [Check("nvml", OK, snapshot.driver_version,
                    f"NVML answers: driver {snapshot.driver_version}, {len(snapshot.gpus)} GPU(s)")]
    for gpu in snapshot.gpus:
        v = gpu.values
        prefix = f"gpu{gpu.index}"
        if "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in v:
            dbe = int(v["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"])
            checks.append(Check(f"{prefix}_ecc_uncorrectable", DEGRADED if dbe else OK, dbe,
                                f"{dbe} uncorrectable ECC errors since the driver loaded"))
        if "DCGM_FI_DEV_ROW_REMAP_FAILURE" in v:
            failed = bool(v["DCGM_FI_DEV_ROW_REMAP_FAILURE"])
            pending = bool(v.get("DCGM_FI_DEV_ROW_REMAP_PENDING", 0))
            if failed:
                status, message = DEGRADED, "row remapping failed: the GPU needs service (RMA)"
            elif pending:
                status, message = DEGRADED, "row remapping pending: reset the GPU or reboot to apply it"
            else:
                status, message = OK, "no row-remap failure"
            checks.append(Check(f"{prefix}_row_remap", status, {"failure": failed, "pending": pending}, message))
        if "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in v:
            reasons = nvml_reader.throttle_reasons(int(v["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]))
            checks.append(Check(f"{prefix}_throttle", DEGRADED if reasons else OK, reasons,
                                "throttled: " + ", ".join(reasons) if reasons else "no thermal/power throttling"))
    return checks


def nvml_failure(exc: nvml_reader.NvmlUnavailable, expect_gpus: bool) -> Check:
    if exc.kind == "missing" and not expect_gpus:
        return Check("nvml", SKIPPED, None, f"{exc} (CPU engine)")
    return Check("nvml", DOWN if exc.kind == "missing" else DEGRADED, exc.kind, str(exc))


def check_gpus(nvml_module: ModuleType | None = None, expect_gpus: bool = False) -> list[Check]:
    """NVML checks; a host without NVIDIA driver is fine unless GPUs are expected."""
    try:
        session = nvml_reader.open_nvml(nvml_module)
        snapshot = nvml_reader.sample(session)
    except nvml_reader.NvmlUnavailable as exc:
        return [nvml_failure(exc, expect_gpus)]
    return [*gpu_checks(snapshot), check_xids(read_kernel_log())]


def run_health(target: Target, *, gpus: bool = True, expect_gpus: bool = False,
               nvml_module: ModuleType | None = None) -> HealthReport:
    checks = probe_endpoint(target)
    if gpus:
        checks.extend(check_gpus(nvml_module, expect_gpus))
    return HealthReport(tuple(checks))


def served_model(client: httpx.Client, target: Target) -> str | None:
    """The first model /v1/models lists, for a smoke test told no name."""
    try:
        response = client.get(f"{target.url}/v1/models", headers=target.headers(), timeout=target.timeout)
        names = _model_ids(response) if response.status_code == 200 else []
    except httpx.HTTPError:
        return None
    return names[0] if names else None


def wait_for_health(target: Target, wait: float, **kwargs: Any) -> HealthReport:
    """Probe until healthy or `wait` seconds pass; the last report stands."""
    deadline = time.monotonic() + wait
    while True:
        report = run_health(target, **kwargs)
        if report.status == OK or time.monotonic() >= deadline:
            return report
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
