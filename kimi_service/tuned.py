"""tuned.json: what `kimi-service tune` measured to win on this host, and whether it still holds.

serve reads it through the launcher; tune writes it. A winner holds only for the configuration it was
measured with: the same model, engine version, GPUs, workload, max_model_len, operator extra_args and
traffic (the key); for anything else its flags are unproven and serve leaves them out.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kimi_service import bench
from kimi_service.config import Config
from kimi_service.engine_flags import check_extra_args, option_name
from kimi_service.untrusted import UntrustedInput, read_json

TUNED_FILE = "tuned.json"
# vLLM's goodput terms (`vllm bench serve --goodput ttft:1000 tpot:100 e2el:30000`): a first token within a
# second, ten tokens a second after it, the whole answer within half a minute.
DEFAULT_SLO = "ttft=1,tpot=0.1,e2el=30"


@dataclass(frozen=True)
class Shape:
    """One kind of request: prompt tokens, output tokens, and a system prompt every request shares."""

    input_len: int
    output_len: int
    shared_prefix_len: int = 0

    @classmethod
    def parse(cls, text: str) -> Shape:
        """`IN/OUT` or `IN/OUT+PREFIX`, e.g. `8192/256` or `512/128+2000`."""
        found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*(?:\+\s*(\d+))?\s*", text, re.ASCII)
        if not found or int(found.group(1)) < 1 or int(found.group(2)) < 1:
            raise ValueError(f"expected IN/OUT or IN/OUT+PREFIX tokens, like 8192/256 or 512/128+2000; got {text!r}")
        return cls(int(found.group(1)), int(found.group(2)), int(found.group(3) or 0))

    @property
    def label(self) -> str:
        return f"{self.input_len}/{self.output_len}" + (f"+{self.shared_prefix_len}" if self.shared_prefix_len else "")


@dataclass(frozen=True)
class Workload:
    """The traffic the winner must serve: bench's closed loop at each concurrency, for the first request
    shape and each of `more_shapes` (a mix: the winner may lose on none of them)."""

    concurrency: tuple[int, ...] = (1, 16, 64)
    input_len: int = 512
    output_len: int = 128
    prompts: int = 32
    shared_prefix_len: int = 0
    slo: bench.Slo = field(default_factory=lambda: bench.Slo.parse(DEFAULT_SLO))
    more_shapes: tuple[Shape, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(**{**data, "concurrency": tuple(data["concurrency"]), "slo": bench.Slo(**data["slo"]),
                      "more_shapes": tuple(Shape(**shape) for shape in data.get("more_shapes", ()))})

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return (Shape(self.input_len, self.output_len, self.shared_prefix_len), *self.more_shapes)

    def describe(self) -> str:
        def one(shape: Shape) -> str:
            prefix = f" after a shared {shape.shared_prefix_len}-token prompt" if shape.shared_prefix_len else ""
            return f"{shape.input_len} tokens in{prefix}, {shape.output_len} out"

        return (f"{'; '.join(one(shape) for shape in self.shapes)}, concurrency "
                f"{','.join(map(str, self.concurrency))}, SLO {self.slo.describe()}")


def configuration_key(config: Config, workload: Workload, *, vllm_version: str, hardware: str) -> str:
    """What a measurement holds for: a change to any of these makes the old winner unproven."""
    material = {
        "model": str(config.model.path), "vllm": vllm_version, "hardware": hardware,
        "workload": config.plan.workload, "max_model_len": config.plan.max_model_len,
        "extra_args": list(config.plan.extra_args), "traffic": asdict(workload),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_tuned(path: Path) -> dict[str, Any] | None:
    """The file as tune wrote it, or None: it lives in the service user's state dir, so it is read as
    untrusted input (bounded, shallow, finite) and held to the rules the operator's extra_args are."""
    try:
        data = read_json(path)
    except (OSError, UntrustedInput):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("flags"), list) else None


def tuned_flags(tuned: dict[str, Any], config: Config, *, vllm_version: str,
                hardware: str) -> tuple[list[str], str | None]:
    """The measured flags serve adds to the plan (none an operator's extra_args also sets), or none and
    why not: a winner measured for another model, engine, GPUs, workload or operator flags is unproven."""
    try:
        key = configuration_key(config, Workload.from_json(tuned["workload"]), vllm_version=vllm_version,
                                hardware=hardware)
    except (KeyError, TypeError, ValueError):
        return [], f"{TUNED_FILE} is not one kimi-service tune wrote; its flags are not applied"
    if not all(isinstance(token, str) for token in tuned["flags"]):
        return [], f"{TUNED_FILE} is not one kimi-service tune wrote; its flags are not applied"
    try:
        check_extra_args(tuple(tuned["flags"]), TUNED_FILE)
    except ValueError as exc:
        return [], f"{exc}; its flags are not applied"
    if key != tuned.get("key"):
        return [], (f"{TUNED_FILE} ({tuned.get('winner')}) was measured for another model, engine, GPUs, workload "
                    "or extra_args; its flags are not applied: run kimi-service tune again")
    if tuned["flags"] and tuned.get("gain_held") is not True:
        return [], (f"{TUNED_FILE} ({tuned.get('winner')}): its gain has not held when measured again "
                    f"({tuned.get('verification') or 'not measured again'}); its flags are not applied: run "
                    "kimi-service tune --verify")
    operator = {option_name(token) for token in config.plan.extra_args if token.startswith("-")}
    flags: list[str] = []
    keep = False
    for token in tuned["flags"]:
        if token.startswith("--"):
            keep = option_name(token) not in operator
        if keep:
            flags.append(token)
    return flags, None
