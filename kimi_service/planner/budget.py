"""Bytes on one GPU: weights, what vLLM reserves besides them, and the KV cache that is left.

The memory model follows vLLM's own profiling: KV cache = total x gpu_memory_utilization - (weights +
peak activation + non-torch memory + CUDA graphs), per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimi_service.hardware import GIB, GpuInventory
from kimi_service.model import ModelSpec

GPU_MEMORY_UTILIZATION = 0.90  # vLLM's default; the rest is CUDA context and allocator headroom
NON_TORCH_BYTES = GIB // 2  # cuBLAS/cuDNN workspaces and allocator slack vLLM counts as non-torch memory
COMM_BYTES = GIB // 2  # NCCL and custom all-reduce buffers, only when GPUs talk to each other
CUDA_GRAPH_BASE_BYTES = 350 * 2**20
CUDA_GRAPH_PER_LAYER_BYTES = 8 * 2**20
ENCODER_BYTES = GIB  # a replicated vision encoder (--mm-encoder-tp-mode data) and its profiling
DRAFT_BYTES = 2 * GIB  # an EAGLE3 draft head is one layer plus its own KV
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for the OpenAI server
# MLA + MoE engines hold more outside weights and KV than the Llama-calibrated terms count: the MLA
# backends' prefill workspace and the fused-MoE kernels' buffers (MLA_RESERVE_BYTES), and their full and
# piecewise CUDA graphs (MLA_CUDA_GRAPH_BYTES, only when graphs are captured; vLLM measured 4.05 GiB of graphs
# in all). Calibrated with the activation term below on vLLM 0.21.0 and the DeepSeek-V3 shape of
# bench/gpu/mla_model.py (8 layers, 32 routed experts) against vLLM's `GPU KV cache size`, on an H200 and an
# H100, each with the chat plan, --enforce-eager, and --max-num-batched-tokens 16384 --max-num-seqs 512:
# -0.19% ... -1.33%, never above (docs/benchmarks.md).
MLA_RESERVE_BYTES = 4 * GIB
MLA_CUDA_GRAPH_BYTES = int(3.7 * GIB)
# Expert parallelism over data-parallel ranks: the all-to-all dispatch/combine buffers (not measured: the
# H200 test machine has one GPU), on top of the NCCL buffers every multi-GPU group has.
EP_COMM_BYTES = GIB // 2


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
    extra_bytes: int  # vision encoder, draft model, the MLA/MoE engine reserve
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


@dataclass(frozen=True)
class Knobs:
    """Everything the budget depends on besides TP/PP, after workload defaults and overrides."""

    utilization: float
    kv_dtype: str
    kv_dtype_bytes: int
    max_num_seqs: int | None
    batched_tokens: int | None
    enforce_eager: bool
    draft: bool  # a speculative draft model runs beside the target (--speculative-config): its memory is reserved
    expert_parallel: bool
    long_prefill: bool = False  # dual chunk attention past 131,072 tokens: the model card's prefill chunks


@dataclass(frozen=True)
class Parallelism:
    """TP x PP, or DP+EP: `data` engines (DP ranks) of TP `tensor` each, every one with its own copy of
    the attention, dense layers and KV cache, the routed experts sharded over all data x tensor GPUs."""

    tensor: int
    pipeline: int
    data: int = 1

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def expert_parallel(self) -> bool:
        return self.data > 1

    def describe(self, *, expert_parallel: bool = False) -> str:
        """The layout as every surface shows it (plan text and JSON, advice, exporter, dashboard, verify):
        "TP 8", "TP 8 x PP 2", "DP 8 x EP 8"; `expert_parallel` marks a TP group whose experts vLLM spreads
        whole over its TP ranks (EP = TP within each stage): "TP 8 with EP 8"."""
        if self.data > 1:
            return f"DP {self.data} x EP {self.gpus}" + (f" (TP {self.tensor} per rank)" if self.tensor > 1 else "")
        return (f"TP {self.tensor}" + (f" x PP {self.pipeline}" if self.pipeline > 1 else "")
                + (f" with EP {self.tensor}" if expert_parallel else ""))


def weights_per_gpu(model: ModelSpec, parallel: Parallelism) -> int:
    """Weight bytes on the busiest GPU. TP x PP: the body split over all GPUs, the embeddings and LM head on
    the first and last stage. DP+EP: everything but the routed experts whole on each rank (split by its
    TP), the routed experts split over every GPU."""
    tp, pp = parallel.tensor, parallel.pipeline
    if parallel.data > 1:
        return math.ceil((model.weight_bytes - model.expert_bytes) / tp) + math.ceil(model.expert_bytes / parallel.gpus)
    body = max(model.weight_bytes - 2 * model.embedding_bytes, 0)
    weights = math.ceil(body / (tp * pp)) + math.ceil(model.embedding_bytes * (2 if pp == 1 else 1) / tp)
    return min(weights, math.ceil(model.weight_bytes / tp))


def activation_bytes_per_token(model: ModelSpec, tensor_parallel: int) -> int:
    """Peak activation bytes per batched token on one TP rank during vLLM's profiling run.

    Hidden states (four copies of the hidden width) and the MLP: a dense layer's gate, up and down slices,
    or a MoE layer's per-expert slices for each of the experts a token is routed to, plus the routed copy of
    the token. MLA adds each head's decompressed query and key (nope + rope each).
    """
    tp = tensor_parallel
    values = 4 * model.hidden_size
    if model.is_moe and model.moe_intermediate_size and model.experts_per_token:
        values += model.experts_per_token * (3 * model.moe_intermediate_size // tp + model.hidden_size)
    else:
        values += 3 * model.intermediate_size // tp
    if model.attention == "mla" and model.qk_nope_head_dim and model.qk_rope_head_dim:
        heads = max(1, model.num_attention_heads // tp)
        values += heads * 2 * (model.qk_nope_head_dim + model.qk_rope_head_dim)
    return values * 2


def default_max_num_seqs(gpus: GpuInventory) -> int:
    """vLLM 0.21's max_num_seqs when none is given, for the OpenAI server on a GPU
    (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults): 1024 on 70 GiB or more but an A100, 256 otherwise.
    vLLM tells an A100 by its name; Hopper and later (compute capability 9.0 up) stand for "not an A100" here."""
    return 1024 if gpus.memory_bytes >= 70 * GIB and gpus.compute_capability >= (9, 0) else 256


def memory_budget(model: ModelSpec, gpus: GpuInventory, parallel: Parallelism, knobs: Knobs) -> MemoryBudget:
    tp, pp = parallel.tensor, parallel.pipeline
    total = gpus.memory_bytes
    usable = int(total * knobs.utilization)
    weights = weights_per_gpu(model, parallel)
    tokens = knobs.batched_tokens or DEFAULT_BATCHED_TOKENS
    seqs = knobs.max_num_seqs or default_max_num_seqs(gpus)
    # Profiling runs one batch of max_num_batched_tokens: its activations, and float32 logits for up to
    # max_num_seqs sequences.
    activation = tokens * activation_bytes_per_token(model, tp) + seqs * model.vocab_size * 4
    if parallel.data > 1:
        # The MoE layers gather every DP rank's batch (dispatch) and scatter the results back (combine).
        activation += tokens * parallel.data * model.hidden_size * 2 * 2
    graphs = (
        0
        if knobs.enforce_eager
        else CUDA_GRAPH_BASE_BYTES
        + CUDA_GRAPH_PER_LAYER_BYTES * math.ceil(model.num_layers / pp)
        + (MLA_CUDA_GRAPH_BYTES if model.attention == "mla" else 0)
    )
    comm = (COMM_BYTES if parallel.gpus > 1 else 0) + (EP_COMM_BYTES if parallel.data > 1 else 0)
    extra = (
        (ENCODER_BYTES if model.multimodal else 0)
        + (DRAFT_BYTES if knobs.draft else 0)
        + (MLA_RESERVE_BYTES if model.attention == "mla" else 0)
    )
    kv = usable - weights - activation - graphs - NON_TORCH_BYTES - comm - extra
    return MemoryBudget(
        total_bytes=total,
        usable_bytes=usable,
        weights_bytes=weights,
        activation_bytes=activation,
        cuda_graph_bytes=graphs,
        non_torch_bytes=NON_TORCH_BYTES,
        comm_bytes=comm,
        extra_bytes=extra,
        kv_cache_bytes=max(kv, 0),
    )


def kv_tokens(model: ModelSpec, budget: MemoryBudget, parallel: Parallelism, knobs: Knobs) -> int:
    per_token = model.kv_bytes_per_token(parallel.tensor, parallel.pipeline, knobs.kv_dtype_bytes)
    # vLLM allocates KV in blocks of 16 tokens.
    return budget.kv_cache_bytes // (per_token * 16) * 16
