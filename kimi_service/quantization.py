"""Bytes per parameter of a checkpoint: which tensors its quantization_config quantizes, and how wide.

Quantized checkpoints keep some tensors at the activation dtype: the embeddings and the LM head always
(vLLM quantizes neither), the MoE router, and whatever `ignore` (compressed-tensors), `ignored_layers`
(fp8), `modules_to_not_convert` (mxfp4, awq, bitsandbytes), `exclude_modules` (modelopt) or
`llm_int8_skip_modules` name: often the attention, shared experts or the dense MLP layers. Widths include
the scales the format stores with its weights. A quant_method the planner does not know is costed at the
activation dtype (an upper bound) and says so in `warning`, never silently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Parameter groups of a transformer, as model.parameter_groups() counts them.
QUANTIZABLE = ("attention", "mlp", "experts", "shared_experts")
_LAYER = re.compile(r"layers\.(\d+)\.")
_SKIP_KEYS = ("ignore", "ignored_layers", "modules_to_not_convert", "exclude_modules", "llm_int8_skip_modules")


@dataclass(frozen=True)
class Scheme:
    label: str | None  # "fp8", "mxfp4", "modelopt nvfp4", "awq int4", ...; None when unquantized
    bytes_per_weight: float | None  # quantized linear weights with their scales; None: activation dtype
    # Quantizable groups the checkpoint keeps at the activation dtype: group -> layers kept (None: all).
    kept: Mapping[str, frozenset[int] | None] = field(default_factory=dict)
    warning: str | None = None

    def kept_fraction(self, group: str, layers: int) -> float:
        if self.bytes_per_weight is None or group not in QUANTIZABLE:
            return 1.0
        if group not in self.kept:
            return 0.0
        chosen = self.kept[group]
        return 1.0 if chosen is None else min(len(chosen) / max(layers, 1), 1.0)


def _group_of(name: str) -> str | None:
    name = name.removeprefix("re:")
    if re.search(r"vision|visual|multi_modal|mm_projector|router|e_score|(^|\.)gate$|mlp\.gate(?!_)", name):
        return None  # the vision tower, and the router: not counted, or kept anyway
    if re.search(r"(self_attn|\battn\b|attention|[qkvo]_proj|qkv|kv_[ab]_proj|q_[ab]_proj)", name):
        return "attention"
    if "shared_expert" in name:
        return "shared_experts"
    if "experts" in name:
        return "experts"
    if re.search(r"(gate|up|down|gate_up)_proj|\bmlp\b", name):
        return "mlp"
    return None  # lm_head, embeddings, router, norms: kept at the activation dtype anyway


def _kept(quant: Mapping[str, Any]) -> dict[str, frozenset[int] | None]:
    names: list[str] = []
    for key in _SKIP_KEYS:
        value = quant.get(key)
        if isinstance(value, list):
            names.extend(str(item) for item in value)
    found: dict[str, set[int] | None] = {}
    for name in names:
        group = _group_of(name)
        if group is None:
            continue
        index = _LAYER.search(name)
        if index is None or found.get(group, set()) is None:
            found[group] = None
        else:
            found.setdefault(group, set())
            found[group].add(int(index.group(1)))  # type: ignore[union-attr]
    return {group: None if layers is None else frozenset(layers) for group, layers in found.items()}


def _int_width(bits: int, group_size: Any, zero_point: bool) -> float:
    """Packed integer weights plus a 16-bit scale (and a packed zero point) per group."""
    width = bits / 8
    if isinstance(group_size, int) and group_size > 0:
        width += (2 + (bits / 8 if zero_point else 0)) / group_size
    return width


NVFP4 = 0.5 + 1 / 16  # E2M1 values and one FP8 scale per 16
MXFP4 = 0.5 + 1 / 32  # E2M1 values and one E8M0 scale per 32


def _compressed_tensors(quant: Mapping[str, Any]) -> tuple[str, float]:
    # Checkpoints in the wild carry odd shapes here; what is not a group of weights is left out.
    groups = quant.get("config_groups")
    groups = [g for g in groups.values() if isinstance(g, Mapping)] if isinstance(groups, Mapping) else []
    weights = [g["weights"] for g in groups if isinstance(g.get("weights"), Mapping)]

    def width(w: Mapping[str, Any]) -> int:
        bits = w.get("num_bits")
        return bits if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0 else 16

    bits = min((width(w) for w in weights), default=16)
    kind = next((str(w.get("type") or "int") for w in weights if width(w) == bits), "int")
    size = next((w.get("group_size") for w in weights if width(w) == bits), None)
    symmetric = all(w.get("symmetric", True) for w in weights)
    if bits == 4 and (kind == "float" or "nvfp4" in str(quant.get("format", ""))):
        return "compressed-tensors nvfp4", NVFP4
    if bits == 4:
        return "compressed-tensors int4", _int_width(4, size, not symmetric)
    if bits == 8:
        return f"compressed-tensors {'fp8' if kind == 'float' else 'int8'}", 1.0
    return "compressed-tensors", 2.0 if bits >= 16 else bits / 8


def _modelopt(quant: Mapping[str, Any]) -> tuple[str, float | None]:
    nested = quant.get("quantization") if isinstance(quant.get("quantization"), Mapping) else {}
    algo = str(quant.get("quant_algo") or nested.get("quant_algo") or "").upper()
    if algo.startswith("FP8"):
        return "modelopt fp8", 1.0
    if algo == "NVFP4":
        return "modelopt nvfp4", NVFP4
    if algo == "MXFP8":
        return "modelopt mxfp8", 1 + 1 / 32
    return f"modelopt {algo.lower() or '?'}", None


def _integer_method(method: str, quant: Mapping[str, Any]) -> tuple[str, float]:
    bits = int(quant.get("bits") or quant.get("w_bit") or 4)
    size = quant.get("group_size", quant.get("q_group_size", 128))
    # AWQ stores zero points when zero_point is set; GPTQ stores qzeros whatever `sym` says.
    zero_point = bool(quant.get("zero_point", True)) if method.startswith("awq") else True
    return f"{method.split('_')[0]} int{bits}", _int_width(bits, size, zero_point)


def _bitsandbytes(quant: Mapping[str, Any]) -> tuple[str, float]:
    if quant.get("load_in_8bit"):
        return "bitsandbytes int8", 1.0
    kind = str(quant.get("bnb_4bit_quant_type") or "nf4")
    # One absmax per 64 weights: float32, or 8 bits plus a float32 per 256 blocks with double quantization.
    absmax = (1 + 4 / 256) / 64 if quant.get("bnb_4bit_use_double_quant") else 4 / 64
    return f"bitsandbytes {kind}", 0.5 + absmax


def scheme(quant: Any) -> Scheme:
    """The scheme of a config's quantization_config (None or absent: unquantized)."""
    if not isinstance(quant, Mapping):
        return Scheme(None, None)
    method = str(quant.get("quant_method") or "compressed-tensors").lower()
    label: str | None
    width: float | None
    if method in ("fp8", "fbgemm_fp8", "ptpc_fp8", "deepgemm_fp8"):
        label, width = "fp8", 1.0
    elif method == "compressed-tensors":
        label, width = _compressed_tensors(quant)
    elif method == "modelopt":
        label, width = _modelopt(quant)
    elif method == "modelopt_fp4":
        label, width = "modelopt nvfp4", NVFP4
    elif method == "mxfp4":
        label, width = "mxfp4", MXFP4
    elif method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "gptq_bitblas", "marlin",
                    "moe_wna16", "auto-round"):
        label, width = _integer_method(method, quant)
    elif method == "bitsandbytes":
        label, width = _bitsandbytes(quant)
    else:
        label, width = method, None
    if width is None:
        return Scheme(label, None, warning=(
            f"quantization {label!r} is not one the planner knows: its weights are costed at the activation "
            "dtype (16-bit), an upper bound; a safetensors index in the model directory gives the true size"
        ))
    return Scheme(label, width, kept=_kept(quant))
