"""Which layout serves the workload: TP x PP, or DP+EP for a MoE model; and BF16 or FP8 KV.

- TP x PP (`fit.try_fit`): the smallest group that serves the workload. Latency plans stop here.
- DP+EP: attention data-parallel, experts sharded (`--data-parallel-size N --enable-expert-parallel`). Each
  rank keeps the attention, dense layers and embeddings whole plus 1/N of the routed experts, and a KV
  cache of its own. Under TP every rank of an MLA model keeps the whole latent cache (the same tokens N
  times); under DP each rank caches different sequences, so the KV capacity grows N-fold. Chat and
  throughput plans take it when the TP x PP fit already needs every GPU there is (the same GPUs then hold
  more KV) and it holds more KV tokens at no shorter context; an operator's --data-parallel-size
  asks for it outright, and is refused with the reason when it does not fit.
- Reduced: when nothing fits with vLLM's defaults (a 70B FP8 checkpoint on one 80 GB card, a 24 GB card),
  a smaller batch (REDUCED_BATCH: fewer sequences scheduled at once, shorter prefill chunks) gives its
  activation and sampler reserve to the KV cache, then CUDA graphs' memory (--enforce-eager); the plan says
  what each costs. Flags the operator set are left as set.
- FP8 KV: where the GPU has FP8 (compute capability 8.9 and up) and the KV cache, not compute, bounds
  the plan (it cannot hold the workload's target of sequences at the context asked for, or the model's
  native one), FP8 KV is planned when it holds more. An operator's --kv-cache-dtype always wins.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kimi_service.errors import UsageError
from kimi_service.planner.budget import Parallelism, memory_budget
from kimi_service.planner.fit import (
    DoesNotFit,
    Fit,
    Problem,
    fit_group,
    floor_len,
    knobs_for,
    layout_label,
    sequence_bytes,
    try_fit,
    valid_tensor_parallel,
)
from kimi_service.planner.overrides import Overrides
from kimi_service.planner.render import gib, size

DATA_PARALLEL_WORKLOADS = ("chat", "throughput")
# The batch a reduced plan schedules: vLLM's profiling reserves activations for max_num_batched_tokens and
# float32 logits for max_num_seqs; these shrink that reserve about fourfold against the defaults (8,192
# tokens; 256 or 1,024 sequences).
REDUCED_BATCH = (("--max-num-seqs", "64"), ("--max-num-batched-tokens", "2048"))
_REDUCED_WHY = {
    "--max-num-seqs": "reduced plan: at most {value} requests run at once (vLLM's default is 256 or 1,024), which "
                      "shrinks the sampler's reserve; the rest wait in the queue",
    "--max-num-batched-tokens": "reduced plan: prompts are prefilled in {value}-token chunks (vLLM's default "
                                "8,192), which shrinks the activation reserve; long prompts take longer to start",
    "--enforce-eager": "reduced plan: no CUDA graphs, their memory goes to the KV cache; decoding is slower",
}
FP8_KV_NEVER = ("latency",)  # few short sequences: the cache is not the bound, FP8 dequant would cost time


def data_parallel_group(problem: Problem) -> Parallelism | None:
    """DP+EP over every GPU of every node (TP 1 per rank unless the operator sets TP), or None when the
    model has no experts to shard. Raises UsageError for an operator's DP size the GPUs cannot hold."""
    model, overrides = problem.model, problem.overrides
    total = problem.gpus.count * problem.nodes
    tp = overrides.integer("--tensor-parallel-size") or 1
    asked = overrides.integer("--data-parallel-size")
    if asked is not None and not model.is_moe:
        raise UsageError(f"--data-parallel-size: {model.name} has no experts to shard; serve independent "
                         "replicas behind a load balancer instead")
    data = asked or total // tp
    if asked is not None and (data * tp > total or data % problem.nodes):
        raise UsageError(f"--data-parallel-size {data} x TP {tp} needs {data * tp} GPUs spread evenly over "
                         f"{problem.nodes} node(s); there are {total}")
    if not model.is_moe or data < 2 or not valid_tensor_parallel(model, tp) or data % problem.nodes:
        return None
    return Parallelism(tensor=tp, pipeline=1, data=data)


def _why_data_parallel_does_not_fit(problem: Problem, group: Parallelism) -> str:
    model = problem.model
    knobs = knobs_for(problem)
    budget = memory_budget(model, problem.gpus, group, knobs)
    replicated = model.weight_bytes - model.expert_bytes
    return (
        f"{group.describe()} needs {gib(budget.weights_bytes)} of weights per rank (the attention, dense "
        f"layers and embeddings, {size(replicated)}, on every rank; the routed experts, {size(model.expert_bytes)}, "
        f"split {group.gpus} ways) + reserve {gib(budget.reserve_bytes)}, which leaves {gib(budget.kv_cache_bytes)} "
        f"of the {gib(budget.usable_bytes)} usable per GPU for KV: not enough for "
        f"{max(problem.profile.min_concurrency, 1)} sequence(s) of {problem.requested_len or floor_len(model):,} "
        "tokens per rank"
    )


def _fit_layout(problem: Problem, group: Parallelism | None) -> Fit | None:
    """The fit of one DP+EP group, or (group None) the TP x PP search."""
    if group is None:
        return try_fit(problem)
    return fit_group(problem, group, knobs_for(problem))


def _kv_bound(problem: Problem, fit: Fit | None) -> bool:
    if fit is None:
        return True
    wanted = problem.requested_len or problem.model.native_max_len
    return fit.max_model_len < wanted or fit.max_concurrency < problem.profile.target_concurrency


def _with_kv_dtype(problem: Problem, group: Parallelism | None) -> Fit | None:
    """The layout's fit at BF16 KV, or at FP8 KV when the GPU has FP8, the cache bounds the plan and FP8
    holds more; the fit's notes say which and why."""
    fit = _fit_layout(problem, group)
    gpus, knobs = problem.gpus, knobs_for(problem)
    if "--kv-cache-dtype" in problem.overrides or knobs.kv_dtype != "auto" or problem.profile.name in FP8_KV_NEVER:
        return fit
    if not _kv_bound(problem, fit):
        return fit
    held = "does not fit" if fit is None else (
        f"holds {fit.max_concurrency} sequence(s) of {fit.max_model_len:,} tokens on {layout_label(problem.model, fit)}"
    )
    cc = f"{gpus.compute_capability[0]}.{gpus.compute_capability[1]}"
    if not gpus.fp8:
        hardware = (f"{gpus.name} is not in the GPU table, so its FP8 support is unknown (pass --kv-cache-dtype "
                    "fp8 if it has FP8)" if gpus.assumed else f"{gpus.name} (compute capability {cc}) has no FP8")
        note = (f"auto: KV-bound (with BF16 KV the plan {held}), but {hardware}; vLLM's FP8 KV cache is not "
                "planned there")
        return fit if fit is None else replace(fit, notes=(*fit.notes, ("kv-cache-dtype", note)))
    fp8_problem = replace(problem, kv_dtype="fp8")
    if fit is None:
        fp8 = _fit_layout(fp8_problem, group)
    else:
        # The BF16 fit's group, so FP8 buys context and sequences, not fewer GPUs.
        fp8 = fit_group(fp8_problem, fit.parallel, knobs_for(fp8_problem))
        fp8 = fp8 if fp8 is None else replace(fp8, choice=fit.choice, notes=fit.notes)
    if fp8 is None or (fit is not None and (fp8.max_model_len, fp8.max_concurrency) <= (fit.max_model_len,
                                                                                         fit.max_concurrency)):
        return fit
    why = (f"KV-bound: with BF16 KV the plan {held} (the {problem.profile.name} target is "
           f"{problem.profile.target_concurrency} at up to {problem.requested_len or problem.model.native_max_len:,}); "
           f"FP8 KV halves the bytes per token and holds {fp8.max_concurrency} of {fp8.max_model_len:,} "
           f"({gpus.name}, compute capability {cc}, has FP8)")
    return replace(fp8, notes=(*fp8.notes, ("--kv-cache-dtype", why)))


def _data_parallel_wanted(problem: Problem, fit: Fit) -> bool:
    total = problem.gpus.count * problem.nodes
    return (
        problem.model.is_moe
        and problem.profile.name in DATA_PARALLEL_WORKLOADS
        and total > 1
        and fit.parallel.gpus == total
        and "--tensor-parallel-size" not in problem.overrides
        and "--pipeline-parallel-size" not in problem.overrides
    )


def _operator_data_parallel(problem: Problem) -> Fit:
    group = data_parallel_group(problem)
    if group is None:
        raise UsageError("--data-parallel-size needs at least 2 ranks and a tensor-parallel size that divides "
                         f"{problem.model.name}'s {problem.model.num_attention_heads} attention heads")
    fit = _with_kv_dtype(problem, group)
    if fit is None:
        reason = _why_data_parallel_does_not_fit(problem, group)
        knobs = knobs_for(problem)
        budget = memory_budget(problem.model, problem.gpus, group, knobs)
        least = max(problem.profile.min_concurrency, 1)
        kv = sequence_bytes(problem.model, group, knobs, problem.requested_len or floor_len(problem.model)) * least
        needed = math.ceil((budget.weights_bytes + budget.reserve_bytes + kv) * group.gpus / knobs.utilization)
        raise DoesNotFit(f"{problem.model.name} does not fit as {group.describe()} on {problem.hardware}: {reason}",
                         needed_bytes=needed, available_bytes=problem.gpus.memory_bytes * group.gpus,
                         suggestions=[])
    return replace(fit, choice=f"operator's --data-parallel-size {group.data}")


def _reduced(problem: Problem) -> Fit | None:
    """The TP x PP fit with a smaller batch, then also without CUDA graphs; None when neither fits. The
    fit's notes name each flag the planner added and what it costs. Not for dual chunk attention, whose
    long contexts need their model card's prefill chunks (fit.LONG_PREFILL_TOKENS)."""
    if problem.model.dual_chunk_attention:
        return None
    steps = (REDUCED_BATCH, (*REDUCED_BATCH, ("--enforce-eager", None)))
    for pairs in steps:
        added = tuple((flag, value) for flag, value in pairs if flag not in problem.overrides)
        if not added:
            continue
        fit = _with_kv_dtype(replace(problem, overrides=Overrides(problem.overrides.pairs + added)), None)
        if fit is not None:
            notes = tuple((flag, _REDUCED_WHY[flag].format(value=value)) for flag, value in added)
            return replace(fit, notes=(*fit.notes, *notes), reduced=added)
    return None


def choose(problem: Problem) -> Fit | None:
    """The layout and KV dtype for the problem, or None when nothing fits (the caller says why)."""
    if "--data-parallel-size" in problem.overrides and (problem.overrides.integer("--data-parallel-size") or 0) > 1:
        return _operator_data_parallel(problem)
    fit = _with_kv_dtype(problem, None)
    if fit is None:
        return _reduced(problem)
    if not _data_parallel_wanted(problem, fit):
        return fit
    group = data_parallel_group(problem)
    if group is None:
        return fit
    dp = _with_kv_dtype(problem, group)
    if dp is None:
        note = f"off: {_why_data_parallel_does_not_fit(problem, group)}"
        return replace(fit, notes=(*fit.notes, ("data-parallel", note)))
    if dp.max_model_len < fit.max_model_len or dp.total_kv_tokens <= fit.total_kv_tokens:
        note = (f"off: {group.describe()} would hold {dp.total_kv_tokens:,} KV tokens at {dp.max_model_len:,} "
                f"context, {layout_label(problem.model, fit)} holds {fit.total_kv_tokens:,} at {fit.max_model_len:,}")
        return replace(fit, notes=(*fit.notes, ("data-parallel", note)))
    tensor_layout = layout_label(problem.model, fit)
    choice = (f"{problem.profile.name} at scale: the model needs all {group.gpus} GPUs either way, and each DP rank "
              f"keeps a KV cache of its own: {group.describe()} holds {dp.total_kv_tokens:,} KV tokens "
              f"({dp.max_concurrency} sequences of {dp.max_model_len:,}) where {tensor_layout} holds "
              f"{fit.total_kv_tokens:,} ({fit.max_concurrency} of {fit.max_model_len:,})")
    return replace(dp, choice=choice)
