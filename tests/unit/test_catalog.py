"""The catalog agrees with the published configs and carries the flags each model needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_service import catalog
from kimi_service.model import inspect_model, spec_from_catalog

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
GEOMETRY = (
    "architecture",
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "attention",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "native_max_len",
    "quantization",
    "is_moe",
    "num_experts",
    "experts_per_token",
    "multimodal",
    "trust_remote_code",
)


def test_issue_models_are_in_the_catalog():
    assert set(catalog.names()) >= {
        "moonshotai/Kimi-K2.5",
        "moonshotai/Kimi-K2-Instruct",
        "deepseek-ai/DeepSeek-V3",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-70B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-72B-Instruct-AWQ",
        "MiniMaxAI/MiniMax-M2",
    }


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.repo_id)
def test_catalog_matches_the_published_config(entry):
    published = inspect_model(str(FIXTURES / entry.repo_id.replace("/", "--")))
    known = spec_from_catalog(entry)
    assert {f: getattr(known, f) for f in GEOMETRY} == {f: getattr(published, f) for f in GEOMETRY}
    assert known.kv_bytes_per_token() == published.kv_bytes_per_token()
    # A downloaded copy is recognised as the catalog model, so it gets the catalog's flags.
    assert published.catalog_name == entry.repo_id


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.repo_id)
def test_published_index_sizes_match(entry):
    index = FIXTURES / entry.repo_id.replace("/", "--") / "model.safetensors.index.json"
    if index.exists():
        assert inspect_model(str(index.parent)).weight_bytes == entry.weight_bytes


def test_kimi_k25_flags_and_draft():
    entry = catalog.get("moonshotai/Kimi-K2.5")
    assert entry is not None
    assert "--trust-remote-code" in entry.flags
    parsers = inspect_model(entry.repo_id).parsers
    assert (parsers.tool_parser, parsers.reasoning_parser) == ("kimi_k2", "kimi_k2")
    assert entry.speculative is not None and entry.speculative.method == "eagle3"
    assert entry.weight_bytes == 595 * 10**9


def test_every_entry_cites_a_source_and_runs_somewhere():
    for entry in catalog.ENTRIES:
        assert entry.source and entry.architectures
        assert all(flag in entry.flag_reasons for flag in entry.flags if flag.startswith("--"))


def test_lookup_is_case_insensitive():
    assert catalog.get("QWEN/qwen2.5-7b-instruct") is catalog.get("Qwen/Qwen2.5-7B-Instruct") is not None
    assert catalog.get("nobody/nothing") is None
