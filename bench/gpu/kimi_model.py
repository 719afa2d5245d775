"""Kimi K2.5 as it ships, at reduced depth: make_model.py's `kimi-k2.5-Nl` shapes.

The config is the published one (tests/fixtures/models/moonshotai--Kimi-K2.5/config.json) with
`text_config.num_hidden_layers` set to N: a KimiK25ForConditionalGeneration wrapper around the
DeepSeek-V3-shaped language model, whose routed experts are INT4 in compressed-tensors' pack-quantized
layout, plus the MoonViT vision tower and its projector, all at the published widths. The weights are
random but stored as the checkpoint stores them, under the names vLLM 0.21.0's KimiK25ForConditionalGeneration
loads (its hf_to_vllm_mapper renames `mm_projector.proj.0/2` to `linear_1/2`; the language model is
DeepseekV2ForCausalLM under `language_model.`):

- routed experts: `weight_packed` int32 (eight 4-bit values per int32 along the input dimension, as
  compressed-tensors' pack_to_int32 packs them), `weight_scale` bf16 (one per 32 inputs), `weight_shape`
  int32 [out, in];
- the router's `e_score_correction_bias` float32; everything else bf16 (the quantization config's `ignore`
  keeps attention, shared experts, the dense MLP and lm_head unquantized; vLLM loads the vision tower and
  projector without quantization).

vLLM 0.21.0 has native config classes for this model (KimiK25Config, and DeepseekV3Config for the text
model_type kimi_k2) and its own KimiK25Processor, but asks transformers' AutoImageProcessor for the image
processor: the model directory carries one (kimi_k25_vision_processing.py, remote code), so it is served
with --trust-remote-code. The tokenizer is a tokenizer.json (no remote code) with Kimi's special tokens at
their published ids.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import make_model

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent
PUBLISHED_CONFIG = HERE.parents[1] / "tests/fixtures/models/moonshotai--Kimi-K2.5/config.json"
IMAGE_PROCESSOR = HERE / "kimi_k25_vision_processing.py"
SHAPE_NAME = re.compile(r"kimi-k2\.5-(\d+)l")
# The ids 163584..163839 after the BPE ranks, as Moonshot's tokenizer_config.json names them (the rest
# are <|reserved_token_ID|>); the tool-call and thinking markers are those vLLM's kimi_k2 tool and
# reasoning parsers look for.
SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590, "<|end_header_id|>": 163591, "[EOT]": 163593, "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
    "<think>": 163606, "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839,
}
FIRST_SPECIAL_ID = min(SPECIAL_IDS.values())
# Kimi's turn layout (the published chat_template.jinja): role markers, tools declared in a system turn,
# tool calls in the section markers, tool results as "## Return of ID", images as the media placeholder
# vLLM expands, and the assistant's turn opened with <think> (or an empty one when thinking is off).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ message.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}{{ '\\n' }}{%- endif -%}"
    "{{- render(message['content']) -}}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)
# Byte widths of the safetensors dtypes written.
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I32": 4}
PACK = 8  # 4-bit values per int32
# Random nibbles are uniform over -8..7 (standard deviation 4.6): this scale gives the dequantized experts
# the 0.02 standard deviation of the bf16 weights.
EXPERT_SCALE = 0.02 / 4.6


@dataclass(frozen=True)
class KimiShape:
    layers: int

    @property
    def vocab_size(self) -> int:
        return self.config()["text_config"]["vocab_size"]

    def config(self) -> dict:
        config = json.loads(PUBLISHED_CONFIG.read_text())
        config["text_config"]["num_hidden_layers"] = self.layers
        return config


def shape_named(name: str) -> KimiShape | None:
    """`kimi-k2.5-Nl`: the published model with N layers (the first dense, as published)."""
    match = SHAPE_NAME.fullmatch(name)
    if match is None:
        return None
    layers = int(match.group(1))
    dense = json.loads(PUBLISHED_CONFIG.read_text())["text_config"]["first_k_dense_replace"]
    if layers <= dense:
        raise ValueError(f"--shape {name}: Kimi K2.5 needs more than its {dense} dense layer(s) to have experts")
    return KimiShape(layers)


def tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (shape, safetensors dtype)."""
    text = config["text_config"]
    group = text["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    result: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, dims in make_model.mla_moe_tensor_shapes(text).items():
        name = "language_model." + name
        if ".mlp.experts." in name:
            out_features, in_features = dims
            stem = name.removesuffix(".weight")
            result |= {
                stem + ".weight_packed": ((out_features, in_features // PACK), "I32"),
                stem + ".weight_scale": ((out_features, in_features // group), "BF16"),
                stem + ".weight_shape": ((2,), "I32"),
            }
        else:
            result[name] = (dims, "F32" if name.endswith("e_score_correction_bias") else "BF16")
    return result | _vision_tensors(config["vision_config"], text["hidden_size"])


def _vision_tensors(vision: dict, text_hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    hidden, inter, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = hidden * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (hidden, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (hidden,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"],
                                                    hidden),
    }
    for i in range(vision["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        shapes |= _linear(p + "wqkv", 3 * hidden, hidden) | _linear(p + "wo", hidden, hidden)
        shapes |= _norm(p + "norm0", hidden) | _norm(p + "norm1", hidden)
        shapes |= _linear(p + "mlp.fc0", inter, hidden) | _linear(p + "mlp.fc1", hidden, inter)
    shapes |= _norm("vision_tower.encoder.final_layernorm", hidden) | _norm("mm_projector.pre_norm", hidden)
    shapes |= _linear("mm_projector.proj.0", merged, merged) | _linear("mm_projector.proj.2", text_hidden, merged)
    return {name: (dims, "BF16") for name, dims in shapes.items()}


def _linear(prefix: str, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
    return {prefix + ".weight": (out_features, in_features), prefix + ".bias": (out_features,)}


def _norm(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
    return {prefix + ".weight": (width,), prefix + ".bias": (width,)}


def nbytes(dims: tuple[int, ...], dtype: str) -> int:
    return make_model._numel(dims) * DTYPE_BYTES[dtype]


def index(config: dict) -> dict:
    """model.safetensors.index.json of the checkpoint write_weights writes, computed without weights."""
    table = tensors(config)
    groups = make_model.plan_shards(table, make_model.SHARD_BYTES, lambda name: nbytes(*table[name]))
    weight_map = {
        name: f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        for number, group in enumerate(groups, start=1) for name in group
    }
    total = sum(nbytes(*spec) for spec in table.values())
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def _random(name: str, dims: tuple[int, ...], dtype: str, generator: torch.Generator, device: str
            ) -> torch.Tensor | None:
    import torch

    if name.endswith("weight_shape"):
        return None  # filled by the caller, which knows the unpacked shape
    if name.endswith("weight_packed"):
        raw = torch.randint(0, 256, (make_model._numel(dims) * 4,), generator=generator, dtype=torch.uint8,
                            device=device)
        return raw.view(torch.int32).reshape(dims)
    if name.endswith("weight_scale"):
        return torch.full(dims, EXPERT_SCALE, dtype=torch.bfloat16, device=device)
    if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
        return torch.zeros(dims, dtype=torch.float32 if dtype == "F32" else torch.bfloat16, device=device)
    if re.search(r"(norm\d?|layernorm)\.weight$", name):
        return torch.ones(dims, dtype=torch.bfloat16, device=device)
    return torch.randn(dims, generator=generator, dtype=torch.bfloat16, device=device).mul_(0.02)


def write_weights(config: dict, out: Path, device: str, seed: int = 0) -> int:
    """The shards and their index, as `index` describes them; returns bytes."""
    import torch
    from safetensors.torch import save_file

    table = tensors(config)
    plan = index(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    unpacked = make_model.mla_moe_tensor_shapes(config["text_config"])
    by_file: dict[str, list[str]] = {}
    for name, filename in plan["weight_map"].items():
        by_file.setdefault(filename, []).append(name)
    for filename, names in by_file.items():
        shard = {}
        for name in names:
            dims, dtype = table[name]
            tensor = _random(name, dims, dtype, generator, device)
            if tensor is None:
                original = unpacked[name.removeprefix("language_model.").removesuffix("_shape")]
                tensor = torch.tensor(original, dtype=torch.int32)
            shard[name] = tensor.cpu()
        save_file(shard, str(out / filename), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(plan, indent=2) + "\n")
    return plan["metadata"]["total_size"]


def special_tokens(vocab_size: int) -> list[str]:
    """The tokens of ids FIRST_SPECIAL_ID .. vocab_size - 1, in id order."""
    names = {token_id: name for name, token_id in SPECIAL_IDS.items()}
    return [names.get(i, f"<|reserved_token_{i}|>") for i in range(FIRST_SPECIAL_ID, vocab_size)]


def write_tokenizer(out: Path, vocab_size: int) -> None:
    tail = special_tokens(vocab_size)
    tok = make_model.build_tokenizer(vocab_size, special_tokens=(), tail=tail)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(name)): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
        for name in tail
    }
    names = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 262144,
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")


def write_image_processor(config: dict, out: Path) -> None:
    """preprocessor_config.json pointing AutoImageProcessor at the stand-in processor's code."""
    vision = config["vision_config"]
    media = {
        "patch_size": vision["patch_size"], "merge_kernel_size": vision["merge_kernel_size"][0],
        # A video chunk's frames are pooled into one grid; the tower's position table has this many frames.
        "temporal_merge_kernel_size": vision["init_pos_emb_time"],
        # Moonshot's preprocessor_config.json: at most 16,384 patches an image, 512 a side (the tower's
        # 2-D RoPE table is 512 x 512), pixels normalised to [-1, 1].
        "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }
    stem = IMAGE_PROCESSOR.stem
    processor = {
        "auto_map": {"AutoImageProcessor": f"{stem}.KimiK25VisionProcessor"},
        "image_processor_type": "KimiK25VisionProcessor", "media_proc_cfg": media,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    shutil.copyfile(IMAGE_PROCESSOR, out / IMAGE_PROCESSOR.name)


def write(shape: KimiShape, out: Path, device: str) -> int:
    """Everything but the marker; returns the weight bytes."""
    config = shape.config()
    write_tokenizer(out, shape.vocab_size)
    write_image_processor(config, out)
    total = write_weights(config, out, device)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Chats end at <|im_end|>; [EOS] ends documents.
    generation = {"bos_token_id": SPECIAL_IDS["[BOS]"],
                  "eos_token_id": [SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["[EOS]"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return total
