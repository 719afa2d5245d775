"""The fit search: the smallest tensor x pipeline parallel group whose KV cache serves the workload."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kimi_service.catalog import CatalogEntry
from kimi_service.hardware import GpuInventory
from kimi_service.model import ModelSpec
from kimi_service.planner.budget import (
    GPU_MEMORY_UTILIZATION,
    Knobs,
    MemoryBudget,
    Parallelism,
    kv_tokens,
    memory_budget,
)
from kimi_service.planner.overrides import Overrides
from kimi_service.workloads import PROFILES, Workload

MIN_CONTEXT = 4096  # below this a chat deployment is not useful; never plan shorter unless the model is
FP8_BLOCK = 128  # FP8 block-quantized experts split under TP only in whole 128-wide blocks


@dataclass(frozen=True)
class Problem:
    """What is asked of the planner: this model on `nodes` nodes of these GPUs, tuned for a workload."""

    model: ModelSpec
    entry: CatalogEntry | None  # the model's catalog entry, looked up once by whoever builds the problem
    gpus: GpuInventory
    nodes: int = 1
    profile: Workload = PROFILES["chat"]
    requested_len: int | None = None
    overrides: Overrides = field(default_factory=Overrides)

    @property
    def hardware(self) -> str:
        return self.gpus.describe() if self.nodes == 1 else f"{self.nodes} nodes x {self.gpus.describe()}"


@dataclass(frozen=True)
class Fit:
    """A group that serves the model: its shape, the context length and the KV cache it holds."""

    parallel: Parallelism
    max_model_len: int
    kv_cache_tokens: int
    budget: MemoryBudget | None = None  # None on the CPU engine, which has no GPU to budget
    knobs: Knobs | None = None

    @property
    def max_concurrency(self) -> int:
        return self.kv_cache_tokens // self.max_model_len if self.max_model_len else 0


def valid_tensor_parallel(model: ModelSpec, tp: int) -> bool:
    """vLLM shards attention heads evenly; KV heads split evenly or are replicated a whole number of times."""
    if model.num_attention_heads % tp:
        return False
    if model.attention == "mla":
        return True
    kv = model.num_kv_heads
    return kv % tp == 0 if kv >= tp else tp % kv == 0


def floor_len(model: ModelSpec) -> int:
    return min(model.native_max_len, MIN_CONTEXT)


def _choose_len(model: ModelSpec, tokens: int, requested: int | None, profile: Workload) -> int | None:
    """The context length to serve, or None when the KV cache cannot hold a useful one."""
    if requested is not None:
        return requested if tokens >= requested else None
    floor = floor_len(model)
    if tokens < floor:
        return None
    length = model.native_max_len
    # Halve until the cache holds the workload's batch of full-length sequences, but not below the floor.
    while length > floor and tokens < profile.target_concurrency * length:
        length = max(floor, length // 2)
    return min(length, tokens)


def candidates(problem: Problem) -> list[Parallelism]:
    model, gpus = problem.model, problem.gpus
    tp_fixed = problem.overrides.integer("--tensor-parallel-size")
    pp_fixed = problem.overrides.integer("--pipeline-parallel-size")
    tps = [tp_fixed] if tp_fixed else [t for t in range(1, gpus.count + 1) if valid_tensor_parallel(model, t)]
    pps = [pp_fixed] if pp_fixed else list(range(1, problem.nodes + 1))
    groups = [Parallelism(tp, pp) for tp in tps for pp in pps if pp <= model.num_layers]
    # Fewest GPUs first; at equal count, keep the group inside one node (TP over NVLink beats PP hops).
    return sorted(groups, key=lambda group: (group.gpus, group.pipeline))


def knobs_for(problem: Problem) -> Knobs:
    model, gpus, profile, overrides = problem.model, problem.gpus, problem.profile, problem.overrides
    kv_dtype = overrides.get("--kv-cache-dtype") or ("fp8" if profile.fp8_kv and gpus.fp8 else "auto")
    entry = problem.entry
    speculative = (
        entry.speculative if entry and profile.speculative and "--speculative-config" not in overrides else None
    )
    return Knobs(
        utilization=overrides.fraction("--gpu-memory-utilization") or GPU_MEMORY_UTILIZATION,
        kv_dtype=kv_dtype,
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 0,
        max_num_seqs=overrides.integer("--max-num-seqs") or profile.max_num_seqs,
        batched_tokens=overrides.integer("--max-num-batched-tokens") or profile.max_num_batched_tokens,
        enforce_eager="--enforce-eager" in overrides,
        speculative=speculative,
        expert_parallel=profile.expert_parallel and model.is_moe,
    )


def needs_expert_parallel(model: ModelSpec, tp: int) -> bool:
    # FP8 block-quantized experts can only be sliced along whole 128-wide blocks; when TP would cut a
    # block, whole experts must move to GPUs instead (MiniMax-M2 at TP8: 1536 / 8 = 192).
    expert_width = model.moe_intermediate_size or model.intermediate_size
    return model.is_moe and tp > 1 and model.quantization == "fp8" and (expert_width // tp) % FP8_BLOCK != 0


def try_fit(problem: Problem) -> Fit | None:
    """The smallest group that serves the workload, else the smallest that serves at all, else None."""
    model, profile, requested = problem.model, problem.profile, problem.requested_len
    knobs = knobs_for(problem)
    fitting: list[Fit] = []
    for parallel in candidates(problem):
        these = knobs if not (knobs.speculative and parallel.pipeline > 1) else replace(knobs, speculative=None)
        budget = memory_budget(model, problem.gpus, parallel, these)
        tokens = kv_tokens(model, budget, parallel, these)
        length = _choose_len(model, tokens, requested, profile)
        if length is None:
            continue
        fitting.append(Fit(parallel=parallel, max_model_len=length, kv_cache_tokens=tokens, budget=budget,
                           knobs=these))
        # The smallest group whose cache holds the workload's batch at the shortest useful context wins;
        # a smaller one that only just loads the weights is kept as the fallback.
        if tokens >= profile.target_concurrency * (requested or floor_len(model)):
            return fitting[-1]
    return fitting[0] if fitting else None
