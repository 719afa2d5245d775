"""config.yaml written carelessly or by an attacker: refused at `serve --check` with exit 2 and one line
naming the key, never accepted to fail later (a restart loop) or to undo what kimi-service sets."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_service.cli import main
from kimi_service.config import ConfigError, load_config, parse_config
from kimi_service.engine_flags import option_name


@pytest.fixture
def tmp_path(short_tmp_path: Path) -> Path:
    """The config's state_dir is tmp_path: short enough for vLLM's IPC socket paths."""
    return short_tmp_path


MINIMAL = {"model": {"path": "/var/lib/kimi-service/models/tiny@main"}}
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def _plan(**plan: object) -> dict:
    return {**MINIMAL, "plan": plan}


def _check(tmp_path: Path, yaml_tail: str | bytes, config_json: dict | None = None) -> tuple[int, str, str]:
    """`serve --check` of a config for a tiny CPU model, with `yaml_tail` appended; (exit, stdout, stderr)."""
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config_json or TINY))
    head = f"model:\n  path: {model}\npaths:\n  state_dir: {tmp_path}\n".encode()
    path = tmp_path / "config.yaml"
    path.write_bytes(head + (yaml_tail.encode() if isinstance(yaml_tail, str) else yaml_tail))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["serve", "--check", "--config", str(path)])
    return code, out.getvalue(), err.getvalue()


# Item 7: every spelling vLLM's parser (FlexibleArgumentParser over argparse) could read as a flag that
# kimi-service sets: underscores for dashes, any run of dashes, `=value`, `.key` (vLLM's JSON-dict syntax),
# unambiguous prefixes, and a flag and its value in one item.
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--host", "0.0.0.0"], "--host is set by kimi-service itself; set api.host (kimi_api_host)"),
        (["-host", "0.0.0.0"], "--host (vLLM reads '-host' as --host)"),
        (["---port", "1"], "--port (vLLM reads '---port' as --port)"),
        (["--port=1"], "--port is set by kimi-service itself; set api.port (kimi_api_port)"),
        (["--ho", "0.0.0.0"], "vLLM reads '--ho' as --host"),
        (["--ho=0.0.0.0"], "vLLM reads '--ho' as --host"),
        (["--served_model_name", "x"], "--served-model-name (vLLM reads '--served_model_name'"),
        (["--served-model-name.x", "y"], "set model.served_name (kimi_served_name)"),
        (["--served", "x"], "vLLM reads '--served' as --served-model-name"),
        (["--model=/elsewhere"], "--model is set by kimi-service itself; set model.path"),
        (["--api_key", "k"], "set kimi_api_key (VLLM_API_KEY in secrets.env)"),
        (["--hf_token=k"], "set kimi_hf_token"),
        (["--config", "/tmp/x.yaml"], "--config is set by kimi-service itself"),
        (["--h"], "'--h' may abbreviate --headless or --hf-token or --host"),
        # argparse resolves a unique prefix among all of vLLM's options: these name one reserved flag.
        (["--mod", "/elsewhere"], "'--mod' is ambiguous to vLLM (--model, --model-impl"),
        (["--api-k=x"], "--api-key (vLLM reads '--api-k' as --api-key)"),
        (["--conf", "x.yaml"], "'--conf' is ambiguous to vLLM (--config, --config-format)"),
        (["--uds", "/run/x.sock"], "--uds is refused: the API server would listen on a Unix socket"),
        (["--middle", "evil.Mw"], "--middleware (vLLM reads '--middle' as --middleware) is refused"),
        (["--root-path=/x"], "--root-path is refused"),
        (["--ssl_keyfile", "k.pem"], "--ssl-keyfile (vLLM reads '--ssl_keyfile' as --ssl-keyfile) is refused"),
        (["--trust-request"], "--trust-request-chat-template (vLLM reads"),
        (["--allowed-local", "/"], "--allowed-local-media-path (vLLM reads"),
        (["--no-enable-ssl-refresh"], "--enable-ssl-refresh (vLLM reads '--no-enable-ssl-refresh'"),
        (["--max-num", "8"], "'--max-num' is ambiguous to vLLM (--max-num-batched-tokens, --max-num-partial"),
        (["--host 0.0.0.0"], "is one item holding a flag and more"),
        (["--", "0.0.0.0"], "'--' would make vLLM read what follows as positional"),
        (["--enforce-eager\n--host=0.0.0.0"], "holds a control character"),
        (["--max-num-seqs", "4\n"], "holds a control character"),
    ],
)
def test_extra_args_refuse_every_spelling_of_a_reserved_flag(args: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_plan(extra_args=args))
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("plan.extra_args: ")


@pytest.mark.parametrize(
    "args",
    [["--enforce-eager"], ["--max_num_seqs", "8"], ["-tp", "2"], ["--kv-cache-dtype=fp8"],
     ["--hf-overrides", '{"a": 1}'], ["--model-impl", "vllm"], ["--max-num-seqs", "-1"],
     ["--compilation-config.level", "3"], ["-O3"], ["--no-enable-prefix-caching"], ["--max-num-s", "8"],
     ["--trust-remote-code"], ["--allowed-origins", '["https://a.example"]'], ["--tokenizer", "/models/t"]],
)
def test_extra_args_keep_flags_that_are_not_reserved(args: list[str]) -> None:
    assert parse_config(_plan(extra_args=args)).plan.extra_args == tuple(args)


@pytest.mark.parametrize(
    ("token", "name"),
    [("--served_model_name", "--served-model-name"), ("-host", "--host"), ("---port=1", "--port"),
     ("--served-model-name.a.b", "--served-model-name"),
     ("--compilation_config.max_capture_size", "--compilation-config")],
)
def test_option_names_read_as_vllm_reads_them(token: str, name: str) -> None:
    assert option_name(token) == name


def test_serve_check_refuses_an_abbreviated_host_with_exit_2_and_one_line(tmp_path: Path) -> None:
    code, out, err = _check(tmp_path, "api:\n  host: 127.0.0.1\nplan:\n  engine: cpu\n  extra_args: [--ho, 0.0.0.0]\n")
    assert code == 2 and "would run" not in out
    assert err.count("\n") == 1 and "vLLM reads '--ho' as --host" in err and "kimi_api_host" in err


def test_serve_check_refuses_a_served_name_no_utf8_writer_can_encode_with_exit_2(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.yaml"
    config.write_text('model:\n  path: /m/tiny\n  served_name: "a\\udc80b"\n')  # YAML's escape, as written
    assert main(["serve", "--check", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.served_name: 'a\\udc80b' holds a character that is not printable" in err


# Item 8: values that pass a type check and then break the service.
@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"model": {**MINIMAL["model"], "served_name": "kimi\nX-Injected: 1"}}, "model.served_name: 'kimi\\nX-Inj"),
        ({"model": {**MINIMAL["model"], "served_name": "k\x1b[2J"}}, "holds a control character"),
        ({"model": {**MINIMAL["model"], "served_name": "k\u2028i"}}, "holds a control character"),
        ({"model": {**MINIMAL["model"], "served_name": "a\udc80b"}}, "'a\\udc80b' holds a character that is not "
         "printable (a lone surrogate"),
        ({"model": {**MINIMAL["model"], "served_name": "k\u200bi"}}, "holds a character that is not printable"),
        ({"model": {**MINIMAL["model"], "served_name": "--host"}}, "cannot be a served model name"),
        ({"model": {**MINIMAL["model"], "served_name": " "}}, "cannot be a served model name"),
        ({"model": {"path": "/m\n/x"}}, "model.path: '/m\\n/x' holds a control character"),
        ({**MINIMAL, "api": {"host": "127.0.0.1\n"}}, "api.host: '127.0.0.1\\n' holds a control character"),
        ({**MINIMAL, "serve": {"probe_interval": float("nan")}}, "serve.probe_interval: nan is not a number"),
        ({**MINIMAL, "serve": {"startup_timeout": float("nan")}}, "serve.startup_timeout: nan is not a number"),
        ({**MINIMAL, "serve": {"stop_timeout": float("inf")}}, "serve.stop_timeout: inf is not a number"),
        ({**MINIMAL, "serve": {"drain_timeout": float("-inf")}}, "serve.drain_timeout: -inf is not a number"),
        ({**MINIMAL, "health": {"timeout": float("nan")}}, "health.timeout: nan is not a number"),
        ({**MINIMAL, "exporter": {"health_interval": float("inf")}}, "exporter.health_interval: inf is not"),
        ({**MINIMAL, "serve": {"withdraw_delay": 1e300}}, "serve.withdraw_delay: 1e+300 is out of range"),
        ({**MINIMAL, "plan": {"nodes": 2}}, "plan.nodes: 2 needs a cluster section"),
        # Accepted once, then failing at start: a watchdog no timer holds, a name no exec takes (128 KiB).
        ({**MINIMAL, "serve": {"watchdog_sec": 10**21}}, "serve.watchdog_sec: 1000000000000000000000 is out of"),
        ({"model": {**MINIMAL["model"], "served_name": "k" * 200_000}}, "a name of 200000 characters; use at most"),
        ({**MINIMAL, "plan": {"extra_args": [{"a": "b" * 5000}]}}, "expected a list of strings, got [{'a': 'bbb"),
    ],
)
def test_values_that_would_break_the_running_service_are_refused(data: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("api:\n  host: 127.0.0.1\napi:\n  host: 0.0.0.0\n", "line 7: key 'api' is given twice in one mapping "
         "(first on line 5)"),
        ("api:\n  port: 8000\n  port: 8001\n", "line 7: key 'port' is given twice"),
        ("api: {port: 8000, port: 8001}\n", "key 'port' is given twice"),
        ("plan:\n  extra_env: {A: '1', A: '2'}\n", "key 'A' is given twice"),
    ],
)
def test_duplicate_yaml_keys_are_refused_not_overridden(tmp_path: Path, text: str, fragment: str) -> None:
    code, _, err = _check(tmp_path, text)
    assert code == 2 and fragment in err and err.count("\n") == 1


def test_serve_check_prints_the_planners_warnings(tmp_path: Path) -> None:
    code, out, _ = _check(tmp_path, "plan:\n  engine: cpu\n  max_model_len: 10000000\n")
    assert code == 0
    assert "warning: max_model_len 10,000,000 is above the model's native context 4,096 (" in out
    assert "planned with 4,096" in out


def test_plan_nodes_without_a_cluster_is_refused_from_the_file(tmp_path: Path) -> None:
    code, _, err = _check(tmp_path, "plan:\n  engine: cpu\n  nodes: 2\n")
    assert code == 2 and "plan.nodes: 2 needs a cluster section" in err


def test_load_config_refuses_what_the_yaml_loader_would_otherwise_build(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model: &m\n  path: /m\nplan: *m\n")
    with pytest.raises(ConfigError, match=r"line 3: aliases \(\*m\) are not accepted here"):
        load_config(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming the service user needs root")
@pytest.mark.parametrize("locked", ["the-directory", "a-weights-file"])
def test_serve_check_as_the_service_user_refuses_a_model_it_cannot_read(tmp_path: Path, locked: str) -> None:
    """serve --check --user checks as the user the engine runs as: a model directory it cannot search or a
    file it cannot read is exit 2 naming the user, not a traceback or an engine failing in a restart loop."""
    outer = tmp_path / "models"
    model = outer / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(TINY))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    for directory in (tmp_path, outer, model):
        directory.chmod(0o755)
    (model / "config.json").chmod(0o644)
    (model / "model.safetensors").chmod(0o600 if locked == "a-weights-file" else 0o644)
    if locked == "the-directory":
        outer.chmod(0o700)
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {model}\npaths:\n  state_dir: {tmp_path / 'state'}\n"
                      f"  plan_file: {tmp_path / 'state' / 'plan.json'}\n")
    config.chmod(0o644)
    # A process of its own: --user drops this process's privileges for good.
    run = subprocess.run([sys.executable, "-m", "kimi_service", "serve", "--check", "--config", str(config),
                          "--user", "nobody"], capture_output=True, text=True, timeout=60, check=False,
                         cwd="/", env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    err = run.stderr
    assert run.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "the service user (nobody)" in err
    assert ("cannot read model.safetensors" if locked == "a-weights-file" else "Permission denied") in err
