"""The CUDA engine's flags for a fit: parallelism, context, memory, workload tuning, model needs."""

from __future__ import annotations

from kimi_service import catalog
from kimi_service.hardware import GIB, GpuInventory
from kimi_service.planner.budget import Knobs
from kimi_service.planner.document import Draft, Endpoint, Flag, Plan, assemble, endpoint_flags, model_flags
from kimi_service.planner.fit import Fit, Problem, layout_label, needs_expert_parallel, uses_expert_parallel
from kimi_service.planner.render import gib

FRAGILE_KV_BYTES = 2 * GIB  # less KV than this is within the reserve estimate's error


def generation(compute_capability: tuple[int, int]) -> str:
    if compute_capability >= (10, 0):
        return catalog.BLACKWELL
    if compute_capability >= (9, 0):
        return catalog.HOPPER
    if compute_capability >= (8, 9):
        return catalog.ADA
    return catalog.AMPERE


def gpu_plan(problem: Problem, endpoint: Endpoint, fit: Fit, draft: Draft) -> Plan:
    assert fit.budget is not None and fit.knobs is not None
    draft.flags.extend(endpoint_flags(problem.model, endpoint))
    _parallel_flags(problem, fit, draft)
    _length_flag(problem, fit, draft)
    _memory_flags(fit, draft)
    _workload_flags(problem, draft)
    _reduced_flags(problem, fit, draft)
    _long_prefill_flags(fit.knobs, draft)
    _expert_parallel_flag(problem, fit, draft)
    _model_flags(problem, draft)
    _moe_backend_flag(problem, draft)
    _speculative_reason(problem, fit, draft)
    _warnings(problem, fit, draft)
    return assemble(problem, endpoint, fit, draft)


def _parallel_flags(problem: Problem, fit: Fit, draft: Draft) -> None:
    model, tp, pp = problem.model, fit.parallel.tensor, fit.parallel.pipeline
    assert fit.budget is not None
    kv_heads = f" and {model.num_kv_heads} KV heads" if model.attention == "gqa" else " (MLA latent KV is per rank)"
    if fit.parallel.data > 1:
        _data_parallel_flags(problem, fit, draft)
        return
    chosen = fit.choice or "smallest TP that fits"
    draft.flags.append(Flag(
        "--tensor-parallel-size",
        str(tp),
        f"{chosen}: {gib(fit.budget.weights_bytes)} of weights per GPU; "
        f"divides the {model.num_attention_heads} attention heads" + kv_heads,
    ))
    if pp > 1:
        draft.flags.append(
            Flag("--pipeline-parallel-size", str(pp), f"layers split over {pp} nodes; TP stays inside a node")
        )
    elif problem.nodes > 1:
        draft.warnings.append(
            f"fits on one node: the other {problem.nodes - 1} node(s) are not needed for this model"
        )


def _data_parallel_flags(problem: Problem, fit: Fit, draft: Draft) -> None:
    """DP+EP: the DP size over all nodes, the ranks on each node; kimi-service serve adds each node's
    rendezvous (--data-parallel-address, --data-parallel-rpc-port, --data-parallel-start-rank, --headless)."""
    model, parallel, budget = problem.model, fit.parallel, fit.budget
    assert budget is not None
    local = parallel.data // problem.nodes
    draft.flags.append(Flag(
        "--tensor-parallel-size", str(parallel.tensor),
        f"per DP rank: divides the {model.num_attention_heads} attention heads",
    ))
    draft.flags.append(Flag(
        "--data-parallel-size", str(parallel.data),
        f"{fit.choice}; weights per rank {gib(budget.weights_bytes)} (attention, dense layers and embeddings "
        f"{gib(model.weight_bytes - model.expert_bytes)} whole, routed experts {gib(model.expert_bytes)} / "
        f"{parallel.gpus}), KV cache {gib(budget.kv_cache_bytes)} per rank",
    ))
    node_why = "" if problem.nodes == 1 else (
        f"; {problem.nodes} nodes: the leader serves the API, the others run headless from "
        "--data-parallel-start-rank (kimi-service serve adds each node's rendezvous flags)"
    )
    draft.flags.append(Flag("--data-parallel-size-local", str(local), f"{local} DP ranks on each node{node_why}"))


def _length_flag(problem: Problem, fit: Fit, draft: Draft) -> None:
    model, length, tokens = problem.model, fit.max_model_len, fit.kv_cache_tokens
    concurrency = fit.max_concurrency
    len_reason = (
        "operator's request"
        if problem.requested_len is not None
        else f"the model's native context ({model.context_why})"
        if length == model.native_max_len
        else f"shortened from native {model.native_max_len:,} so the KV cache holds "
        f"{min(concurrency, problem.profile.target_concurrency)} full-length sequences"
    )
    window = (
        f" ({model.sliding_window_layers} of {model.num_layers} layers keep only a {model.sliding_window:,}-token "
        "window per sequence)" if model.sliding_window_layers else ""
    )
    held = f"KV cache holds {tokens:,} tokens" if fit.parallel.data == 1 else (
        f"each of the {fit.parallel.data} DP ranks' KV caches holds {tokens:,} tokens"
    )
    draft.flags.append(Flag(
        "--max-model-len",
        str(length),
        f"{len_reason}; {held} = {concurrency} sequences at this length{window}",
    ))


def _memory_flags(fit: Fit, draft: Draft) -> None:
    budget, knobs, notes = fit.budget, fit.knobs, dict(fit.notes)
    assert budget is not None and knobs is not None
    draft.flags.append(Flag(
        "--gpu-memory-utilization",
        f"{knobs.utilization:.2f}",
        f"of {gib(budget.total_bytes)} per GPU: weights {gib(budget.weights_bytes)} + reserve "
        f"{gib(budget.reserve_bytes)} (activations {gib(budget.activation_bytes)}, CUDA graphs "
        f"{gib(budget.cuda_graph_bytes)}, non-torch {gib(budget.non_torch_bytes)}, NCCL {gib(budget.comm_bytes)}, "
        f"encoder/draft/MLA {gib(budget.extra_bytes)}) + KV cache {gib(budget.kv_cache_bytes)}",
    ))
    if knobs.kv_dtype != "auto":
        why = notes.get("--kv-cache-dtype", "FP8 KV halves cache bytes per token; the GPU has FP8")
        draft.flags.append(Flag("--kv-cache-dtype", knobs.kv_dtype, why))
    draft.reasons.update((key, why) for key, why in fit.notes if not key.startswith("--"))


def _workload_flags(problem: Problem, draft: Draft) -> None:
    """Only flags that cannot lose; the workload's speed guesses are left to vLLM until measured."""
    profile = problem.profile
    if profile.prefix_caching:
        draft.flags.append(
            Flag("--enable-prefix-caching", None, "shared prompt prefixes are computed once and reused")
        )
    tried = {"max-num-seqs": profile.trial_max_num_seqs, "max-num-batched-tokens": profile.trial_batched_tokens}
    for name, value in tried.items():
        if value and f"--{name}" not in problem.overrides:
            draft.reasons[name] = (
                f"not set (vLLM's default): the {profile.name} workload's {value} can lose on some hosts; "
                "`kimi-service tune` tries it and sets it only when it measures a win here"
            )


def _reduced_flags(problem: Problem, fit: Fit, draft: Draft) -> None:
    """A reduced plan's flags, each with what it costs, and a warning that says the trade as a whole."""
    if not fit.reduced:
        return
    notes = dict(fit.notes)
    for flag, value in fit.reduced:
        draft.flags.append(Flag(flag, value, notes[flag]))
        draft.reasons.pop(flag.removeprefix("--"), None)
    assert fit.knobs is not None
    flags = " ".join(flag if value is None else f"{flag} {value}" for flag, value in fit.reduced)
    kv = ", FP8 KV" if fit.knobs.kv_dtype.startswith("fp8") else ""
    draft.warnings.append(
        f"reduced plan: with vLLM's default batch {problem.model.name} leaves no room for the KV cache on "
        f"{problem.hardware}; {flags}{kv} leave {fit.max_concurrency} sequence(s) of {fit.max_model_len:,} tokens; "
        "more or larger GPUs serve longer contexts, more requests at once and full speed"
    )


def _long_prefill_flags(knobs: Knobs, draft: Draft) -> None:
    if not knobs.long_prefill:
        return
    why = ("dual chunk attention past 131,072 tokens: the model card serves it with 131,072-token prefill "
           "chunks and without CUDA graphs; their activations are in the memory budget")
    draft.flags[:] = [flag for flag in draft.flags if flag.name != "--max-num-batched-tokens"]
    draft.flags.append(Flag("--max-num-batched-tokens", str(knobs.batched_tokens), why))
    draft.flags.append(Flag("--enforce-eager", None, why))


def _expert_parallel_flag(problem: Problem, fit: Fit, draft: Draft) -> None:
    model, tp = problem.model, fit.parallel.tensor
    if uses_expert_parallel(model, fit):
        why = (
            f"DP+EP: the routed experts are split over all {fit.parallel.gpus} GPUs (EP = DP x TP); each rank's "
            "attention serves its own requests"
            if fit.parallel.expert_parallel
            else "FP8 128-wide expert blocks do not split evenly at this TP: whole experts go to GPUs instead"
            if needs_expert_parallel(model, tp)
            else "throughput: whole experts per GPU avoid slicing each expert; pays off at large batches"
        )
        draft.flags.append(Flag("--enable-expert-parallel", None, why))
    elif model.is_moe:
        draft.reasons["expert-parallel"] = (
            "off: TP 1 has no ranks to spread the experts over (vLLM's EP size is TP x DP)" if tp == 1
            else "off: at small batches TP-sliced experts keep all-to-all traffic down"
        )


def _moe_backend_flag(problem: Problem, draft: Draft) -> None:
    """Unquantized experts: vLLM 0.21 picks FlashInfer's CUTLASS MoE for them, and on a host without
    flashinfer's ahead-of-time kernel cache (the runtime does not install it: gigabytes) that engine made
    no progress for minutes after torch.compile on an H200; with Triton's fused MoE the same model served
    after ~35 s (docs/gpu-e2e.md). Quantized experts have their own kernel choice and are left to vLLM."""
    model = problem.model
    if model.is_moe and model.quantization is None:
        draft.flags.append(Flag(
            "--moe-backend", "triton",
            "unquantized experts: Triton's fused MoE is ready at once; FlashInfer's CUTLASS MoE (vLLM's pick) "
            "builds its kernels on the first start, past the start window (docs/gpu-e2e.md)",
        ))


def _model_flags(problem: Problem, draft: Draft) -> None:
    entry, gpus = problem.entry, problem.gpus
    draft.flags.extend(model_flags(problem.model, entry))
    if entry and (found := generation(gpus.compute_capability)) not in entry.architectures:
        draft.warnings.append(f"{entry.repo_id} is not known to run on {found} GPUs ({gpus.name}) with vLLM")


def _speculative_reason(problem: Problem, fit: Fit, draft: Draft) -> None:
    """Speculative decoding wins only when its draft is accepted often enough, which depends on the traffic:
    never on unmeasured; an operator's --speculative-config (or the tuner's) is an override."""
    if not problem.profile.trial_speculative or "--speculative-config" in problem.overrides:
        return
    entry = problem.entry
    draft.reasons["speculative"] = (
        "off: speculative decoding does not combine with pipeline parallelism"
        if fit.parallel.pipeline > 1
        else "off: no published draft model for this model in the catalog"
        if not (entry and entry.speculative)
        else f"off until measured: `kimi-service tune` tries the {entry.speculative.method} draft "
        f"{entry.speculative.model} ({entry.speculative.source}) and keeps it only when it wins here"
    )


def _warnings(problem: Problem, fit: Fit, draft: Draft) -> None:
    assert fit.knobs is not None
    draft.warnings.extend(_architecture_warnings(problem.model.quantization, problem.gpus, fit.knobs))
    if problem.model.weights_estimated:
        draft.warnings.append(
            "weight size estimated from config.json (no safetensors index or files): plan is approximate"
        )
    draft.warnings.extend(problem.model.notes)
    draft.warnings.extend(_client_visible_warnings(problem, fit))
    draft.warnings.extend(_idle_gpu_warnings(problem, fit))
    if fit.max_concurrency < problem.profile.target_concurrency:
        draft.warnings.append(
            f"the KV cache holds only {fit.max_concurrency} sequence(s) of {fit.max_model_len:,} tokens; "
            "more GPUs or a shorter --max-model-len allow more concurrent requests"
        )
    assert fit.budget is not None
    if fit.budget.kv_cache_bytes < FRAGILE_KV_BYTES or fit.max_concurrency < 2:
        draft.warnings.append(
            f"fragile: {gib(fit.budget.kv_cache_bytes)} of KV cache ({fit.max_concurrency} sequence(s) of "
            f"{fit.max_model_len:,} tokens); the memory reserve is an estimate good to about a GiB, so vLLM may "
            "not start or may preempt requests: leave room (more GPUs, --kv-cache-dtype fp8 where the GPU has "
            "FP8, a shorter --max-model-len)"
        )


def _client_visible_warnings(problem: Problem, fit: Fit) -> list[str]:
    """What the plan changes that a client or the operator will notice, said where it is read (warnings and
    the play's summary), not only in a flag's reason: a shorter context, and a plan that leans on the
    network between hosts."""
    warnings = []
    native = problem.model.native_max_len
    if problem.requested_len is None and fit.max_model_len < native:
        fp8 = ", --kv-cache-dtype fp8" if problem.gpus.fp8 and not fit.knobs.kv_dtype.startswith("fp8") else ""
        warnings.append(
            f"context shortened from the model's {native:,} tokens to {fit.max_model_len:,} so the KV cache holds "
            f"{fit.max_concurrency} full-length sequence(s): longer prompts are refused with 400; more GPUs{fp8} "
            "or an explicit max_model_len (fewer sequences at once) give a longer context"
        )
    spans = fit.parallel.pipeline > 1 or (fit.parallel.data > 1 and problem.nodes > 1)
    if spans:
        over = (f"pipeline stages exchange activations every token over {problem.nodes} hosts"
                if fit.parallel.pipeline > 1 else
                f"expert-parallel ranks exchange tokens every MoE layer over {problem.nodes} hosts")
        warnings.append(
            f"{over}: speed depends on the network between them (InfiniBand or RoCE with GPUDirect RDMA; "
            "plain TCP Ethernet can cut throughput several-fold); check NCCL's transport in the engine log"
        )
    return warnings


def _idle_gpu_warnings(problem: Problem, fit: Fit) -> list[str]:
    """A model far smaller than the host leaves GPUs idle: one engine per GPU group, as replicas behind the
    balancer, multiplies the sequences served at once by the number of groups."""
    used, count = fit.parallel.gpus, problem.gpus.count
    if problem.nodes > 1 or used >= count:
        return []
    idle = (f"the plan uses {used} of the {count} GPUs ({layout_label(problem.model, fit)}), leaving "
            f"{count - used} idle")
    replicas = count // used
    if replicas < 2:
        return [idle]
    group = "GPU" if used == 1 else f"{used} GPUs"
    return [
        f"{idle}: {replicas} replicas of this plan, one engine per {group}, would hold "
        f"{replicas * fit.max_concurrency} sequences of {fit.max_model_len:,} tokens at once where one engine "
        f"holds {fit.max_concurrency}; serve them behind the balancer (README: Replicas behind one endpoint; "
        "each replica a host of kimi_replicas, such as a container given its GPUs)"
    ]


def _architecture_warnings(quantization: str | None, gpus: GpuInventory, knobs: Knobs) -> list[str]:
    if gpus.assumed:
        # Nothing is known of the board but its memory: no claim about its kernels, only the assumption.
        return [gpus.assumed]
    warnings = []
    if "fp8" in (quantization or "") and not gpus.fp8:
        warnings.append(
            f"{gpus.name} (compute capability {gpus.compute_capability[0]}.{gpus.compute_capability[1]}) has no FP8: "
            "vLLM runs the FP8 weights through weight-only Marlin kernels (slower than on Hopper/Ada)"
        )
    if knobs.kv_dtype.startswith("fp8") and not gpus.fp8:
        warnings.append(
            f"FP8 KV cache was asked for but {gpus.name} has no FP8 support; expect errors or slow dequant"
        )
    return warnings
