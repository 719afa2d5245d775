"""How long a model's context is and which layers cache every token, read as transformers and vLLM read them.

- The language model's config: `text_config` when a wrapper nests it, with the fields its model type leaves
  out filled from transformers' defaults for that type (Google publishes Gemma 3 with most fields absent).
- The context: vLLM's `_get_and_verify_max_len` (vllm/config/model.py): the smallest of the length keys
  present, then `rope_scaling` / `rope_parameters`: every rope type but `su`, `longrope` and `llama3`
  multiplies it by `factor`, and YaRN starts from `original_max_position_embeddings`; Gemma 3's length
  is already the scaled one, so vLLM skips the factor for model types containing "gemma3".
- Sliding-window layers: `layer_types`, Gemma 3's `sliding_window_pattern`, Gemma 2's alternation, Qwen2's
  `max_window_layers`, or (Mistral 7B v0.1) every layer. vLLM's hybrid KV cache manager keeps only the
  window (plus one prefill chunk) of those layers per sequence.
- Linear-attention layers (Qwen3-Next's Gated DeltaNet): `layer_types` "linear_attention", or every layer but
  each `full_attention_interval`-th (transformers' Qwen3NextConfig). They cache no tokens: each sequence holds
  a fixed recurrent state instead (vLLM's conv and SSM state, `MambaSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# transformers' Gemma3TextConfig defaults (models/gemma3/configuration_gemma3.py, v4.50): what a Gemma 3
# text_config that leaves a field out gets when transformers (and so vLLM) loads it.
_GEMMA3_TEXT = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
TEXT_DEFAULTS: dict[str, Mapping[str, Any]] = {"gemma3_text": _GEMMA3_TEXT}
# The text model type a multimodal wrapper implies when its text_config does not name one.
_TEXT_TYPE_OF = {"gemma3": "gemma3_text"}

# vLLM's possible_keys, in its order; the smallest one present is the model's length.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_NOT_EXTENDING = ("su", "longrope", "llama3")
VLLM_DEFAULT_LEN = 2048


def language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: text_config (or the config itself) over its model type's defaults."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        text = config
    model_type = str(text.get("model_type") or _TEXT_TYPE_OF.get(str(config.get("model_type")), ""))
    defaults = TEXT_DEFAULTS.get(model_type)
    return {**defaults, **text} if defaults else text


@dataclass(frozen=True)
class Context:
    length: int
    why: str  # how the length was derived, for people
    assumed: bool = False  # no length key at all: vLLM's 2,048 default


def _rope(text: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return []
    # transformers v5 may key rope_parameters by layer type ({"full_attention": {...}, ...}).
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        return list(rope.values())
    return [rope]


def context(text: Mapping[str, Any]) -> Context:
    """The longest context vLLM serves without VLLM_ALLOW_LONG_MAX_MODEL_LEN."""
    found = [(key, text[key]) for key in _LENGTH_KEYS if isinstance(text.get(key), int) and text[key] > 0]
    if not found:
        return Context(VLLM_DEFAULT_LEN, "no context length in config.json: vLLM assumes 2,048", assumed=True)
    key, length = min(found, key=lambda item: item[1])
    why = f"{key} {length:,}"
    if "gemma3" in str(text.get("model_type", "")):
        return Context(length, why + " (Gemma 3's length already includes its RoPE scaling)")
    factor, extending = 1.0, []
    for rope in _rope(text):
        kind = str(rope.get("rope_type") or rope.get("type") or "default")
        if kind in _NOT_EXTENDING:
            continue
        factor = float(rope.get("factor", factor))
        if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
            length = rope["original_max_position_embeddings"]
            why = f"original_max_position_embeddings {length:,}"
        extending.append(kind)
    if factor == 1.0:
        return Context(length, why)
    return Context(int(length * factor), f"{why} x {extending[-1]} RoPE factor {factor:g}")


@dataclass(frozen=True)
class SlidingWindow:
    layers: int  # layers that attend over the window only
    window: int


def sliding_window(text: Mapping[str, Any], layers: int) -> SlidingWindow | None:
    window = text.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or text.get("use_sliding_window") is False:
        return None
    types = _layer_types(text, layers)
    model_type = str(text.get("model_type", ""))
    if types is not None:
        sliding = sum(1 for kind in types if kind == "sliding_attention")
    elif isinstance(text.get("sliding_window_pattern"), int) and text["sliding_window_pattern"] > 0:
        # Gemma 3: every pattern-th layer is global, the others local.
        sliding = layers - layers // text["sliding_window_pattern"]
    elif model_type == "gemma2":
        sliding = (layers + 1) // 2  # even-numbered layers are local
    elif isinstance(text.get("max_window_layers"), int) and text.get("use_sliding_window"):
        sliding = max(layers - text["max_window_layers"], 0)  # Qwen2: layers from max_window_layers on
    else:
        sliding = layers  # Mistral 7B v0.1: every layer
    return SlidingWindow(sliding, window) if sliding and window < context(text).length else None


def _layer_types(text: Mapping[str, Any], layers: int) -> list[str] | None:
    types = text.get("layer_types")
    return types if isinstance(types, list) and len(types) == layers else None


@dataclass(frozen=True)
class LinearAttention:
    layers: int  # layers holding a recurrent state instead of a KV cache
    state_values: int  # one such layer's state for one sequence at TP 1: conv state + SSM state


def linear_attention(text: Mapping[str, Any], layers: int) -> LinearAttention | None:
    """Gated DeltaNet layers and their per-sequence state, or None for a model whose every layer attends."""
    types = _layer_types(text, layers)
    interval = text.get("full_attention_interval")
    if types is not None:
        count = sum(1 for kind in types if kind == "linear_attention")
    elif isinstance(interval, int) and interval > 0:
        count = layers - layers // interval  # layer i attends fully when (i + 1) % interval == 0
    else:
        return None
    if not count:
        return None
    key_heads, key_dim = int(text.get("linear_num_key_heads") or 0), int(text.get("linear_key_head_dim") or 0)
    value_heads, value_dim = int(text.get("linear_num_value_heads") or 0), int(text.get("linear_value_head_dim") or 0)
    kernel = int(text.get("linear_conv_kernel_dim") or 0)
    # vLLM's GatedDeltaNet state: the causal conv's last kernel-1 inputs over q, k and v, and one
    # key_dim x value_dim matrix per value head (mamba_utils.gated_delta_net_state_shape).
    conv = (2 * key_heads * key_dim + value_heads * value_dim) * max(kernel - 1, 0)
    return LinearAttention(count, conv + value_heads * key_dim * value_dim)


def dual_chunk(text: Mapping[str, Any]) -> bool:
    """Qwen's dual chunk attention (the -1M models): long contexts are prefilled in very large chunks."""
    return isinstance(text.get("dual_chunk_attention_config"), Mapping)
