"""Tool-call and reasoning parsers derived from the model: config.json's model_type and the chat template's
markers, for every family vLLM 0.21 has parsers for; tools off, by name, for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service import catalog
from kimi_service.cli import main
from kimi_service.errors import UsageError
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import MAX_TEMPLATE_BYTES, inspect_model
from kimi_service.parsers import FAMILIES, choose_parsers
from kimi_service.planner import plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HF = "https://huggingface.co"


def ds(token: str) -> str:
    """A DeepSeek special token as its templates spell it: fullwidth bars, U+2581 for spaces."""
    return "<\uff5c" + token.replace(" ", "\u2581") + "\uff5c>"

# (repo, config.json's model_type(s), the tool and thinking markers its published chat template holds,
# tool parser, reasoning parser). The markers are copied from the template each repo publishes
# (chat_template.jinja, or tokenizer_config.json's chat_template) at the URL in the id.
PUBLISHED = [
    (f"{HF}/moonshotai/Kimi-K2.5/blob/main/chat_template.jinja", ("kimi_k25", "kimi_k2"),
     "<|im_assistant|>assistant<|im_middle|><think>{{ r }}</think><|tool_calls_section_begin|><|tool_call_begin|>",
     "kimi_k2", "kimi_k2"),
    (f"{HF}/moonshotai/Kimi-K2-Instruct/blob/main/tokenizer_config.json", ("kimi_k2",),
     "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2", None),
    (f"{HF}/deepseek-ai/DeepSeek-V3/blob/main/tokenizer_config.json", ("deepseek_v3",),
     ds("Assistant") + ds("tool calls begin") + ds("tool call begin") + "{{ tool['type'] }}" + ds("tool sep"),
     "deepseek_v3", None),
    (f"{HF}/deepseek-ai/DeepSeek-V3.1/blob/main/tokenizer_config.json", ("deepseek_v3",),
     "{% if thinking %}" + ds("Assistant") + "<think>{% else %}" + ds("Assistant") + "</think>{% endif %}"
     + ds("tool calls begin"), "deepseek_v31", "deepseek_v3"),
    (f"{HF}/deepseek-ai/DeepSeek-R1-0528/blob/main/tokenizer_config.json", ("deepseek_v3",),
     ds("tool calls begin") + ds("tool call begin") + "{{ name }}" + ds("Assistant") + "<think>\n",
     "deepseek_v3", "deepseek_r1"),
    (f"{HF}/zai-org/GLM-4.5/blob/main/chat_template.jinja", ("glm4_moe",),
     "<|assistant|><think></think><tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>", "glm45",
     "glm45"),
    (f"{HF}/Qwen/Qwen3-Coder-480B-A35B-Instruct/blob/main/chat_template.jinja", ("qwen3_moe",),
     "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ args_name }}>\n", "qwen3_coder", None),
    (f"{HF}/MiniMaxAI/MiniMax-M2/blob/main/chat_template.jinja", ("minimax_m2",),
     "<think>{{ reasoning }}</think><minimax:tool_call>\n<invoke name=\"{{ name }}\">", "minimax_m2",
     "minimax_m2_append_think"),
    (f"{HF}/openai/gpt-oss-20b/blob/main/chat_template.jinja", ("gpt_oss",),
     "<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>", "openai", "openai_gptoss"),
    (f"{HF}/mistralai/Mistral-Small-3.2-24B-Instruct-2506/blob/main/chat_template.jinja", ("mistral3",),
     "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]{{ name }}[ARGS]", "mistral", None),
    (f"{HF}/mistralai/Magistral-Small-2509/blob/main/chat_template.jinja", ("mistral3",),
     "[THINK]{{ thinking }}[/THINK][TOOL_CALLS]{{ name }}[ARGS]", "mistral", "mistral"),
    (f"{HF}/ibm-granite/granite-3.1-8b-instruct/blob/main/tokenizer_config.json", ("granite",),
     "<|start_of_role|>available_tools<|end_of_role|><|tool_call|>", "granite", None),
    (f"{HF}/meta-llama/Llama-3.1-8B-Instruct/blob/main/tokenizer_config.json", ("llama",),
     "Environment: ipython\n<|python_tag|>{{ tool_call.name }}.call(", "llama3_json", None),
    (f"{HF}/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/chat_template.json", ("llama4", "llama4_text"),
     "<|header_start|>ipython<|header_end|>\n\n{{ message.content }}<|eot|>", "llama3_json", None),
    (f"{HF}/Qwen/Qwen2.5-7B-Instruct/blob/main/tokenizer_config.json", ("qwen2",),
     "<|im_start|>assistant\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\"}\n</tool_call>", "hermes", None),
    (f"{HF}/Qwen/Qwen3-8B/blob/main/tokenizer_config.json", ("qwen3",),
     "<think>\n{{ reasoning_content }}\n</think><tool_call>\n{\"name\": \"", "hermes", "qwen3"),
    (f"{HF}/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/tokenizer_config.json", ("qwen3_next",),
     "<|im_start|>assistant\n<tool_call>\n{\"name\": \"", "hermes", None),
    (f"{HF}/Qwen/QwQ-32B/blob/main/tokenizer_config.json", ("qwen2",),
     "<|im_start|>assistant\n<think>\n<tool_call>\n{\"name\": \"", "hermes", "deepseek_r1"),
    (f"{HF}/NousResearch/Hermes-3-Llama-3.1-8B/blob/main/tokenizer_config.json", ("llama",),
     "<|im_start|>assistant\n<tool_call>\n{\"arguments\": ", "hermes", None),
]


def _config(kinds: tuple[str, ...]) -> dict:
    outer, *text = kinds
    return {"model_type": outer, **({"text_config": {"model_type": text[0]}} if text else {})}


@pytest.mark.parametrize(("source", "kinds", "template", "tool", "reasoning"), PUBLISHED,
                         ids=[row[0].split("/")[4] for row in PUBLISHED])
def test_a_published_template_gets_its_familys_parsers(source, kinds, template, tool, reasoning):
    chosen = choose_parsers(_config(kinds), template)
    assert (chosen.tool_parser, chosen.reasoning_parser) == (tool, reasoning)
    assert chosen.recognised_by.startswith("chat template markers")


def test_the_table_covers_at_least_twelve_families_and_every_row_cites_a_source():
    families = {choose_parsers(_config(kinds), template).family for _, kinds, template, *_ in PUBLISHED}
    assert len(families) >= 12
    assert all(row.source for row in FAMILIES)


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.repo_id)
def test_the_catalog_keeps_no_parser_flag_the_model_gives(entry):
    """Parsers are derived for every model; a catalog entry that still carried one would be a second home."""
    assert not {"--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice"} & set(entry.flags)


@pytest.mark.parametrize(("repo", "tool", "reasoning"), [
    ("moonshotai/Kimi-K2.5", "kimi_k2", "kimi_k2"),
    ("moonshotai/Kimi-K2-Instruct", "kimi_k2", None),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3_json", None),
    ("Qwen/Qwen2.5-7B-Instruct", "hermes", None),
    ("MiniMaxAI/MiniMax-M2", "minimax_m2", "minimax_m2_append_think"),
])
def test_a_catalog_model_planned_without_its_files_gets_parsers_by_model_type(repo, tool, reasoning):
    parsers = inspect_model(repo).parsers
    assert (parsers.tool_parser, parsers.reasoning_parser) == (tool, reasoning)
    assert parsers.recognised_by.startswith("model_type ")


def test_the_plan_carries_the_parsers_with_their_reasons():
    result = plan(inspect_model("moonshotai/Kimi-K2.5"), parse_gpu_spec("H200:8"))
    argv = result.argv
    assert argv[argv.index("--tool-call-parser") + 1] == argv[argv.index("--reasoning-parser") + 1] == "kimi_k2"
    assert "--enable-auto-tool-choice" in argv
    assert "recognised by model_type kimi_k25" in result.reasons["--tool-call-parser"]
    assert "K2.5 thinks by default" in result.reasons["--reasoning-parser"]
    assert not [w for w in result.warnings if w.startswith("tool calling is off")]


def _model_dir(tmp_path: Path, fixture: str, **files: str) -> Path:
    directory = tmp_path / fixture
    directory.mkdir()
    (directory / "config.json").write_text((FIXTURES / fixture / "config.json").read_text())
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)
    return directory


def test_an_unknown_family_plans_with_tools_off_and_says_so_by_name(tmp_path, capsys):
    directory = _model_dir(tmp_path, "google--gemma-3-27b-it")
    result = plan(inspect_model(str(directory)), parse_gpu_spec("H200:1"))
    assert "--tool-call-parser" not in result.argv and "--enable-auto-tool-choice" not in result.argv
    assert ("tool calling is off: no tool-call parser is known for model_type gemma3; set kimi_vllm_extra_args: "
            "[--enable-auto-tool-choice, --tool-call-parser NAME] to turn it on") in result.warnings
    assert main(["plan", "--model", str(directory), "--gpus", "H200:1"]) == 0
    assert "no tool-call parser is known for model_type gemma3" in capsys.readouterr().out


def test_a_template_without_tool_markers_keeps_tools_off_whatever_the_model_type(tmp_path):
    """A Llama-typed fine-tune whose template renders no tools: model_type alone does not turn them on."""
    template = json.dumps({"chat_template": "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"})
    directory = _model_dir(tmp_path, "meta-llama--Llama-3.1-8B-Instruct", tokenizer_config__json=template)
    spec = inspect_model(str(directory))
    assert spec.parsers.tool_parser is None
    assert "no tool-call parser is known for model_type llama" in spec.parsers.tool_warning


def test_the_operators_parser_wins_and_silences_the_warning(tmp_path):
    llama = inspect_model("meta-llama/Llama-3.1-8B-Instruct")
    result = plan(llama, parse_gpu_spec("H200:1"), overrides=["--tool-call-parser", "pythonic"])
    assert result.argv.count("--tool-call-parser") == 1
    assert result.argv[result.argv.index("--tool-call-parser") + 1] == "pythonic"
    assert result.reasons["--tool-call-parser"].startswith("operator override (tuned: llama3_json")
    gemma = inspect_model(str(_model_dir(tmp_path, "google--gemma-3-27b-it")))
    chosen = plan(gemma, parse_gpu_spec("H200:1"),
                  overrides=["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    assert not [w for w in chosen.warnings if w.startswith("tool calling is off")]


def test_chat_template_jinja_is_read_before_tokenizer_config(tmp_path):
    """transformers and vLLM prefer chat_template.jinja; its markers, not the JSON's, choose the parsers."""
    directory = _model_dir(tmp_path, "Qwen--Qwen2.5-7B-Instruct",
                           tokenizer_config__json=json.dumps({"chat_template": "no tools here"}),
                           chat_template__jinja="<|im_start|>assistant\n<tool_call>\n")
    spec = inspect_model(str(directory))
    assert spec.parsers.tool_parser == "hermes" and spec.parsers.recognised_by == "chat template markers <tool_call>"


def test_a_list_of_named_templates_is_searched(tmp_path):
    named = [{"name": "default", "template": "<|im_start|>"}, {"name": "tool_use", "template": "<tool_call>"}]
    directory = _model_dir(tmp_path, "Qwen--Qwen2.5-7B-Instruct",
                           tokenizer_config__json=json.dumps({"chat_template": named}))
    assert inspect_model(str(directory)).parsers.tool_parser == "hermes"


def test_an_oversized_template_is_refused_in_one_line(tmp_path):
    directory = _model_dir(tmp_path, "Qwen--Qwen2.5-7B-Instruct", chat_template__jinja="x" * (MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(UsageError, match="cannot read the chat template"):
        inspect_model(str(directory))
