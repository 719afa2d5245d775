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
# <tool_call> and </tool_call> are whole tokens, as in the Hermes-style templates of Qwen2.5 and Hermes models.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<tool_call>", "</tool_call>"]
# Roles in the markers let the template be read back by a human; the model itself is random. Tools are offered
# and called in the Hermes style (a JSON object between <tool_call> tags), so the planner chooses vLLM's hermes
# tool-call parser for this model from its template, as it does for a hub model with the same markers; without
# tools the prompt is the plain one the other tests were written against.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ eos_token }}\n{% endif %}'
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|assistant|>\n"
    "{% for call in message['tool_calls'] %}<tool_call>"
    '{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
    '{{ call["function"]["arguments"] | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n'
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endif %}"
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
