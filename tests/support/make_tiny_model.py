"""Write a tiny random-weight Llama with a freshly trained tokenizer into a directory.

Run by tiny_model.py with the engine venv's Python (it has torch, transformers, tokenizers and
safetensors), so the project's own venv stays small. Usage: make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# Roles in the markers let the template be read back by a human; the model itself is random.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


WORDS = (
    "the model serves tokens quickly over an openai compatible api on gpu hosts and cpu hosts "
    "with systemd units health checks metrics kv cache prefix batching throughput latency"
)


def corpus() -> list[str]:
    words = WORDS.split()
    lines = []
    for i in range(4000):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(picked) + f" {i} <|user|> <|assistant|> <|system|>")
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def main(out: Path) -> None:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
