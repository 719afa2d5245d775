"""Write a random-weight model of a published shape, with a tokenizer trained on the spot, into DIR.

The weights are random bf16 (generated on the GPU when there is one), in shards with the usual
`model.safetensors.index.json`, so the byte counts, the KV-cache arithmetic and the kernels vLLM runs
are those of the real model; only the answers are noise. The tokenizer is a byte-level BPE trained on
generated words, padded with plain filler tokens up to the model's vocabulary so that every id the
random model can emit decodes to text (a stream of undecodable ids would look like no output at all).
Skips the work when DIR already holds a complete model of the same shape.

Two architectures: Llama 3.1 (GQA attention, dense MLP) and DeepSeek-V3 (MLA attention, routed + shared
experts: the language model of Kimi K2.5), each at its published widths, some with fewer layers; and Kimi K2.5
itself as it ships (INT4 experts, vision tower, its special tokens) with N layers (kimi_model.py).

Usage: make_model.py DIR [--shape llama-3.1-8b|llama-3.1-70b-16l|deepseek-v3-4l|kimi-k2.5-Nl|tiny]
torch, safetensors and tokenizers are imported where used, so the shape arithmetic loads without them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import kimi_model
import mla_model

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SHARD_BYTES = 5 * 10**9
TRAINED_VOCAB = 32000
DONE_MARKER = ".kimi-model-complete"
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
# Llama 3's tool-call tokens too: vLLM's llama3_json tool parser, which the planner enables for this
# model's family, refuses a tokenizer without <|python_tag|>.
SPECIAL_TOKENS = [BOS, EOS, HEADER_START, HEADER_END, EOT, "<|eom_id|>", "<|python_tag|>"]
# Llama 3's layout of roles and turns, so prompts have the length and structure real ones have.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None


# Values from the published config.json of Meta's Llama 3.1 models.
LLAMA31_ROPE = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}
@dataclass(frozen=True)
class MlaMoeShape:
    """DeepSeek-V3's published widths (mla_model.CONFIG) with fewer layers and routed experts."""

    num_hidden_layers: int
    first_k_dense_replace: int
    n_routed_experts: int

    @property
    def vocab_size(self) -> int:
        return mla_model.CONFIG["vocab_size"]

    def config(self) -> dict:
        return {**mla_model.CONFIG, **asdict(self)}


SHAPES: dict[str, Shape | MlaMoeShape] = {
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, LLAMA31_ROPE),
    # Llama 3.1 70B's widths with 16 of its 80 layers: 15.9 B parameters, 31.8 GB in bf16. The device's
    # 64 GiB disk, not the GPU, is the bound: it must also hold the 8B model, the wheels and caches.
    "llama-3.1-70b-16l": Shape(8192, 16, 64, 8, 28672, 128256, 500000.0, 131072, LLAMA31_ROPE),
    # Kimi K2.5's architecture on one GPU: 4 layers (the first dense), 32 routed experts of 8 per token plus
    # the shared one; 7.3 B parameters, 14.7 GB in bf16.
    "deepseek-v3-4l": MlaMoeShape(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=32),
    # For checking the writer on a CPU in seconds.
    "tiny": Shape(256, 2, 4, 2, 512, 2048, 500000.0, 16384, LLAMA31_ROPE),
}


def tensor_shapes(shape: Shape | MlaMoeShape) -> dict[str, tuple[int, ...]]:
    """Every weight of the shape's architecture, by its checkpoint name."""
    if isinstance(shape, MlaMoeShape):
        return mla_moe_tensor_shapes(shape.config())
    h, inter, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    names |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return names


def mla_moe_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of DeepseekV3ForCausalLM (no multi-token-prediction layer), by its checkpoint name."""
    h, vocab, heads = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    experts, expert_width = config["n_routed_experts"], config["moe_intermediate_size"]
    shared_width = expert_width * config["n_shared_experts"]
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (q_rank, h),
            p + "self_attn.q_a_layernorm.weight": (q_rank,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
            p + "self_attn.o_proj.weight": (h, heads * v),
            p + "post_attention_layernorm.weight": (h,),
        }
        if i < config["first_k_dense_replace"]:
            names |= _mlp(p + "mlp.", h, config["intermediate_size"])
            continue
        names |= {p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,)}
        for e in range(experts):
            names |= _mlp(f"{p}mlp.experts.{e}.", h, expert_width)
        names |= _mlp(p + "mlp.shared_experts.", h, shared_width)
    names |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return names


def _mlp(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def plan_shards(shapes: dict[str, object], limit: int, nbytes_of: Callable[[str], int] | None = None
                ) -> list[list[str]]:
    """Consecutive groups of tensors, each at most `limit` bytes (bf16 unless `nbytes_of` says), or one
    tensor if larger."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in shapes.items():
        nbytes = nbytes_of(name) if nbytes_of else 2 * _numel(dims)  # type: ignore[arg-type]
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(dims: tuple[int, ...]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def write_weights(shape: Shape | MlaMoeShape, out: Path, device: str, seed: int = 0) -> int:
    """Random bf16 weights (std 0.02, norms 1, the router's score bias 0 in fp32, as DeepSeek ships it) as
    sharded safetensors plus the index; returns bytes."""
    import torch
    from safetensors.torch import save_file

    shapes = tensor_shapes(shape)
    groups = plan_shards(shapes, SHARD_BYTES)
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for index, group in enumerate(groups, start=1):
        filename = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            dims = shapes[name]
            if name.endswith("norm.weight"):
                tensor = torch.ones(dims, dtype=torch.bfloat16, device=device)
            elif name.endswith("e_score_correction_bias"):
                tensor = torch.zeros(dims, dtype=torch.float32, device=device)
            else:
                tensor = torch.randn(dims, generator=generator, dtype=torch.bfloat16, device=device).mul_(0.02)
            tensors[name] = tensor.cpu()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = filename
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def training_corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    punctuation = ["", "", "", ",", ".", "?", "!"]

    def word() -> str:
        return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) + rng.choice(punctuation)

    return [" ".join(word() for _ in range(16)) + f" {rng.randrange(10**6)}" for _ in range(lines)]


def build_tokenizer(vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS, tail: Sequence[str] = ()
                    ) -> Tokenizer:
    """`special_tokens` take the first ids, `tail` (special too) the last ones, fillers what lies between."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(TRAINED_VOCAB, vocab_size // 2), special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(60000), trainer=trainer)
    filler = vocab_size - len(tail) - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f" x{i}", normalized=False) for i in range(filler)])
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in tail])
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def write_tokenizer(tok: Tokenizer, out: Path) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    added = {
        str(ids[name]): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
        for name in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
        "pad_token": EOS, "model_max_length": 131072, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOT, "pad_token": EOS}, indent=2) + "\n"
    )
    return ids


def write_config(shape: Shape | MlaMoeShape, ids: dict[str, int], out: Path) -> None:
    if isinstance(shape, MlaMoeShape):
        config = {**shape.config(), "bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]}
    else:
        config = _llama_config(shape, ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _llama_config(shape: Shape, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "hidden_act": "silu",
        "initializer_range": 0.02, "rms_norm_eps": 1e-05, "pretraining_tp": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True,
        "bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]],
        **asdict(shape),
    }


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to create")
    parser.add_argument("--shape", default="llama-3.1-8b", help=f"{', '.join(sorted(SHAPES))} or kimi-k2.5-Nl")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    try:
        shape = SHAPES.get(args.shape) or kimi_model.shape_named(args.shape)
    except ValueError as exc:
        parser.error(str(exc))
    if shape is None:
        parser.error(f"--shape {args.shape!r}: use one of {', '.join(sorted(SHAPES))} or kimi-k2.5-Nl")
    # The marker holds the whole shape, so a changed table entry makes a new model.
    if isinstance(shape, kimi_model.KimiShape):
        widths, specials = shape.config(), kimi_model.SPECIAL_IDS
    else:
        widths, specials = shape.config() if isinstance(shape, MlaMoeShape) else asdict(shape), SPECIAL_TOKENS
    recipe = json.dumps({"shape": args.shape, "special_tokens": specials, **widths}, sort_keys=True)
    marker = args.out / DONE_MARKER
    if marker.exists() and marker.read_text().strip() == recipe:
        print(f"{args.out}: {args.shape} already there")
        return
    work = args.out.with_name(f".{args.out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    if isinstance(shape, kimi_model.KimiShape):
        total = kimi_model.write(shape, work, args.device)
    else:
        ids = write_tokenizer(build_tokenizer(shape.vocab_size), work)
        total = write_weights(shape, work, args.device)
        write_config(shape, ids, work)
    for path in work.iterdir():
        path.chmod(0o644)
    (work / DONE_MARKER).write_text(recipe + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    work.rename(args.out)
    print(f"{args.out}: {args.shape}, {total / 1e9:.2f} GB of weights on {args.device} "
          f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
