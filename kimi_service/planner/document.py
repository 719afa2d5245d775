"""The plan document: the vLLM command line with the reason for every flag, and the numbers behind it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from kimi_service.catalog import CatalogEntry
from kimi_service.errors import UsageError
from kimi_service.model import ModelSpec
from kimi_service.planner.budget import MemoryBudget
from kimi_service.planner.fit import Fit, Problem, layout_label, uses_expert_parallel


@dataclass
class Plan:
    fits: bool
    argv: list[str]
    env: dict[str, str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int
    gpu_memory_utilization: float | None
    weights_bytes_per_gpu: int
    weights_bytes: int  # the whole checkpoint: what each host keeps on disk
    kv_cache_tokens: int
    warnings: list[str]
    reasons: dict[str, str]
    model: str
    hardware: str
    engine: str  # "cuda" or "cpu"
    workload: str
    nodes: int
    kv_cache_dtype: str
    max_concurrency: int  # sequences of max_model_len the KV cache holds at once
    expert_parallel: bool = False
    budget: MemoryBudget | None = None  # bytes on one GPU (each DP rank's, under DP+EP)
    overrides: list[str] = field(default_factory=list)
    # DP+EP: engines (ranks) in all, and on each node; kv_cache_tokens counts all ranks, this one rank's
    # (what vLLM logs as "GPU KV cache size" per engine).
    data_parallel_size: int = 1
    data_parallel_size_local: int = 1
    kv_cache_tokens_per_rank: int = 0
    parallelism: str = ""  # the layout as people read it: fit.layout_label

    def to_json(self) -> dict:
        data = asdict(self)
        data["budget"] = asdict(self.budget) if self.budget else None
        return data


class Flag(NamedTuple):
    name: str
    value: str | None  # None: a switch without a value
    why: str


@dataclass(frozen=True)
class Endpoint:
    """Where and under which name the engine serves: what the planner needs besides the fit."""

    model_path: str | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000


@dataclass
class Draft:
    """A plan being written: tuned flags, reasons that are not flags, warnings, the engine's environment."""

    flags: list[Flag] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def endpoint_flags(model: ModelSpec, endpoint: Endpoint) -> list[Flag]:
    return [
        Flag("--served-model-name", endpoint.served_model_name or model.served_name or model.name,
             "the name clients put in the request's model field"
             + ("" if endpoint.served_model_name else " (the model's own name; set served_name to change it)")),
        Flag("--host", endpoint.host, "address the OpenAI API listens on"),
        Flag("--port", str(endpoint.port), "port of the OpenAI API"),
    ]


def catalog_flags(entry: CatalogEntry) -> list[Flag]:
    result: list[Flag] = []
    items = list(entry.flags)
    i = 0
    while i < len(items):
        flag = items[i]
        value = items[i + 1] if i + 1 < len(items) and not items[i + 1].startswith("--") else None
        result.append(Flag(flag, value, entry.flag_reasons.get(flag, f"required by {entry.repo_id} ({entry.source})")))
        i += 2 if value is not None else 1
    return result


def model_flags(model: ModelSpec, entry: CatalogEntry | None, *, leave_out: Iterable[str] = ()) -> list[Flag]:
    """What the model itself needs: its catalog entry's flags (or remote code a config.json points at), and
    the tool-call and reasoning parsers its config and chat template call for."""
    if entry:
        skipped = set(leave_out)
        flags = [flag for flag in catalog_flags(entry) if flag.name not in skipped]
        if model.matched_by_shape:
            flags = [Flag(f.name, f.value, f"{f.why} [flags of catalog entry {entry.repo_id}, which this directory "
                                           "matches by architecture, geometry and quantization]") for f in flags]
    elif model.trust_remote_code:
        flags = [Flag("--trust-remote-code", None, "config.json's auto_map points at code in the model repo")]
    else:
        flags = []
    return flags + parser_flags(model)


def parser_flags(model: ModelSpec) -> list[Flag]:
    parsers = model.parsers
    if parsers.tool_parser is None:
        return []
    found = f"{parsers.family}, recognised by {parsers.recognised_by}; {parsers.source}"
    flags = [
        Flag("--tool-call-parser", parsers.tool_parser, f"turns {parsers.family}'s tool-call format into OpenAI "
             f"tool_calls ({found})"),
        Flag("--enable-auto-tool-choice", None, "lets clients send tool_choice=auto, as agent frameworks do"),
    ]
    if parsers.reasoning_parser:
        flags.append(Flag("--reasoning-parser", parsers.reasoning_parser,
                          f"{parsers.thinking} ({found})"))
    return flags


def assemble(problem: Problem, endpoint: Endpoint, fit: Fit, draft: Draft) -> Plan:
    """argv from the tuned flags (an operator's override replaces its tuned flag and goes last), as a Plan."""
    model, gpus, knobs, budget = problem.model, problem.gpus, fit.knobs, fit.budget
    reasons = draft.reasons
    overridden = problem.overrides.flags
    argv = ["vllm", "serve", endpoint.model_path or model.name]
    for flag, value, why in draft.flags:
        if flag in overridden:
            reasons[flag] = f"operator override (tuned: {value if value is not None else 'on'}; {why})"
            continue
        argv.append(flag)
        if value is not None:
            argv.append(value)
        reasons[flag] = why
    extra: list[str] = []
    for flag, value in problem.overrides.pairs:
        extra.append(flag)
        if value is not None:
            extra.append(value)
        reasons.setdefault(flag, "operator override")
    argv.extend(extra)
    if "--tool-call-parser" not in argv:
        draft.warnings.append(model.parsers.tool_warning)
    return Plan(
        fits=True,
        argv=argv,
        env=draft.env,
        tensor_parallel_size=fit.parallel.tensor,
        pipeline_parallel_size=fit.parallel.pipeline,
        max_model_len=fit.max_model_len,
        gpu_memory_utilization=knobs.utilization if knobs and not gpus.is_cpu else None,
        weights_bytes_per_gpu=budget.weights_bytes if budget else 0,
        weights_bytes=model.weight_bytes,
        kv_cache_tokens=fit.total_kv_tokens,
        warnings=draft.warnings,
        reasons=reasons,
        model=model.name,
        hardware=problem.hardware,
        engine="cpu" if gpus.is_cpu else "cuda",
        workload=problem.profile.name,
        nodes=problem.nodes,
        kv_cache_dtype=knobs.kv_dtype if knobs else "auto",
        max_concurrency=fit.max_concurrency,
        expert_parallel=uses_expert_parallel(model, fit),
        budget=budget,
        overrides=extra,
        data_parallel_size=fit.parallel.data,
        data_parallel_size_local=fit.parallel.data // problem.nodes if fit.parallel.data > 1 else 1,
        kv_cache_tokens_per_rank=fit.kv_cache_tokens,
        parallelism=layout_label(model, fit),
    )


def check_spans_nodes(plan_: Plan) -> None:
    """vLLM's multi-node launch splits the TP x PP ranks (or the DP ranks) evenly over the nodes; a plan
    that needs fewer nodes than the cluster has would put one TP group across hosts (or leave a node
    idle): refuse it."""
    nodes = plan_.nodes
    if nodes > 1 and plan_.data_parallel_size > 1:
        if plan_.data_parallel_size_local * nodes == plan_.data_parallel_size and plan_.pipeline_parallel_size == 1:
            return
        raise UsageError(
            f"{plan_.model}: DP {plan_.data_parallel_size} with {plan_.data_parallel_size_local} rank(s) per node "
            f"does not spread evenly over the {nodes} nodes of this cluster; set --data-parallel-size to a multiple "
            "of the node count"
        )
    world = plan_.tensor_parallel_size * plan_.pipeline_parallel_size
    spread = plan_.pipeline_parallel_size if plan_.engine == "cuda" else plan_.tensor_parallel_size
    if nodes > 1 and (spread != nodes or world % nodes):
        raise UsageError(
            f"{plan_.model} fits on fewer than the {nodes} nodes of this cluster (TP {plan_.tensor_parallel_size} x "
            f"PP {plan_.pipeline_parallel_size}): serve it on one node, or as independent replicas behind a "
            "load balancer, instead of one engine over several hosts"
        )
