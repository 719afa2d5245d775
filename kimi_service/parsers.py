"""Which vLLM tool-call and reasoning parsers a model needs, from its config.json and its chat template.

A chat template names the format the model was trained to call tools in (Kimi's section markers,
DeepSeek's tool-call tokens, Hermes' `<tool_call>` tags, ...), so where the model directory has one its
markers decide; `model_type` (outer or `text_config`'s) narrows rows whose markers several families
share. Where there is no template (a catalog model planned without downloading) `model_type` alone
decides. Every parser name is one vLLM 0.21 registers (vllm/tool_parsers/__init__.py,
vllm/reasoning/__init__.py); a family whose parser cannot be confirmed there has no row, and tools stay
off for it with a warning naming its model_type. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TOOL_DOCS = "docs.vllm.ai/en/latest/features/tool_calling (vLLM docs/features/tool_calling.md)"
_THINKS = "the model thinks before it answers; the parser splits reasoning_content from content"
_REASONING_DOCS = "docs.vllm.ai/en/latest/features/reasoning_outputs (vLLM docs/features/reasoning_outputs.md)"


@dataclass(frozen=True)
class Family:
    """One row: how a family is recognised and which parsers it gets."""

    name: str
    tool_parser: str
    reasoning_parser: str | None
    # Recognised without a chat template when config.json's model_type is one of these.
    model_types: tuple[str, ...]
    # Recognised by a chat template holding every one of these strings...
    markers: tuple[str, ...]
    # ...and, when set, a model_type among these too (markers several families share).
    template_model_types: tuple[str, ...] = ()
    source: str = ""
    thinking: str = _THINKS


# DeepSeek's special tokens are spelled with U+FF5C (fullwidth vertical line) and U+2581 (lower one eighth
# block, the tokenizer's space).
_DEEPSEEK_TOOL_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DEEPSEEK_NOT_THINKING = "<\uff5cAssistant\uff5c></think>"  # V3.1's answer without thinking
_QWEN3_TYPES = ("qwen3", "qwen3_moe", "qwen3_next")
_QWEN2_TYPES = ("qwen2", "qwen2_moe")

# Ordered: the first row that matches wins, so a row whose markers include another's comes first.
FAMILIES: tuple[Family, ...] = (
    Family("Kimi K2.5 / K2 Thinking", "kimi_k2", "kimi_k2", ("kimi_k25",),
           ("<|tool_calls_section_begin|>", "<think>"),
           source=f"{_TOOL_DOCS} 'Kimi-K2 Models'; vllm-project/recipes moonshotai/Kimi-K2.5.md",
           thinking="K2.5 thinks by default; kimi_k2 splits reasoning_content from content"),
    Family("Kimi K2", "kimi_k2", None, ("kimi_k2",), ("<|tool_calls_section_begin|>",),
           source=f"{_TOOL_DOCS} 'Kimi-K2 Models'"),
    Family("DeepSeek V3.1", "deepseek_v31", "deepseek_v3", (), (_DEEPSEEK_TOOL_CALLS, _DEEPSEEK_NOT_THINKING),
           source=f"{_TOOL_DOCS} 'DeepSeek-V3.1 Models'; {_REASONING_DOCS} (DeepSeek-V3.1: deepseek_v3)",
           thinking="V3.1 thinks when a request sets chat_template_kwargs thinking=true; deepseek_v3 splits it out"),
    Family("DeepSeek R1", "deepseek_v3", "deepseek_r1", (), (_DEEPSEEK_TOOL_CALLS, "<think>"),
           source=f"{_TOOL_DOCS} 'DeepSeek-V3 Models' (DeepSeek-R1-0528); {_REASONING_DOCS} (deepseek_r1)",
           thinking="R1 always thinks; deepseek_r1 splits reasoning_content from content"),
    Family("DeepSeek V3", "deepseek_v3", None, ("deepseek_v3",), (_DEEPSEEK_TOOL_CALLS,),
           source=f"{_TOOL_DOCS} 'DeepSeek-V3 Models', which pairs it with vLLM's "
                  "examples/tool_chat_template_deepseekv3.jinja"),
    Family("GLM-4.5 / 4.6", "glm45", "glm45", ("glm4_moe",), ("<arg_key>",),
           source=f"{_TOOL_DOCS} 'GLM-4.5 Models'; {_REASONING_DOCS} (GLM-4.5 series: glm45)",
           thinking="GLM-4.5 thinks by default; glm45 splits reasoning_content from content"),
    Family("Qwen3-Coder", "qwen3_coder", None, (), ("<function=", "<parameter="),
           source="vllm-project/recipes Qwen/Qwen3-Coder-480B-A35B.md (--tool-call-parser qwen3_coder)"),
    Family("MiniMax M2", "minimax_m2", "minimax_m2_append_think", ("minimax_m2",), ("<minimax:tool_call>",),
           source=f"vllm-project/recipes MiniMax/MiniMax-M2.md; {_REASONING_DOCS} (MiniMax-M2)",
           thinking="keeps the <think> block in the content, as MiniMax asks for multi-turn use"),
    Family("gpt-oss", "openai", "openai_gptoss", ("gpt_oss",), ("<|channel|>",),
           source=f"{_TOOL_DOCS} 'OpenAI OSS Models'; vllm-project/recipes OpenAI/GPT-OSS.md",
           thinking="harmony's analysis channel becomes reasoning_content"),
    Family("Magistral", "mistral", "mistral", (), ("[TOOL_CALLS]", "[THINK]"),
           source=f"{_TOOL_DOCS} 'Mistral Models'; {_REASONING_DOCS} (Magistral: mistral)",
           thinking="Magistral thinks inside [THINK] ... [/THINK]; mistral splits it out"),
    Family("Mistral", "mistral", None, ("mistral", "mistral3"), ("[TOOL_CALLS]",),
           source=f"{_TOOL_DOCS} 'Mistral Models'"),
    Family("Granite 3.x", "granite", None, ("granite",), ("<|tool_call|>",),
           source=f"{_TOOL_DOCS} 'IBM Granite' (granite-3.1-8b-instruct: its own template works)"),
    # The docs recommend llama4_pythonic only together with vLLM's own pythonic template; the model's
    # published template asks for JSON calls, which llama3_json reads ("All Llama 3.1, 3.2 and 4 models").
    Family("Llama 4", "llama3_json", None, ("llama4",), ("<|header_start|>",),
           source=f"{_TOOL_DOCS} 'Llama Models (llama3_json)'"),
    Family("Llama 3.x", "llama3_json", None, ("llama",), ("<|python_tag|>",),
           source=f"{_TOOL_DOCS} 'Llama Models (llama3_json)'"),
    Family("Qwen3", "hermes", "qwen3", _QWEN3_TYPES, ("<tool_call>", "<think>"), _QWEN3_TYPES,
           source=f"{_TOOL_DOCS} 'Qwen Models'; {_REASONING_DOCS} (Qwen3 series: qwen3)",
           thinking="Qwen3 thinks unless a request sets chat_template_kwargs enable_thinking=false; qwen3 "
                    "splits it out"),
    Family("QwQ", "hermes", "deepseek_r1", (), ("<tool_call>", "<think>"), _QWEN2_TYPES,
           source=f"{_TOOL_DOCS} 'Qwen Models' (Qwen/QwQ-32B); {_REASONING_DOCS} (QwQ-32B: deepseek_r1)"),
    Family("Hermes-style (Qwen2.5, Hermes, Qwen3-Next Instruct)", "hermes", None, _QWEN2_TYPES, ("<tool_call>",),
           source=f"{_TOOL_DOCS} 'Hermes Models' and 'Qwen Models'"),
)


@dataclass(frozen=True)
class Parsers:
    """What the model needs to answer tool calls and reasoning as the OpenAI API does."""

    model_type: str = "unknown"
    family: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    recognised_by: str = ""  # "model_type kimi_k25" or "chat template markers ..."
    source: str = ""
    thinking: str = _THINKS

    @property
    def tool_warning(self) -> str:
        """What the plan says when tools stay off."""
        return (f"tool calling is off: no tool-call parser is known for model_type {self.model_type}; set "
                "kimi_vllm_extra_args: [--enable-auto-tool-choice, --tool-call-parser NAME] to turn it on")


def model_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """config.json's model_type and its text_config's, outer first (K2.5 wraps a kimi_k2 language model)."""
    text = config.get("text_config")
    found = [config.get("model_type"), text.get("model_type") if isinstance(text, Mapping) else None]
    return tuple(dict.fromkeys(kind for kind in found if isinstance(kind, str) and kind))


def _matches(family: Family, kinds: tuple[str, ...], template: str | None) -> bool:
    if template is None:
        return any(kind in family.model_types for kind in kinds)
    if family.template_model_types and not any(kind in family.template_model_types for kind in kinds):
        return False
    return all(marker in template for marker in family.markers)


def choose_parsers(config: Mapping[str, Any], chat_template: str | None = None) -> Parsers:
    """The parsers for a model with this config.json and chat template (None: no template to read)."""
    kinds = model_types(config)
    shown = kinds[0] if kinds else "unknown"
    family = next((row for row in FAMILIES if _matches(row, kinds, chat_template)), None)
    if family is None:
        return Parsers(model_type=shown)
    recognised_by = (f"model_type {shown}" if chat_template is None
                     else "chat template markers " + " ".join(family.markers))
    return Parsers(model_type=shown, family=family.name, tool_parser=family.tool_parser,
                   reasoning_parser=family.reasoning_parser, recognised_by=recognised_by,
                   source=family.source, thinking=family.thinking)


def template_text(tokenizer_config: Any, template_file: str | None) -> str | None:
    """The chat template vLLM would use: chat_template.jinja when present (transformers prefers it), else
    tokenizer_config.json's chat_template, a string or a list of named templates (all are searched)."""
    if template_file is not None:
        return template_file
    value = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, Mapping) else None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [item.get("template") for item in value if isinstance(item, Mapping)]
        texts = [part for part in parts if isinstance(part, str)]
        return "\n".join(texts) if texts else None
    return None
