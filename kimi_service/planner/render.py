"""Plans and sizes for people: a short table, GiB with GB alongside."""

from __future__ import annotations

from kimi_service.hardware import GIB
from kimi_service.planner.document import Plan


def gib(value: int) -> str:
    return f"{value / GIB:,.1f} GiB"


def size(value: int) -> str:
    return f"{value / GIB:,.1f} GiB ({value / 1e9:,.0f} GB)"


def render(plan_: Plan) -> str:
    """A short table for people: command, memory budget, reasons, warnings."""
    lines = [f"{plan_.model} on {plan_.hardware} ({plan_.engine} engine, workload {plan_.workload}): fits"]
    if plan_.parallelism:
        lines.append(f"parallelism: {plan_.parallelism}")
    lines.append("")
    lines.append("command:")
    lines.append("  " + " ".join(_quote(a) for a in plan_.argv))
    if plan_.env:
        lines.append("environment:")
        lines.extend(f"  {k}={v}" for k, v in plan_.env.items())
    lines.append("")
    if plan_.budget:
        b = plan_.budget
        lines.append("memory per GPU:" if plan_.data_parallel_size == 1 else "memory per GPU (every DP rank):")
        rows = [
            ("total", b.total_bytes),
            (f"usable at {plan_.gpu_memory_utilization:.2f}", b.usable_bytes),
            ("weights", b.weights_bytes),
            ("activations (profiled peak)", b.activation_bytes),
            ("CUDA graphs", b.cuda_graph_bytes),
            ("non-torch", b.non_torch_bytes),
            ("NCCL buffers", b.comm_bytes),
            ("encoder / draft / MLA", b.extra_bytes),
            ("KV cache", b.kv_cache_bytes),
        ]
        lines.extend(f"  {label:<28} {gib(value):>12}" for label, value in rows)
    if plan_.data_parallel_size > 1:
        lines.append(f"  {'KV cache tokens per rank':<28} {plan_.kv_cache_tokens_per_rank:>12,}")
    lines.append(f"  {'KV cache tokens':<28} {plan_.kv_cache_tokens:>12,}")
    lines.append(f"  {'concurrent full-length seqs':<28} {plan_.max_concurrency:>12,}")
    lines.append("")
    lines.append("why:")
    width = max((len(k) for k in plan_.reasons), default=0)
    lines.extend(f"  {k:<{width}}  {v}" for k, v in plan_.reasons.items())
    if plan_.warnings:
        lines.append("")
        lines.append("warnings:")
        lines.extend(f"  - {w}" for w in plan_.warnings)
    return "\n".join(lines)


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in ' {}"') else arg
