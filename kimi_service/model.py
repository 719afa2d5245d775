"""What a model needs: geometry, weight bytes and KV-cache bytes per token, from its `config.json`.

A model is a directory (config.json, and the safetensors index or files for the weight size) or a
catalog name, which plans without downloading anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kimi_service import catalog, geometry, quantization
from kimi_service.errors import UsageError
from kimi_service.parsers import Parsers, choose_parsers, template_text
from kimi_service.untrusted import read_bytes, read_json

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}
# The shape fields read from config.json besides the four required ones: whole numbers when present
# (0 reads as absent), below int32's limit as in the engine's own tensors.
_SHAPE_FIELDS = (
    "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "kv_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
    "n_routed_experts", "num_local_experts", "num_experts", "intermediate_size_mlp", "interleave_moe_layer_step",
    "decoder_sparse_step", "moe_layer_freq", "full_attention_interval", "linear_num_key_heads",
    "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim",
)
_MLA_FIELDS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MAX_SHAPE = 2**31 - 1


@dataclass(frozen=True)
class ModelSpec:
    """The facts about a model the planner needs; nothing else."""

    name: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str  # "mla" (DeepSeek-V3 latent attention) or "gqa" (incl. MHA/MQA)
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    native_max_len: int
    weight_bytes: int
    weight_bytes_source: (
        str  # "safetensors index", "safetensors files", "catalog", "estimated from config.json"
    )
    dtype: str
    quantization: str | None  # e.g. "compressed-tensors int4", "awq int4", "gptq int4", "fp8"
    is_moe: bool
    num_experts: int | None
    experts_per_token: int | None
    moe_intermediate_size: int | None
    multimodal: bool
    trust_remote_code: bool
    source: str  # where these facts came from, for people
    catalog_name: str | None = None
    # A directory recognised as a catalog model by its shapes: the entry supplies flags, never the name.
    matched_by_shape: bool = False
    served_name: str = ""  # the name clients ask for when the operator gives none
    context_why: str = ""  # how native_max_len was derived (length keys, RoPE scaling)
    sliding_window: int | None = None
    sliding_window_layers: int = 0  # layers that cache only the window
    dual_chunk_attention: bool = False
    notes: tuple[str, ...] = ()  # assumptions the estimate makes, warned about in every plan
    # The routed experts' share of weight_bytes: what expert parallelism shards over its ranks (the
    # attention, dense layers, shared experts, router and embeddings are replicated on every DP rank).
    expert_bytes: int = 0
    # MLA's per-head query/key width besides rope: what the attention's prefill activations scale with.
    qk_nope_head_dim: int | None = None
    linear_attention_layers: int = 0  # layers holding a recurrent state per sequence instead of a KV cache
    linear_state_values: int = 0  # one such layer's state for one sequence at TP 1
    parsers: Parsers = field(default_factory=Parsers)  # tool-call and reasoning parsers (kimi_service.parsers)

    @property
    def cached_layers(self) -> int:
        """Layers whose KV cache grows with the sequence (full or sliding-window attention)."""
        return self.num_layers - self.linear_attention_layers

    @property
    def weights_estimated(self) -> bool:
        return self.weight_bytes_source.startswith("estimated")

    @property
    def kv_dtype_bytes(self) -> int:
        # vLLM's default KV dtype follows the activation dtype: 2 bytes unless the model runs in float32.
        return 4 if self.dtype in ("float32", "float") else 2

    def kv_bytes_per_token(
        self, tensor_parallel: int = 1, pipeline_parallel: int = 1, kv_dtype_bytes: int = 0
    ) -> int:
        """KV-cache bytes one token occupies on one GPU of a TP x PP group.

        MLA caches one latent vector (kv_lora_rank + qk_rope_head_dim) per layer; vLLM treats it as a
        single KV head, which every TP rank keeps whole (ModelConfig.get_num_kv_heads returns 1 for MLA),
        so TP does not divide it. GQA heads are split across TP ranks, at least one per rank (replicated
        when there are fewer KV heads than ranks). PP divides the layers; the busiest stage gets the ceiling.
        """
        per_value = kv_dtype_bytes or self.kv_dtype_bytes
        layers = math.ceil(self.cached_layers / pipeline_parallel)
        if self.attention == "mla":
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * per_value
        heads_per_rank = max(1, self.num_kv_heads // tensor_parallel)
        return 2 * layers * heads_per_rank * self.head_dim * per_value

    def kv_bytes_per_sequence(
        self, length: int, *, tensor_parallel: int = 1, pipeline_parallel: int = 1, kv_dtype_bytes: int = 0,
        window_slack: int = 0,
    ) -> int:
        """KV bytes one sequence of `length` tokens occupies on the busiest GPU.

        Sliding-window layers hold at most the window plus one prefill chunk (`window_slack`, vLLM's
        max_num_batched_tokens: SlidingWindowSpec.max_memory_usage_bytes); full-attention layers the whole
        sequence; linear-attention layers their recurrent state, whatever the length. Each kind is split
        over PP stages rounding up, so the figure never undercounts.
        """
        state = self.linear_state_bytes(tensor_parallel, pipeline_parallel)
        if not self.sliding_window_layers or self.sliding_window is None:
            return self.kv_bytes_per_token(tensor_parallel, pipeline_parallel, kv_dtype_bytes) * length + state
        per_layer = self.kv_bytes_per_token(tensor_parallel, 1, kv_dtype_bytes) // self.cached_layers
        full = math.ceil((self.cached_layers - self.sliding_window_layers) / pipeline_parallel)
        local = math.ceil(self.sliding_window_layers / pipeline_parallel)
        return per_layer * (full * length + local * min(length, self.sliding_window + window_slack)) + state

    def linear_state_bytes(self, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> int:
        """One sequence's recurrent state on the busiest GPU: split over TP by heads, kept at the model's
        dtype (vLLM's mamba cache dtype follows the model's, not --kv-cache-dtype)."""
        layers = math.ceil(self.linear_attention_layers / pipeline_parallel)
        return layers * math.ceil(self.linear_state_values / tensor_parallel) * self.kv_dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        """One vocab x hidden matrix at the checkpoint dtype (the embedding or the LM head)."""
        return self.vocab_size * self.hidden_size * _DTYPE_BYTES.get(self.dtype, 2)


def _quantization(config: Mapping[str, Any], text: Mapping[str, Any]) -> quantization.Scheme:
    return quantization.scheme(config.get("quantization_config") or text.get("quantization_config"))


def _int(text: Mapping[str, Any], key: str, what: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_SHAPE:
        raise UsageError(
            f"config.json has no usable {key!r} ({what}): got {_show(value)}; is this a causal language model?"
        )
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_shape_fields(config: Mapping[str, Any], text: Mapping[str, Any]) -> None:
    """Refuse, naming the key, what config.json holds where a shape or a name belongs."""
    for key in _SHAPE_FIELDS:
        value = text.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_SHAPE):
            raise UsageError(f"config.json: {key} is {_show(value)}; expected a whole number from 0 to "
                             f"{MAX_SHAPE:,}")
    if text.get("kv_lora_rank"):
        missing = [key for key in _MLA_FIELDS if not text.get(key)]
        if missing:
            raise UsageError(f"config.json: kv_lora_rank (latent attention) needs {', '.join(missing)} too")
    for key in ("torch_dtype", "dtype", "model_type"):
        for where in (config, text):
            if where.get(key) is not None and not isinstance(where[key], str):
                raise UsageError(f"config.json: {key} is {_show(where[key])}; expected a string")
    for where in (config, text):
        names = where.get("architectures")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise UsageError(f"config.json: architectures is {_show(names)}; expected a list of class names")


def _attention_parameters(text: Mapping[str, Any], hidden: int, heads: int) -> int:
    if text.get("kv_lora_rank"):
        nope, rope, value = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
        q_lora = text.get("q_lora_rank")
        query = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        kv = hidden * (text["kv_lora_rank"] + rope) + text["kv_lora_rank"] * heads * (nope + value)
        return query + kv + heads * value * hidden
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _linear_attention_parameters(text: Mapping[str, Any], hidden: int) -> int:
    """A Gated DeltaNet layer: the q/k/v/z and beta/alpha input projections, the causal conv, the output."""
    keys = int(text.get("linear_num_key_heads") or 0) * int(text.get("linear_key_head_dim") or 0)
    value_heads = int(text.get("linear_num_value_heads") or 0)
    values = value_heads * int(text.get("linear_value_head_dim") or 0)
    conv = (2 * keys + values) * int(text.get("linear_conv_kernel_dim") or 0)
    return hidden * (2 * keys + 2 * values) + hidden * 2 * value_heads + conv + values * hidden


def moe_layer_count(text: Mapping[str, Any], layers: int) -> int:
    """The layers that hold experts, as transformers and vLLM place them: an explicit `moe_layers` list
    (Llama 4); every `interleave_moe_layer_step`-th (Llama 4) or `decoder_sparse_step`-th layer not in
    `mlp_only_layers` (Qwen2/3-MoE, Qwen3-Next); from `first_k_dense_replace` on, every `moe_layer_freq`-th
    (DeepSeek V2/V3, GLM-4.5, Kimi). Other MoE models put experts in every layer."""
    if not _num_experts(text):
        return 0
    listed = text.get("moe_layers")
    if isinstance(listed, list):
        return len({index for index in listed if isinstance(index, int) and 0 <= index < layers})
    step = int(text.get("interleave_moe_layer_step") or text.get("decoder_sparse_step") or 1)
    first = int(text.get("first_k_dense_replace") or 0)
    every = int(text.get("moe_layer_freq") or 1)
    dense = set(_index_list(text, "mlp_only_layers"))
    return sum(1 for i in range(layers) if i >= first and i % every == 0 and (i + 1) % step == 0 and i not in dense)


def _index_list(text: Mapping[str, Any], key: str) -> list[int]:
    value = text.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise UsageError(f"config.json: {key} is {_show(value)}; expected a list of layer numbers")
    return value


def parameter_groups(text: Mapping[str, Any]) -> dict[str, int]:
    """Parameters by what they are (norms and biases left out: under 0.1%), so each can have its own width."""
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    vocab = int(text["vocab_size"])
    embed = vocab * hidden
    linear = geometry.linear_attention(text, layers)
    linear_layers = linear.layers if linear else 0
    attention = (layers - linear_layers) * _attention_parameters(text, hidden, int(text["num_attention_heads"]))
    if linear_layers:
        attention += linear_layers * _linear_attention_parameters(text, hidden)
    groups = {"embed": embed, "lm_head": 0 if text.get("tie_word_embeddings") else embed, "attention": attention}
    # Llama 4's dense layers are wider than its experts (intermediate_size_mlp vs intermediate_size).
    dense_mlp = 3 * hidden * int(text.get("intermediate_size_mlp") or text.get("intermediate_size") or 4 * hidden)
    experts = _num_experts(text)
    moe_layers = moe_layer_count(text, layers)
    if not experts or not moe_layers:
        return {**groups, "mlp": layers * dense_mlp}
    moe_inter = int(text.get("moe_intermediate_size") or text.get("intermediate_size"))
    # Shared experts: Qwen2-MoE and Qwen3-Next give one expert's width, DeepSeek and GLM a count of
    # routed-width experts; Llama 4 has one shared expert as wide as a routed one in every MoE layer.
    shared = int(text.get("n_shared_experts") or (1 if str(text.get("model_type")) == "llama4_text" else 0))
    shared_inter = int(text.get("shared_expert_intermediate_size") or shared * moe_inter)
    return {
        **groups,
        "mlp": (layers - moe_layers) * dense_mlp,
        "experts": moe_layers * experts * moe_inter * 3 * hidden,
        "shared_experts": moe_layers * shared_inter * 3 * hidden,
        "router": moe_layers * hidden * experts,
    }


def estimate_parameters(text: Mapping[str, Any]) -> int:
    """Parameter count from the config's shapes (norms and biases left out: under 0.1%)."""
    return sum(parameter_groups(text).values())


def group_bytes(text: Mapping[str, Any], scheme: quantization.Scheme, dtype: str) -> dict[str, float]:
    """Checkpoint bytes of each parameter group: quantized groups at the scheme's width, the rest at the
    checkpoint dtype."""
    wide = float(_DTYPE_BYTES.get(dtype, 2))
    narrow = scheme.bytes_per_weight or wide
    layers = int(text["num_hidden_layers"])
    result = {}
    for group, count in parameter_groups(text).items():
        kept = scheme.kept_fraction(group, layers)
        result[group] = count * (kept * wide + (1 - kept) * narrow)
    return result


def estimate_weight_bytes(text: Mapping[str, Any], scheme: quantization.Scheme, dtype: str) -> int:
    """Checkpoint bytes: quantized groups at the scheme's width, the rest at the checkpoint dtype."""
    return int(sum(group_bytes(text, scheme, dtype).values()))


def expert_share(text: Mapping[str, Any], scheme: quantization.Scheme, dtype: str) -> float:
    """The routed experts' fraction of the checkpoint's bytes (0 for a dense model); it scales a measured
    weight size (safetensors index, catalog) as well as an estimated one."""
    groups = group_bytes(text, scheme, dtype)
    total = sum(groups.values())
    return groups.get("experts", 0.0) / total if total else 0.0


def _num_experts(text: Mapping[str, Any]) -> int | None:
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = text.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return None


def spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str,
    weight_bytes: int | None,
    weight_bytes_source: str,
    source: str,
    catalog_name: str | None = None,
    chat_template: str | None = None,
) -> ModelSpec:
    """ModelSpec from a parsed config.json (and the chat template, None when there is none to read);
    weight_bytes None means estimate it from the shapes."""
    text = geometry.language_config(config)
    architectures = config.get("architectures") or text.get("architectures") or ["unknown"]
    layers = _int(text, "num_hidden_layers", "number of layers")
    hidden = _int(text, "hidden_size", "hidden size")
    heads = _int(text, "num_attention_heads", "attention heads")
    _int(text, "vocab_size", "vocabulary size")
    check_shape_fields(config, text)
    mla = bool(text.get("kv_lora_rank"))
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    scheme = _quantization(config, text)
    notes = [scheme.warning] if scheme.warning else []
    context = geometry.context(text)
    if context.assumed:
        notes.append(f"{context.why}; pass --max-model-len if the model is longer")
    if weight_bytes is None:
        weight_bytes = estimate_weight_bytes(text, scheme, dtype)
        weight_bytes_source = "estimated from config.json"
    expert_bytes = int(weight_bytes * expert_share(text, scheme, dtype))
    window = geometry.sliding_window(text, layers)
    linear = geometry.linear_attention(text, layers)
    if linear and not linear.state_values:
        notes.append(f"{linear.layers} linear-attention layers without linear_* head sizes in config.json: their "
                     "per-sequence state is not counted")
    experts = _num_experts(text) if moe_layer_count(text, layers) else None
    per_token = text.get("num_experts_per_tok") or text.get("experts_per_token")
    return ModelSpec(
        name=name,
        architecture=str(architectures[0]),
        model_type=str(config.get("model_type") or text.get("model_type") or "unknown"),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        vocab_size=int(text["vocab_size"]),
        num_attention_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        attention="mla" if mla else "gqa",
        kv_lora_rank=int(text["kv_lora_rank"]) if mla else None,
        qk_rope_head_dim=int(text["qk_rope_head_dim"]) if mla else None,
        native_max_len=context.length,
        weight_bytes=weight_bytes,
        weight_bytes_source=weight_bytes_source,
        dtype=dtype,
        quantization=scheme.label,
        is_moe=experts is not None,
        num_experts=experts,
        experts_per_token=int(per_token) if experts and per_token else None,
        moe_intermediate_size=int(text["moe_intermediate_size"]) if text.get("moe_intermediate_size") else None,
        multimodal="text_config" in config or "vision_config" in config,
        trust_remote_code="auto_map" in config,
        source=source,
        catalog_name=catalog_name,
        served_name=name,
        context_why=context.why,
        sliding_window=window.window if window else None,
        sliding_window_layers=window.layers if window else 0,
        dual_chunk_attention=geometry.dual_chunk(text),
        notes=tuple(notes),
        expert_bytes=expert_bytes,
        qk_nope_head_dim=int(text["qk_nope_head_dim"]) if mla else None,
        linear_attention_layers=linear.layers if linear else 0,
        linear_state_values=linear.state_values if linear else 0,
        parsers=choose_parsers(config, chat_template),
    )


def _weight_bytes(directory: Path) -> tuple[int | None, str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = read_json(index)
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"cannot read {index}: {exc}; re-download the model or remove the broken index"
            ) from exc
        metadata = data.get("metadata") if isinstance(data, dict) else None
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if isinstance(total, int) and total > 0:
            return total, "safetensors index"
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return sum(f.stat().st_size for f in files), "safetensors files"
    gguf = sorted(directory.glob("*.gguf"))
    if gguf:
        return sum(f.stat().st_size for f in gguf), "gguf file" if len(gguf) == 1 else "gguf files"
    return None, "estimated from config.json"


def _with_modelopt_config(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """ModelOpt exports describe their quantization in hf_quant_config.json; vLLM reads it when config.json
    has no quantization_config (ModelOptFp8Config / ModelOptNvFp4Config), and so does the planner."""
    path = directory / "hf_quant_config.json"
    if "quantization_config" in config or not path.is_file():
        return config
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}; it must be ModelOpt's JSON quantization config") from exc
    quant = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(quant, dict):
        return config
    return {**config, "quantization_config": {"quant_method": "modelopt", **quant}}


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise UsageError(f"{directory} has no config.json: point --model at a Hugging Face model directory")
    try:
        config = read_json(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}; it must be the model's JSON config") from exc
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object; it must be the model's config")
    return config


# Published chat templates are tens of kilobytes; a larger one is not a template this planner reads.
MAX_TEMPLATE_BYTES = 1 << 20


def _read_chat_template(directory: Path) -> str | None:
    """The directory's chat template (chat_template.jinja, else tokenizer_config.json's), None without one:
    its tool-call and thinking markers choose the parsers."""
    jinja, tokenizer = directory / "chat_template.jinja", directory / "tokenizer_config.json"
    try:
        template_file = (read_bytes(jinja, limit=MAX_TEMPLATE_BYTES).decode("utf-8", errors="replace")
                         if jinja.is_file() else None)
        tokenizer_config = read_json(tokenizer) if tokenizer.is_file() and template_file is None else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the chat template in {directory}: {exc}; re-download the model's "
                         "tokenizer files") from exc
    return template_text(tokenizer_config, template_file)


@dataclass(frozen=True)
class Origin:
    """The hub repository a model directory holds (the weights' copy, or the hub's small files): the repo id
    names the model and finds its catalog entry, so nothing has to recognise it by its shapes."""

    repo: str
    commit: str = ""
    # The listed sizes of the safetensors files: the checkpoint's size where no weights are on disk.
    weight_bytes: int | None = None


def inspect_model(path_or_repo_id: str, origin: Origin | None = None) -> ModelSpec:
    """ModelSpec for a model directory (of `origin`'s repository when given) or a catalog name (a Hugging
    Face repo id). Raises UsageError."""
    try:
        directory = Path(path_or_repo_id).expanduser()
    except RuntimeError:  # `~name/...` for a user this host lacks
        raise UsageError(f"{path_or_repo_id}: no such user's home directory") from None
    if directory.is_dir():
        config = _with_modelopt_config(_read_config(directory), directory)
        weight_bytes, weight_source = _weight_bytes(directory)
        chat_template = _read_chat_template(directory)
        if origin and origin.weight_bytes:
            weight_bytes, weight_source = origin.weight_bytes, "hub listing (safetensors file sizes)"
        try:
            spec = spec_from_config(
                config,
                name=origin.repo if origin else str(directory),
                weight_bytes=weight_bytes,
                weight_bytes_source=weight_source,
                source=f"{origin.repo}@{origin.commit or 'local'} config.json" if origin
                else f"{directory / 'config.json'}",
                chat_template=chat_template,
            )
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            # What check_shape_fields does not foresee still ends as bad input, not a traceback.
            raise UsageError(f"{directory / 'config.json'}: a field has an unexpected value "
                             f"({type(exc).__name__}: {_show(str(exc))}); is this a Hugging Face model "
                             "config?") from None
        spec = replace(spec, served_name=origin.repo if origin else directory.resolve().name)
        if weight_source.startswith("gguf"):
            spec = replace(spec, quantization="gguf", notes=(*spec.notes, *_gguf_notes(weight_source)))
        if origin:
            entry = catalog.get(origin.repo)
            return replace(spec, catalog_name=entry.repo_id if entry else None)
        entry = catalog_entry_for(spec)
        return spec if entry is None else replace(spec, catalog_name=entry.repo_id, matched_by_shape=True)
    entry = catalog.get(path_or_repo_id)
    if entry is None:
        raise UsageError(
            f"--model {path_or_repo_id!r} is neither a directory nor a catalog model; "
            f"use a downloaded model directory or one of: {', '.join(catalog.names())}"
        )
    return spec_from_catalog(entry)


def _gguf_notes(source: str) -> tuple[str, ...]:
    notes = ("GGUF: vLLM serves a GGUF file for the architectures its GGUF loader knows, with the tokenizer "
             "of the original model (--tokenizer); weights sized from the file",)
    if source == "gguf files":
        notes += ("vLLM loads a single-file GGUF only: merge the parts (gguf-split --merge) first",)
    return notes


def _shape(spec: ModelSpec) -> tuple[Any, ...]:
    return (spec.architecture, spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.vocab_size,
            spec.num_experts, spec.quantization, spec.native_max_len)


def catalog_entry_for(spec: ModelSpec) -> catalog.CatalogEntry | None:
    """The catalog entry a downloaded model directory is a copy of, recognised by its shapes.

    Weights land in /var/lib/kimi-service/models/<name>@<revision>, so the directory name can't be
    trusted; architecture, geometry and quantization together identify the model.
    """
    shape = _shape(spec)
    return next((entry for entry in catalog.ENTRIES if _shape(spec_from_catalog(entry)) == shape), None)


def spec_from_catalog(entry: catalog.CatalogEntry) -> ModelSpec:
    return spec_from_config(
        entry.config,
        name=entry.repo_id,
        weight_bytes=entry.weight_bytes,
        weight_bytes_source="catalog",
        source=f"catalog ({entry.source})",
        catalog_name=entry.repo_id,
    )
