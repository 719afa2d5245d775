"""Fast checks of the device scripts' pure logic: model shapes, shard plans, the results summary."""

from __future__ import annotations

import json
from pathlib import Path

import make_model
import summarize
import tune_table


def test_llama_8b_shape_has_the_published_parameter_count():
    shapes = make_model.tensor_shapes(make_model.SHAPES["llama-3.1-8b"])
    # Meta's Llama 3.1 8B model card: 8,030,261,248 parameters; 291 tensors in its index.
    assert sum(make_model._numel(d) for d in shapes.values()) == 8_030_261_248
    assert len(shapes) == 291
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)  # 8 KV heads x 128


def test_deepseek_v3_tensors_add_up_to_the_published_parameter_count():
    # DeepSeek-V3's 61 layers (3 dense) and 256 routed experts: the technical report's 671 B parameters
    # of the main model (the multi-token-prediction module's 14 B are not written).
    full = make_model.MlaMoeShape(num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256)
    shapes = make_model.tensor_shapes(full)
    assert sum(make_model._numel(d) for d in shapes.values()) == 671_026_419_200
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert "model.layers.2.mlp.gate.weight" not in shapes
    assert shapes["model.layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.60.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)


def test_the_one_gpu_mla_shape_is_what_its_config_describes():
    shape = make_model.SHAPES["deepseek-v3-4l"]
    config = shape.config()
    assert (config["architectures"], config["num_hidden_layers"], config["n_routed_experts"]) == (
        ["DeepseekV3ForCausalLM"], 4, 32)
    shapes = make_model.tensor_shapes(shape)
    assert [f"model.layers.{i}.mlp.gate.weight" in shapes for i in range(4)] == [False, True, True, True]
    assert 14e9 < 2 * sum(make_model._numel(d) for d in shapes.values()) < 15e9


def test_shards_stay_under_the_limit_and_keep_every_tensor_once():
    shapes = make_model.tensor_shapes(make_model.SHAPES["llama-3.1-70b-16l"])
    groups = make_model.plan_shards(shapes, make_model.SHARD_BYTES)
    flat = [name for group in groups for name in group]
    assert flat == list(shapes)
    for group in groups:
        size = sum(2 * make_model._numel(shapes[n]) for n in group)
        assert size <= make_model.SHARD_BYTES or len(group) == 1


def _level(conc: int, tok_s: float, goodput: float, tpot: float = 0.01) -> dict:
    dist = {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {"concurrency": conc, "errors": 0, "output_tokens_per_s": tok_s, "requests_per_s": goodput,
            "goodput_requests_per_s": goodput, "ttft_s": dist, "itl_s": dist, "e2e_s": dist,
            "tpot_s": {**dist, "p50": tpot}}


def _write(results: Path, name: str, levels: list[dict]) -> None:
    (results / name).write_text(json.dumps({"levels": levels}))


def test_summary_computes_the_issue_targets(tmp_path: Path):
    _write(tmp_path, "bench-naive-p0.json", [_level(1, 30, 0.2, 0.03), _level(16, 30, 0.0)])
    _write(tmp_path, "bench-vllm-default-p0.json", [_level(1, 200, 1.5, 0.005), _level(16, 2000, 10)])
    _write(tmp_path, "bench-vllm-default-p2000.json", [_level(16, 1500, 4)])
    _write(tmp_path, "bench-kimi-shared-prefix-p2000.json", [_level(16, 1800, 6)])
    _write(tmp_path, "bench-kimi-chat-p0.json", [_level(1, 190, 1.4, 0.005), _level(16, 2100, 11)])
    (tmp_path / "roofline.json").write_text(json.dumps({
        "copy_bandwidth_bytes_per_s": 4e12, "weight_bytes": 16e9,
        "roofline_s_per_token": 0.004, "roofline_tokens_per_s": 250.0}))
    (tmp_path / "kv-kimi-chat.json").write_text(json.dumps(
        {"config": "kimi-chat", "vllm_kv_tokens": 1000, "predicted_kv_tokens": 1120}))
    lines, summary = summarize.summarize(tmp_path)
    targets = summary["targets"]
    assert targets["vllm_vs_naive_c16"]["speedups"]["vllm-default"] == 2000 / 30
    assert targets["vllm_vs_naive_c16"]["met"]
    assert targets["decode_vs_roofline"]["fractions"]["vllm-default"] == 0.004 / 0.005
    assert targets["decode_vs_roofline"]["met"]
    assert targets["shared_prefix_goodput"]["ratios"] == [1.5]
    assert targets["shared_prefix_goodput"]["met"]
    # 190 < 200 tokens/s at concurrency 1: the planner lost there, and the summary must say so.
    assert targets["planner_vs_defaults"]["rows"]["kimi-chat-p0"][1]["throughput"] == 0.95
    assert not targets["planner_vs_defaults"]["met"]
    assert targets["kv_prediction"]["rows"]["kimi-chat"]["ratio"] == 1.12
    assert not targets["kv_prediction"]["met"]
    assert lines[-1].startswith("Targets: ") and "kv_prediction MISSED" in lines[-1]


def _tune_level(conc: int, tok: float, good: float, traffic: str | None = None) -> dict:
    # 32 requests, as many of them within the SLO's TTFT bound as the goodput says.
    in_slo = round(good * 1000 / tok)
    outcomes = [{"ok": True, "ttft": 0.1 if i < in_slo else 5.0, "tpot": 0.01, "e2e": 1000 / tok / 32 * conc,
                 "max_itl": 0.01} for i in range(32)]
    level = {"concurrency": conc, "output_tokens_per_s": tok, "goodput_requests_per_s": good, "errors": 0,
             "duration_s": 1000 / tok, "requests": 32, "outcomes": outcomes}
    return {**level, "traffic": traffic} if traffic else level


def _tune_dir(tmp_path: Path, winner_by: dict[str, float], defaults_by: dict[str, float]) -> Path:
    """A tuner's store and vLLM-default reports for two shapes at concurrency 1 and 16."""
    (tmp_path / "measurements").mkdir()
    (tmp_path / "defaults").mkdir()
    shapes = {"512/128": (512, 128, 0), "8192/256": (8192, 256, 0)}
    for name, flags, by in (("plan", [], {}), ("cap", ["--max-num-seqs", "16"], winner_by)):
        levels = [_tune_level(c, 100 * c * by.get(label, 1), c * by.get(label, 1), label)
                  for label in shapes for c in (1, 16)]
        (tmp_path / "measurements" / f"{name}.json").write_text(json.dumps(
            {"candidate": {"name": name, "flags": flags}, "levels": levels}))
    for label, (inp, out, prefix) in shapes.items():
        ratio = defaults_by.get(label, 1)
        (tmp_path / "defaults" / f"{label.replace('/', '-')}.json").write_text(json.dumps(
            {"input_len": inp, "output_len": out, "shared_prefix_len": prefix,
             "levels": [_tune_level(c, 100 * c * ratio, c * ratio) for c in (1, 16)]}))
    (tmp_path / "tuned.json").write_text(json.dumps({
        "flags": ["--max-num-seqs", "16"], "reasons": {"--max-num-seqs": "measured: 1.40x"},
        "workload": {"concurrency": [1, 16], "input_len": 512, "output_len": 128, "prompts": 32,
                     "shared_prefix_len": 0, "slo": {"ttft": 1.0, "itl": 0.1},
                     "more_shapes": [{"input_len": 8192, "output_len": 256, "shared_prefix_len": 0}]},
        "candidates": [{"name": "cap", "flags": ["--max-num-seqs", "16"], "decision": "wins", "reason": "1.40x"}]}))
    return tmp_path


def test_tune_table_compares_the_winner_with_vllm_defaults_per_shape(tmp_path: Path):
    directory = _tune_dir(tmp_path, winner_by={"8192/256": 1.4}, defaults_by={"512/128": 1.01})
    tuned = json.loads((directory / "tuned.json").read_text())
    table = tune_table.rows(tuned, tune_table.load_measurements(directory / "measurements"),
                            tune_table.load_defaults(directory / "defaults"))
    assert [(row["shape"], row["concurrency"]) for row in table] == [
        ("512/128", 1), ("512/128", 16), ("8192/256", 1), ("8192/256", 16)]
    long_row = table[3]
    assert (long_row["plan_tok_s"], long_row["tuned_tok_s"], long_row["defaults_tok_s"]) == (1600, 2240, 1600)
    verdict = tune_table.targets(table)
    assert round(verdict["worst_ratio"], 3) == round(1 / 1.01, 3) and verdict["floor_met"]
    assert verdict["best_shape"] == "8192/256" and verdict["target_met"]
    text = tune_table.render(tuned, table, verdict)
    assert "Tuner's choice: --max-num-seqs 16" in text and "| 8192/256 | 16 | 1600 | 1600 | 2240 | 1.40 |" in text


def test_tune_table_counts_a_gain_where_vllm_defaults_met_the_slo_with_no_request(tmp_path: Path):
    directory = _tune_dir(tmp_path, winner_by={}, defaults_by={})
    for path in (directory / "defaults").glob("8192*.json"):
        report = json.loads(path.read_text())
        for level in report["levels"]:
            level["goodput_requests_per_s"] = 0.0
            for outcome in level["outcomes"]:
                outcome["ttft"] = 5.0
        path.write_text(json.dumps(report))
    tuned = json.loads((directory / "tuned.json").read_text())
    table = tune_table.rows(tuned, tune_table.load_measurements(directory / "measurements"),
                            tune_table.load_defaults(directory / "defaults"))
    verdict = tune_table.targets(table)
    # 10 requests in the SLO against none: (10 + 0.5) / 0.5 at each level.
    assert verdict["best_shape"] == "8192/256" and round(verdict["best_gain"], 6) == 21.0
    assert verdict["goodput_gain_by_shape"]["512/128"] == 1.0


def test_tune_table_says_when_a_target_is_missed(tmp_path: Path):
    directory = _tune_dir(tmp_path, winner_by={"8192/256": 1.1}, defaults_by={"512/128": 1.05})
    assert tune_table.main([str(directory), "--json", str(tmp_path / "t.json")]) == 0
    verdict = json.loads((tmp_path / "t.json").read_text())["targets"]
    assert not verdict["floor_met"] and round(verdict["worst_ratio"], 3) == round(1 / 1.05, 3)
    assert not verdict["target_met"] and round(verdict["best_gain"], 2) == 1.10


def test_tune_table_without_a_defaults_sweep_shows_the_tuners_comparison_and_claims_no_target(tmp_path: Path):
    directory = _tune_dir(tmp_path, winner_by={"8192/256": 1.4}, defaults_by={})
    for path in (directory / "defaults").glob("*.json"):
        path.unlink()
    for path in (directory / "measurements").glob("*.json"):  # a tune of one shape labels no level
        data = json.loads(path.read_text())
        data["levels"] = [{k: v for k, v in level.items() if k != "traffic"} for level in data["levels"]
                          if level["traffic"] == "512/128"]
        path.write_text(json.dumps(data))
    assert tune_table.main([str(directory), "--json", str(tmp_path / "t.json")]) == 0
    written = json.loads((tmp_path / "t.json").read_text())
    assert [(row["shape"], row["concurrency"], row["plan_tok_s"], row["defaults_tok_s"])
            for row in written["rows"]] == [("512/128", 1, 100, None), ("512/128", 16, 1600, None)]
    assert written["targets"]["worst_ratio"] is None and not written["targets"]["target_met"]
    text = tune_table.render(written["tuned"], written["rows"], written["targets"])
    assert "| 512/128 | 16 | - | 1600 | 1600 | - | - | 16.00 [8.00, 24.00] | 16.00 [8.00, 24.00] | - |" in text
    assert "were not swept in this run" in text and "at every point" not in text
