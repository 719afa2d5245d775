"""The fit search: the smallest tensor x pipeline parallel group whose KV cache serves the workload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kimi_service.catalog import CatalogEntry
from kimi_service.errors import KimiError
from kimi_service.hardware import GpuInventory
from kimi_service.model import ModelSpec
from kimi_service.planner.budget import (
    DEFAULT_BATCHED_TOKENS,
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
# Qwen's -1M model cards (dual chunk attention) serve contexts past this length with
# --max-num-batched-tokens 131072 --enforce-eager: prefill runs in 131,072-token chunks, and its
# activations are part of the memory a long context needs (the cards ask for >= 120 GB for the 7B).
LONG_PREFILL_TOKENS = 131_072


class DoesNotFit(KimiError):
    """The model cannot be served on this hardware; says what is needed and what would fit."""

    exit_code = 3

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int, suggestions: list[str]):
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.suggestions = suggestions
        text = message
        if suggestions:
            text += "\nWould fit:\n" + "\n".join(f"  - {s}" for s in suggestions)
        super().__init__(text)


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
    kv_dtype: str | None = None  # the planner's own KV dtype choice (layout.choose); an override beats it

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
    concurrency: int | None = None  # sequences of max_model_len held, over all DP ranks (sliding windows counted)
    choice: str = ""  # why this group, when it is not simply the smallest that serves the workload
    # Reasons for choices that are not flags of their own: why DP+EP is off, why the KV dtype is what it is.
    notes: tuple[tuple[str, str], ...] = ()
    # Flags a reduced plan adds because nothing fits with vLLM's defaults (layout.REDUCED_BATCH).
    reduced: tuple[tuple[str, str | None], ...] = ()

    @property
    def max_concurrency(self) -> int:
        if self.concurrency is not None:
            return self.concurrency
        return self.kv_cache_tokens // self.max_model_len * self.parallel.data if self.max_model_len else 0

    @property
    def total_kv_tokens(self) -> int:
        """KV tokens over all DP ranks (kv_cache_tokens is one engine's, as vLLM logs it)."""
        return self.kv_cache_tokens * self.parallel.data


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


def _choose_len(
    model: ModelSpec, held: Callable[[int], int], requested: int | None, profile: Workload, limit: int
) -> int | None:
    """The context length to serve, or None when the KV cache cannot hold a useful one.

    `held(length)` is how many sequences of that length the cache holds; a plan must hold the workload's
    min_concurrency of them.
    """
    least = max(profile.min_concurrency, 1)
    if requested is not None:
        return requested if held(requested) >= least else None
    floor = min(floor_len(model), limit)
    if held(floor) < least:
        return None
    length = limit
    # Halve until the cache holds the workload's batch of full-length sequences, but not below the floor.
    while length > floor and held(length) < profile.target_concurrency:
        length = max(floor, length // 2)
    return length


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
    kv_dtype = (
        overrides.get("--kv-cache-dtype") or problem.kv_dtype or ("fp8" if profile.fp8_kv and gpus.fp8 else "auto")
    )
    return Knobs(
        utilization=overrides.fraction("--gpu-memory-utilization") or GPU_MEMORY_UTILIZATION,
        kv_dtype=kv_dtype,
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 0,
        max_num_seqs=overrides.integer("--max-num-seqs"),
        batched_tokens=overrides.integer("--max-num-batched-tokens"),
        enforce_eager="--enforce-eager" in overrides,
        draft="--speculative-config" in overrides,
        expert_parallel=profile.expert_parallel and model.is_moe,
    )


def needs_expert_parallel(model: ModelSpec, tp: int) -> bool:
    # FP8 block-quantized experts can only be sliced along whole 128-wide blocks; when TP would cut a
    # block, whole experts must move to GPUs instead (MiniMax-M2 at TP8: 1536 / 8 = 192).
    expert_width = model.moe_intermediate_size or model.intermediate_size
    return model.is_moe and tp > 1 and model.quantization == "fp8" and (expert_width // tp) % FP8_BLOCK != 0


def uses_expert_parallel(model: ModelSpec, fit: Fit) -> bool:
    """Whether the fit runs with --enable-expert-parallel: always under DP+EP; in a TP group when the
    workload asks for whole experts per GPU or FP8 blocks force it. vLLM's EP size is TP x DP (docs.vllm.ai,
    Expert Parallel Deployment), so a group without TP or DP ranks (TP 1, or no knobs: the CPU engine) has
    nothing to spread experts over."""
    parallel = fit.parallel
    if parallel.expert_parallel:
        return True
    if fit.knobs is None or parallel.tensor == 1:
        return False
    return fit.knobs.expert_parallel or needs_expert_parallel(model, parallel.tensor)


def layout_label(model: ModelSpec, fit: Fit) -> str:
    """The fit's layout as the plan, its advice and everything reading plan.json show it."""
    return fit.parallel.describe(expert_parallel=uses_expert_parallel(model, fit))


def sequence_bytes(model: ModelSpec, parallel: Parallelism, knobs: Knobs, length: int) -> int:
    """KV bytes one sequence of `length` tokens takes on the busiest GPU of the group."""
    return model.kv_bytes_per_sequence(
        length, tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline,
        kv_dtype_bytes=knobs.kv_dtype_bytes, window_slack=knobs.batched_tokens or DEFAULT_BATCHED_TOKENS,
    )


def sequences_held(
    model: ModelSpec, budget: MemoryBudget, parallel: Parallelism, knobs: Knobs
) -> Callable[[int], int]:
    """How many sequences of a length the group's KV caches hold (in vLLM's 16-token blocks when every
    layer caches every token; sliding-window layers counted at their window, linear-attention layers at
    their state). Each DP rank holds its own sequences in its own cache: a sequence never spans ranks."""
    tokens, ranks = kv_tokens(model, budget, parallel, knobs), parallel.data
    if not model.sliding_window_layers and not model.linear_attention_layers:
        return lambda length: tokens // length * ranks
    return lambda length: budget.kv_cache_bytes // sequence_bytes(model, parallel, knobs, length) * ranks


def long_prefill(knobs: Knobs, overrides: Overrides) -> Knobs:
    """The knobs of a dual-chunk-attention model serving past LONG_PREFILL_TOKENS (its model card's)."""
    tokens = overrides.integer("--max-num-batched-tokens") or max(knobs.batched_tokens or 0, LONG_PREFILL_TOKENS)
    return replace(knobs, batched_tokens=tokens, enforce_eager=True, long_prefill=True)


def evaluate(problem: Problem, parallel: Parallelism, knobs: Knobs, limit: int) -> Fit | None:
    model = problem.model
    budget = memory_budget(model, problem.gpus, parallel, knobs)
    held = sequences_held(model, budget, parallel, knobs)
    length = _choose_len(model, held, problem.requested_len, problem.profile, limit)
    if length is None:
        return None
    return Fit(parallel=parallel, max_model_len=length, kv_cache_tokens=kv_tokens(model, budget, parallel, knobs),
               budget=budget, knobs=knobs, concurrency=held(length))


def fit_group(problem: Problem, parallel: Parallelism, knobs: Knobs) -> Fit | None:
    """This group's fit; a dual-chunk model past LONG_PREFILL_TOKENS is costed with its long-prefill knobs,
    else kept at that length with the default ones."""
    model, requested = problem.model, problem.requested_len
    if not model.dual_chunk_attention or (requested or model.native_max_len) <= LONG_PREFILL_TOKENS:
        return evaluate(problem, parallel, knobs, model.native_max_len)
    long = evaluate(problem, parallel, long_prefill(knobs, problem.overrides), model.native_max_len)
    if long is not None and long.max_model_len > LONG_PREFILL_TOKENS:
        return long
    if requested:
        return None
    return evaluate(problem, parallel, knobs, LONG_PREFILL_TOKENS)


def try_fit(problem: Problem) -> Fit | None:
    """The smallest group that serves the workload; else, of the groups that fit at all, the one serving the
    longest context with the most KV on the GPUs there are; else None."""
    profile, requested = problem.profile, problem.requested_len
    knobs = knobs_for(problem)
    fitting: list[Fit] = []
    for parallel in candidates(problem):
        fit = fit_group(problem, parallel, knobs)
        if fit is None:
            continue
        fitting.append(fit)
        # The smallest group whose cache holds the workload's batch at the shortest useful context wins.
        assert fit.budget is not None and fit.knobs is not None
        held = sequences_held(problem.model, fit.budget, parallel, fit.knobs)
        if held(requested or floor_len(problem.model)) >= profile.target_concurrency:
            return fit
    if not fitting:
        return None
    best = max(fitting, key=lambda f: (f.max_model_len, f.max_concurrency, -f.parallel.gpus, -f.parallel.pipeline))

    why = (
        f"no group holds the {profile.name} target of {profile.target_concurrency} sequences; of those that fit, "
        f"{layout_label(problem.model, best)} serves the longest context ({best.max_model_len:,}) with the most KV "
        f"({best.max_concurrency} sequence(s))"
    )
    return replace(best, choice=why)
