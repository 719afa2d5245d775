"""A model directory whose config.json (or weight index) is malformed: exit 2 and one line naming the
field, never a traceback with exit 1, which systemd reads as "restart" (the unit stops on 2 and 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service.cli import main

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}
MOE = {**TINY, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}


def _plan(capsys, directory: Path) -> tuple[int, str]:
    code = main(["plan", "--model", str(directory), "--gpus", "cpu:64GiB"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({**TINY, "num_key_value_heads": "x"}, "num_key_value_heads is 'x'; expected a whole number"),
        ({**TINY, "num_key_value_heads": -2}, "num_key_value_heads is -2"),
        ({**TINY, "num_key_value_heads": 2.5}, "num_key_value_heads is 2.5"),
        ({**TINY, "num_key_value_heads": True}, "num_key_value_heads is True"),
        ({**TINY, "head_dim": "x"}, "head_dim is 'x'"),
        ({**TINY, "intermediate_size": [1]}, "intermediate_size is [1]"),
        ({**TINY, "max_position_embeddings": "x"}, "max_position_embeddings is 'x'"),
        ({**TINY, "max_position_embeddings": -5}, "max_position_embeddings is -5"),
        ({**TINY, "max_position_embeddings": 10**30}, "max_position_embeddings is 1000000000000000000000000000000"),
        ({**TINY, "num_hidden_layers": 10**30}, "no usable 'num_hidden_layers'"),
        ({**TINY, "vocab_size": 10**40}, "no usable 'vocab_size'"),
        ({**TINY, "hidden_size": "x" * 10_000}, "no usable 'hidden_size' (hidden size): got 'xxx"),
        ({k: v for k, v in TINY.items() if k != "num_attention_heads"}, "no usable 'num_attention_heads'"),
        ({**TINY, "kv_lora_rank": "x"}, "kv_lora_rank is 'x'"),
        ({**TINY, "kv_lora_rank": 512}, "kv_lora_rank (latent attention) needs qk_rope_head_dim"),
        ({**TINY, "architectures": 5}, "architectures is 5; expected a list of class names"),
        ({**TINY, "architectures": [{"a": 1}]}, "architectures is [{'a': 1}]"),
        ({**TINY, "torch_dtype": ["x"]}, "torch_dtype is ['x']; expected a string"),
        ({**TINY, "model_type": 3}, "model_type is 3"),
        ({**MOE, "moe_intermediate_size": "x"}, "moe_intermediate_size is 'x'"),
        ({**MOE, "num_experts_per_tok": "x"}, "num_experts_per_tok is 'x'"),
        ({**MOE, "n_shared_experts": -1}, "n_shared_experts is -1"),
        ({**MOE, "first_k_dense_replace": "1"}, "first_k_dense_replace is '1'"),
        ({"text_config": {"hidden_size": 3}}, "no usable 'num_hidden_layers'"),
        ({"text_config": {**TINY, "head_dim": {}}}, "head_dim is {}"),
    ],
)
def test_bad_config_json_fields_exit_2_with_one_line(tmp_path: Path, capsys, config: dict, fragment: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, err = _plan(capsys, tmp_path)
    assert (code, err.count("\n")) == (2, 1), err
    assert fragment in err and "Traceback" not in err and len(err) < 400


@pytest.mark.parametrize(
    ("quantization", "files"),
    [
        ({"quant_method": "compressed-tensors", "config_groups": [1]}, {}),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": 5}}}, {}),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4}}}},
         {"model.safetensors.index.json": '{"metadata": []}'}),
        (None, {"model.safetensors.index.json": "[]"}),
        (None, {"model.safetensors.index.json": '{"metadata": {"total_size": "big"}}'}),
    ],
)
def test_odd_but_readable_quantization_and_index_shapes_still_plan(tmp_path, capsys, quantization, files) -> None:
    config = {**TINY, "quantization_config": quantization} if quantization else TINY
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, err = _plan(capsys, tmp_path)
    assert code == 0 and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b'{"hidden_size": 1', "it must be the model's JSON config"), (b'{"a": "\xff"}', "can't decode byte 0xff"),
     (b"[1]", "is not a JSON object"), (b"1" * 5000, "Exceeds the limit")],
)
def test_unparseable_config_json_exits_2(tmp_path: Path, capsys, content: bytes, fragment: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    code, err = _plan(capsys, tmp_path)
    assert code == 2 and fragment in err and err.count("\n") == 1


def test_unreadable_config_json_and_index_exit_2(tmp_path: Path, capsys) -> None:
    # /proc/self/mem is a regular file that read() refuses (EIO), also for root.
    (tmp_path / "config.json").symlink_to("/proc/self/mem")
    code, err = _plan(capsys, tmp_path)
    assert code == 2 and "Input/output error" in err and err.count("\n") == 1
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors.index.json").symlink_to("/proc/self/mem")
    code, err = _plan(capsys, tmp_path)
    assert code == 2 and "re-download the model" in err
