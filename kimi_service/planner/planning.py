"""plan(): check the request, look the model's catalog entry up once, and hand it to the engine's planner."""

from __future__ import annotations

from collections.abc import Sequence

from kimi_service import catalog
from kimi_service.errors import UsageError
from kimi_service.hardware import GpuInventory
from kimi_service.model import ModelSpec
from kimi_service.planner.advice import does_not_fit
from kimi_service.planner.cpu import cpu_plan
from kimi_service.planner.document import Draft, Endpoint, Plan
from kimi_service.planner.fit import Problem
from kimi_service.planner.gpu import gpu_plan
from kimi_service.planner.layout import choose
from kimi_service.planner.overrides import Overrides
from kimi_service.workloads import PROFILES, WORKLOADS


def plan(
    model: ModelSpec,
    gpus: GpuInventory,
    *,
    nodes: int = 1,
    workload: str = "chat",
    max_model_len: int | None = None,
    overrides: Sequence[str] = (),
    model_path: str | None = None,
    served_model_name: str | None = None,
    host: str = "0.0.0.0",
    port: int = 8000,
) -> Plan:
    """Tuned vLLM flags for this model on these GPUs, or DoesNotFit. Raises UsageError on bad input."""
    if workload not in PROFILES:
        raise UsageError(f"unknown workload {workload!r}; choose one of: {', '.join(WORKLOADS)}")
    if nodes < 1:
        raise UsageError(f"--nodes must be 1 or more, got {nodes}")
    if max_model_len is not None and max_model_len < 1:
        raise UsageError(f"--max-model-len must be a positive number of tokens, got {max_model_len}")
    operator = Overrides.parse(overrides)
    draft = Draft()
    requested = operator.integer("--max-model-len") or max_model_len
    if requested is not None and requested > model.native_max_len:
        draft.warnings.append(
            f"max_model_len {requested:,} is above the model's native context {model.native_max_len:,} "
            f"({model.context_why}): planned with {model.native_max_len:,}; longer needs RoPE scaling "
            "(rope_scaling in config.json, or vLLM's --hf-overrides)"
        )
        requested = model.native_max_len
    problem = Problem(
        model=model,
        entry=catalog.get(model.catalog_name) if model.catalog_name else None,
        gpus=gpus,
        nodes=nodes,
        profile=PROFILES[workload],
        requested_len=requested,
        overrides=operator,
    )
    endpoint = Endpoint(model_path=model_path, served_model_name=served_model_name, host=host, port=port)
    if gpus.is_cpu:
        return cpu_plan(problem, endpoint, draft)
    fit = choose(problem)
    if fit is None:
        raise does_not_fit(problem)
    return gpu_plan(problem, endpoint, fit, draft)
