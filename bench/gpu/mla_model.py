#!/usr/bin/env python3
"""The MLA + MoE shape of the KV calibration (bench/gpu/mla_kv.sh): a DeepSeek-V3 config.json, and the
planner's view of it.

`config DIR [LAYERS]` writes DIR/config.json: DeepSeek-V3's published widths (hidden 7168, 128 heads, q_lora_rank
1536, kv_lora_rank 512, qk_rope_head_dim 64, moe_intermediate_size 2048, 8 experts per token, one shared
expert, vocab 129,280) with 8 layers (or LAYERS; the first dense) and 32 routed experts, BF16, vLLM's native
DeepseekV3ForCausalLM (no remote code). No weight files: vLLM runs it with `--load-format dummy`
(random weights made on the GPU), and the planner estimates the weights from the config, as vLLM holds
them in BF16.

`plan DIR OUT.json [FLAG VALUE ...]` writes the chat plan (argv, kv_cache_tokens, budget) with the given
operator flags for one GPU of this machine as NVML reports it (H200 or H100 on the device machine), or for
the GPU spec in $GPU (e.g. `GPU=H200:1`) where there is none.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
}


def main() -> None:
    command, directory = sys.argv[1], Path(sys.argv[2])
    if command == "config":
        directory.mkdir(parents=True, exist_ok=True)
        layers = int(sys.argv[3]) if len(sys.argv) > 3 else CONFIG["num_hidden_layers"]
        config = {**CONFIG, "num_hidden_layers": layers}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    from kimi_service.hardware import discover_gpus, parse_gpu_spec
    from kimi_service.model import inspect_model
    from kimi_service.planner import plan

    gpus = parse_gpu_spec(os.environ["GPU"]) if os.environ.get("GPU") else discover_gpus().with_count(1)
    result = plan(inspect_model(str(directory)), gpus, overrides=sys.argv[4:],
                  model_path=str(directory), served_model_name="mla")
    Path(sys.argv[3]).write_text(json.dumps(result.to_json(), indent=2) + "\n")


if __name__ == "__main__":
    main()
