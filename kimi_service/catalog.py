"""Models we know well enough to plan for without downloading them, keyed by Hugging Face repo id.

Each entry carries the config.json values the planner reads (tests/fixtures/models holds the full
published config.json of each, and a test checks the two agree), the checkpoint size, the flags vLLM
needs for it, and where those facts come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

AMPERE, ADA, HOPPER, BLACKWELL = "ampere", "ada", "hopper", "blackwell"


@dataclass(frozen=True)
class Speculative:
    """A published draft model for speculative decoding (used by the `latency` workload)."""

    model: str
    method: str
    num_speculative_tokens: int
    source: str


@dataclass(frozen=True)
class CatalogEntry:
    repo_id: str
    family: str  # entries of one family are variants of one model (e.g. a quantized one)
    config: Mapping[str, Any]
    weight_bytes: int
    flags: tuple[str, ...]
    architectures: tuple[str, ...]  # GPU generations it is known to run on with vLLM
    source: str
    speculative: Speculative | None = None
    flag_reasons: Mapping[str, str] = field(default_factory=dict)


def _deepseek_v3_text(**overrides: Any) -> dict[str, Any]:
    # The DeepSeek-V3 geometry Kimi K2 / K2.5 reuse (MLA: kv_lora_rank 512 + qk_rope_head_dim 64).
    base: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    base.update(overrides)
    return base


_FP8_BLOCK = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}

_KIMI_K2_TEXT = {
    "model_type": "kimi_k2",
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "vocab_size": 163840,
}

# Tool-call and reasoning parsers are not catalog facts: kimi_service.parsers derives them for every model.
_KIMI_FLAGS = ("--trust-remote-code",)
_KIMI_REASONS = {
    "--trust-remote-code": "the Kimi tokenizer (tiktoken) and config classes ship as code in the repo",
    "--mm-encoder-tp-mode": "the vision encoder is small: data-parallel copies beat TP all-reduces (recipe)",
}

ENTRIES: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        repo_id="moonshotai/Kimi-K2.5",
        family="kimi-k2",
        # huggingface.co/moonshotai/Kimi-K2.5 config.json: a KimiK25ForConditionalGeneration wrapper with
        # the DeepSeek-V3-shaped language model under text_config; routed experts are INT4
        # (compressed-tensors pack-quantized, group size 32).
        config={
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
            "vision_config": {},
            "text_config": _deepseek_v3_text(
                **_KIMI_K2_TEXT,
                max_position_embeddings=262144,
                quantization_config={
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "config_groups": {
                        "group_0": {
                            "weights": {"num_bits": 4, "group_size": 32, "type": "int", "strategy": "group"}
                        }
                    },
                    # Only the routed experts are INT4: expert parallelism shards them, the rest is replicated.
                    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
                },
            ),
        },
        # About 595 GB of safetensors (the model card's file listing; vLLM's recipe needs 8 x H200).
        weight_bytes=595 * 10**9,
        flags=(*_KIMI_FLAGS, "--mm-encoder-tp-mode", "data"),
        architectures=(AMPERE, HOPPER, BLACKWELL),
        source="vllm-project/recipes moonshotai/Kimi-K2.5.md (verified on 8xH200 TP8, GB200 TP4); HF model card",
        speculative=Speculative(
            model="lightseekorg/kimi-k2.5-eagle3",
            method="eagle3",
            num_speculative_tokens=3,
            source="vllm-project/recipes moonshotai/Kimi-K2.5.md, 'Accelerating Kimi 2.5 with Eagle3' (vLLM>=0.18)",
        ),
        flag_reasons=_KIMI_REASONS,
    ),
    CatalogEntry(
        repo_id="moonshotai/Kimi-K2-Instruct",
        family="kimi-k2",
        # huggingface.co/moonshotai/Kimi-K2-Instruct config.json: DeepseekV3ForCausalLM, FP8 block weights.
        config={
            **_deepseek_v3_text(
                **_KIMI_K2_TEXT, max_position_embeddings=131072, quantization_config=_FP8_BLOCK
            ),
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        },
        # 1.04 T parameters stored as FP8 (plus block scales): about 1.03 TB.
        weight_bytes=1_030 * 10**9,
        flags=_KIMI_FLAGS,
        architectures=(AMPERE, HOPPER, BLACKWELL),
        source="MoonshotAI/Kimi-K2 docs/deploy_guidance.md (16 x H200/H20, TP16); vllm-project/recipes Kimi-K2.md",
        flag_reasons=_KIMI_REASONS,
    ),
    CatalogEntry(
        repo_id="deepseek-ai/DeepSeek-V3",
        family="deepseek-v3",
        # huggingface.co/deepseek-ai/DeepSeek-V3 config.json (FP8 block weights, 128 MLA heads).
        config={
            **_deepseek_v3_text(model_type="deepseek_v3", quantization_config=_FP8_BLOCK),
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        },
        # 671 B parameters + the 14 B MTP module in FP8 with scales: about 688.6 GB.
        weight_bytes=688_600 * 10**6,
        flags=("--trust-remote-code",),
        architectures=(AMPERE, HOPPER, BLACKWELL),
        source="vllm-project/recipes DeepSeek/DeepSeek-V3.md (8 x H200 TP8); HF model card",
        flag_reasons={"--trust-remote-code": "the checkpoint's config class is code in the repo"},
    ),
    CatalogEntry(
        repo_id="meta-llama/Llama-3.1-8B-Instruct",
        family="llama-3.1",
        # huggingface.co/meta-llama/Llama-3.1-8B-Instruct config.json.
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        },
        weight_bytes=16_060_522_496,  # model.safetensors.index.json metadata.total_size
        flags=(),
        architectures=(AMPERE, ADA, HOPPER, BLACKWELL),
        source="HF model card; vLLM docs 'Tool Calling' (llama3_json)",
        speculative=Speculative(
            model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            method="eagle3",
            num_speculative_tokens=3,
            source="vLLM docs features/spec_decode (EAGLE draft models)",
        ),
    ),
    CatalogEntry(
        repo_id="meta-llama/Llama-3.1-70B-Instruct",
        family="llama-3.1",
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        },
        weight_bytes=141_107_412_992,  # model.safetensors.index.json metadata.total_size
        flags=(),
        architectures=(AMPERE, ADA, HOPPER, BLACKWELL),
        source="HF model card; vLLM docs 'Tool Calling' (llama3_json)",
    ),
    CatalogEntry(
        repo_id="Qwen/Qwen2.5-7B-Instruct",
        family="qwen2.5-7b",
        config={
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        },
        weight_bytes=15_231_233_024,  # model.safetensors.index.json metadata.total_size
        flags=(),
        architectures=(AMPERE, ADA, HOPPER, BLACKWELL),
        source="HF model card (32K native; YaRN to 128K is opt-in); Qwen docs: vLLM deployment (hermes parser)",
    ),
    CatalogEntry(
        repo_id="Qwen/Qwen2.5-72B-Instruct-AWQ",
        family="qwen2.5-72b",
        # AWQ checkpoints pad intermediate_size to 29696 so 4-bit groups of 128 split evenly under TP.
        config={
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 8192,
            "intermediate_size": 29696,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "torch_dtype": "float16",
            "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
        },
        # Sum of the 11 safetensors shards in the HF file listing: about 41.6 GB.
        weight_bytes=41_600 * 10**6,
        flags=(),
        architectures=(AMPERE, ADA, HOPPER, BLACKWELL),
        source="HF model card and file listing; vLLM picks the awq_marlin kernel on Ampere and newer",
    ),
    CatalogEntry(
        repo_id="MiniMaxAI/MiniMax-M2",
        family="minimax-m2",
        # huggingface.co/MiniMaxAI/MiniMax-M2 config.json: 256 experts of 1536, GQA 48/8 heads, FP8 blocks.
        config={
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config"},
            "hidden_size": 3072,
            "intermediate_size": 1536,
            "num_hidden_layers": 62,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 256,
            "num_experts_per_tok": 8,
            "vocab_size": 200064,
            "max_position_embeddings": 196608,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "quantization_config": {**_FP8_BLOCK, "fmt": "float8_e4m3fn"},
        },
        # 230 B parameters in FP8 with block scales: about 230 GB.
        weight_bytes=230 * 10**9,
        flags=("--trust-remote-code",),
        architectures=(AMPERE, HOPPER, BLACKWELL),
        source="vllm-project/recipes MiniMax/MiniMax-M2.md (TP4; TP8 with --enable-expert-parallel)",
        flag_reasons={
            "--trust-remote-code": "the config and model classes ship as code in the repo",
        },
    ),
)

_BY_NAME = {entry.repo_id.lower(): entry for entry in ENTRIES}


def get(name: str) -> CatalogEntry | None:
    """The entry for a repo id (case-insensitive), or None."""
    return _BY_NAME.get(name.strip().lower())


def names() -> list[str]:
    return [entry.repo_id for entry in ENTRIES]


def family(name: str) -> list[CatalogEntry]:
    return [entry for entry in ENTRIES if entry.family == name]

