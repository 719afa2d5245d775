"""ModelSpec x GpuInventory x workload -> the vLLM command line, its memory budget and why; or DoesNotFit.

Pure functions: no NVML, no files, no network. `planning.plan` checks the request and builds a `fit.Problem`;
`fit` searches the smallest tensor x pipeline group whose KV cache (`budget`) serves the workload; `layout`
weighs it against data parallel + expert parallel for MoE models and BF16 against FP8 KV; `gpu` and `cpu`
turn the fit into flags, `document` into the `Plan`; `advice` says what would fit when nothing does;
`render` prints a plan for people.
"""

from kimi_service.planner.budget import MemoryBudget
from kimi_service.planner.document import Plan, check_spans_nodes
from kimi_service.planner.fit import DoesNotFit, valid_tensor_parallel
from kimi_service.planner.overrides import parse_byte_count, parse_overrides
from kimi_service.planner.planning import plan
from kimi_service.planner.render import render
from kimi_service.workloads import PROFILES, WORKLOADS, Workload

__all__ = [
    "PROFILES",
    "WORKLOADS",
    "DoesNotFit",
    "MemoryBudget",
    "Plan",
    "Workload",
    "check_spans_nodes",
    "parse_byte_count",
    "parse_overrides",
    "plan",
    "render",
    "valid_tensor_parallel",
]
