"""config.yaml: defaults, and errors that name the key path and what is expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_service import cli
from kimi_service.config import ConfigError, load_config, parse_config

MINIMAL = {"model": {"path": "/var/lib/kimi-service/models/tiny@main"}}


def test_minimal_config_gets_documented_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.model.served_name == "tiny@main"
    assert (cfg.api.host, cfg.api.port) == ("0.0.0.0", 8000)
    assert cfg.api.local_url == "http://127.0.0.1:8000"
    assert cfg.plan.engine == "auto" and cfg.plan.workload == "chat"
    assert cfg.plan.max_model_len is None
    assert cfg.paths.cache_dir == Path("/var/lib/kimi-service/cache")
    assert cfg.paths.plan_file == Path("/run/kimi-service/plan.json")
    assert cfg.exporter.port == 9400


def test_full_config_round_trips() -> None:
    cfg = parse_config({
        "model": {"path": "/m/x", "served_name": "kimi"},
        "api": {"host": "127.0.0.1", "port": 18000},
        "plan": {"engine": "cpu", "workload": "latency", "max_model_len": 4096, "nodes": 1,
                 "extra_args": ["--enforce-eager", "--kv-cache-memory-bytes", "256M"],
                 "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0-3", "OMP_WAIT_POLICY": "PASSIVE", "VLLM_X": 4}},
        "paths": {"state_dir": "/srv/k", "plan_file": "/tmp/plan.json"},
        "serve": {"drain_timeout": 5, "probe_interval": 0.5, "ready_port": 18001, "withdraw_delay": 3},
        "health": {"smoke": False},
        "exporter": {"port": 19400},
    })
    assert cfg.plan.extra_args == ("--enforce-eager", "--kv-cache-memory-bytes", "256M")
    assert cfg.plan.max_model_len == 4096
    assert dict(cfg.plan.extra_env) == {"VLLM_CPU_OMP_THREADS_BIND": "0-3", "OMP_WAIT_POLICY": "PASSIVE", "VLLM_X": "4"}
    assert cfg.paths.cache_dir == Path("/srv/k/cache")  # follows state_dir unless set
    assert cfg.serve.drain_timeout == 5.0
    assert (cfg.serve.ready_port, cfg.serve.withdraw_delay) == (18001, 3.0)
    assert cfg.health.smoke is False


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({**MINIMAL, "api": {"prot": 1}}, "api.prot: unknown key; known keys here are host, port"),
        ({**MINIMAL, "colour": "blue"}, "colour: unknown key"),
        ({"model": {}}, "model.path: required"),
        ({"model": {"path": "relative/dir"}}, "model.path: 'relative/dir' must be an absolute path"),
        ({**MINIMAL, "paths": {"state_dir": "/srv/$(id)"}}, "paths.state_dir: '/srv/$(id)' must be an absolute"),
        ({**MINIMAL, "paths": {"cache_dir": "/srv/%n"}}, "paths.cache_dir: '/srv/%n' must be an absolute path of"),
        ({**MINIMAL, "paths": {"state_dir": "/srv/../etc"}}, "paths.state_dir: '/srv/../etc' must be a normalized"),
        ({**MINIMAL, "api": {"port": 70000}}, "api.port: 70000 is out of range; use >= 1 and <= 65535"),
        ({**MINIMAL, "api": {"port": "8000"}}, "api.port: expected an integer, got a string '8000'"),
        ({**MINIMAL, "api": {"port": True}}, "api.port: expected an integer"),
        ({**MINIMAL, "plan": {"engine": "rocm"}}, "plan.engine: 'rocm' is not one of auto, cuda, cpu"),
        ({**MINIMAL, "plan": {"workload": "fast"}}, "plan.workload: 'fast' is not one of"),
        ({**MINIMAL, "plan": {"extra_args": "--enforce-eager"}}, "plan.extra_args: expected a list of strings"),
        ({**MINIMAL, "plan": {"extra_args": ["--api-key", "x"]}}, "set kimi_api_key (VLLM_API_KEY in secrets.env)"),
        ({**MINIMAL, "plan": {"extra_args": ["--port=1"]}}, "plan.extra_args: --port is set by kimi-service"),
        ({**MINIMAL, "plan": {"extra_env": ["A=1"]}}, "plan.extra_env: expected a mapping of variable names"),
        ({**MINIMAL, "plan": {"extra_env": {"A-B": "1"}}}, "plan.extra_env: 'A-B' is not an environment variable"),
        ({**MINIMAL, "plan": {"extra_env": {"A": True}}}, "plan.extra_env.A: expected a string or integer"),
        ({**MINIMAL, "plan": {"extra_env": {"A": "1\nB=2"}}}, "plan.extra_env.A: a value may not hold a newline"),
        ({**MINIMAL, "plan": {"extra_env": {"VLLM_API_KEY": "k"}}}, "set by kimi-service itself; use kimi_api_key"),
        ({**MINIMAL, "plan": {"extra_env": {"TMPDIR": "/t"}}}, "plan.extra_env.TMPDIR: set by kimi-service itself"),
        ({**MINIMAL, "plan": {"extra_env": {"VLLM_CPU_KVCACHE_SPACE": "4"}}}, "use --kv-cache-memory-bytes"),
        ({**MINIMAL, "plan": {"extra_env": {"NCCL_DEBUG": "INFO"}}}, "belong in cluster.env (kimi_nccl_extra_env)"),
        ({**MINIMAL, "serve": {"drain_timeout": -1}}, "serve.drain_timeout: -1 is out of range; use >= 0"),
        ({**MINIMAL, "health": {"smoke": "yes"}}, "health.smoke: expected true or false"),
        ({**MINIMAL, "api": "localhost"}, "api: expected a mapping of keys, got a string"),
        ({**MINIMAL, "api": {"host": "http://x"}}, "api.host: 'http://x' is not an IP address or host name"),
        ({**MINIMAL, "exporter": {"port": 8000}}, "exporter.port: 8000 is also api.port"),
        ({**MINIMAL, "serve": {"ready_port": 9400}}, "serve.ready_port: 9400 is also the api or exporter port"),
        ({**MINIMAL, "serve": {"withdraw_delay": -1}}, "serve.withdraw_delay: -1 is out of range; use >= 0"),
        (["model"], "the top level: expected a mapping"),
        ({**MINIMAL, "paths": {"state_dir": "/" + "d" * 80}}, "paths.tmp_dir: '/ddd"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(data: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert fragment in str(caught.value)


def test_load_config_reports_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file; pass --config FILE"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  path: /m\n  served_nmae: x\n")
    with pytest.raises(ConfigError, match=r"wrong\.yaml: model\.served_nmae: unknown key"):
        load_config(wrong)


def test_cli_turns_a_config_error_into_exit_2_without_traceback(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  path: /m\napi:\n  port: 0\n")
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "api.port: 0 is out of range" in err
    assert "Traceback" not in err
