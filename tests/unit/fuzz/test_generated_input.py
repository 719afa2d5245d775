"""Generated input at every entry point reachable in-process: only what must always hold is asserted.

A refusal is the documented error type (exit 2 at the CLI) with a one-line message, never another
exception; what is accepted carries no reserved flag into the engine's argv; nothing runs unbounded.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import string
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from kimi_service import engine_flags, exporter, health, tuned, values
from kimi_service.cli import main
from kimi_service.config import Config, ConfigError, parse_config
from kimi_service.envfile import EnvFileError, parse_env_file
from kimi_service.errors import UsageError
from kimi_service.hardware import parse_gpu_spec
from kimi_service.launcher.engine import kv_tokens_from_metrics, requests_in_flight
from kimi_service.model import inspect_model
from kimi_service.yaml_input import YamlRefused, load_yaml
from tests.unit.fuzz.conftest import chosen_profile

PROFILE = chosen_profile()
FLAGS = sorted(engine_flags.vllm_flags())
JUDGED = sorted({*engine_flags.RESERVED, *engine_flags.REFUSED})

# JSON values of every shape, numbers included that JSON itself cannot write (nan, inf).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def flag_spellings(draw) -> str:
    """A vLLM flag the way an operator might write it: a prefix, `_` for `-`, extra dashes, `=value`,
    `.key`, or `--no-`."""
    flag = draw(st.sampled_from(FLAGS + JUDGED))
    name = flag[2:]
    name = name[: draw(st.integers(1, len(name)))]
    if draw(st.booleans()):
        name = name.replace("-", "_")
    dashes = draw(st.sampled_from(["--", "-", "---"]))
    token = dashes + draw(st.sampled_from(["", "no-"])) + name
    return token + draw(st.sampled_from(["", "=1", ".key", "=/x"]))


def _one_line(exc: BaseException) -> None:
    assert str(exc) and "\n" not in str(exc).strip() and "Traceback" not in str(exc)


def _assert_no_reserved_flag(argv: tuple[str, ...]) -> None:
    for token in argv:
        if token.startswith("-") and len(engine_flags.resolve(token)) == 1:
            assert not engine_flags.reserved_flags(token), token


@PROFILE
@given(st.lists(flag_spellings() | st.text(max_size=12), max_size=6))
@example(["--api-k=x"])
@example(["--no-enable-ssl-refresh"])
@example(["--middle", "m.M"])
@example(["--h"])
def test_extra_args_never_carry_a_reserved_flag(args: list[str]) -> None:
    try:
        config = parse_config({"model": {"path": "/m"}, "plan": {"extra_args": args}})
    except ConfigError as exc:
        _one_line(exc)
        return
    _assert_no_reserved_flag(config.plan.extra_args)


@PROFILE
@given(st.text(max_size=400) | st.builds(yaml.safe_dump, json_values))
@example("model: !!python/object/apply:os.system ['true']\n")
@example("model: {path: /m}\napi: {port: " + "9" * 5000 + "}\n")
@example("model: {path: /m}\napi: {port: 0o777}\nhealth: {timeout: .inf}\n")
@example("model: {path: /m}\n1: x\n? [a]\n: y\n")
@example("model: {path: \"/m\\x00\"}\n")
@example("\x1f")
@example("model: {path: /m}\nplan: {extra_env: {FORWARDED_ALLOW_IPS: '*'}}\n")
def test_config_yaml_is_a_config_or_one_line_refusal(text: str) -> None:
    try:
        config = parse_config(load_yaml(text.encode("utf-8", "surrogatepass")))
    except (YamlRefused, ConfigError) as exc:
        _one_line(exc)
        return
    except UnicodeEncodeError:
        return
    assert isinstance(config, Config)
    assert "FORWARDED_ALLOW_IPS" not in config.plan.extra_env
    _assert_no_reserved_flag(config.plan.extra_args)


@PROFILE
@given(st.binary(max_size=300) | st.text(max_size=300).map(lambda t: t.encode("utf-8", "replace")))
@example(b"A='unterminated\nB=\\\n")
def test_env_files_are_variables_or_one_line_refusal(data: bytes) -> None:
    try:
        variables = parse_env_file(data)
    except EnvFileError as exc:
        _one_line(exc)
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())


@PROFILE
@given(st.text(alphabet=string.printable + "\u0668\u0662\u00d7", max_size=30))
@example("H100:٨")
@example("٨xH100")
@example("H100:8:1e400GiB")
@example("cpu:nan")
def test_gpu_specs_are_an_inventory_or_one_line_refusal(spec: str) -> None:
    try:
        inventory = parse_gpu_spec(spec)
    except UsageError as exc:
        _one_line(exc)
        return
    assert inventory.count >= 1 if not inventory.is_cpu else inventory.count >= 0


@PROFILE
@given(st.sampled_from(["--max-model-len", "--nodes", "--timeout"]),
       st.text(alphabet=string.digits + "٨.-+eEinfa_", min_size=1, max_size=12))
@example("--nodes", "٢")
@example("--timeout", "nan")
@example("--max-model-len", "1e400")
def test_numeric_options_exit_0_2_or_3(capsys, option: str, value: str) -> None:
    try:
        code = main(["plan", "--gpus", "H100:1", "--model", "Qwen/Qwen2.5-7B-Instruct", option, value])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 2, 3) and "Traceback" not in err


@PROFILE
@given(json_values, st.sampled_from(["config.json", "model.safetensors.index.json", "hf_quant_config.json"]))
@example({"hidden_size": 0, "num_hidden_layers": -1}, "config.json")
@example({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 0}, "config.json")
@example({"metadata": {"total_size": 1e400}}, "model.safetensors.index.json")
def test_model_directories_are_a_spec_or_one_line_refusal(tmp_path_factory, data, name: str) -> None:
    directory = tmp_path_factory.mktemp("model")
    base = json.loads(Path("tests/fixtures/models/Qwen--Qwen2.5-7B-Instruct/config.json").read_text())
    (directory / "config.json").write_text(json.dumps(data if name == "config.json" else base))
    if name != "config.json":
        (directory / name).write_text(json.dumps(data))
    try:
        spec = inspect_model(str(directory))
    except UsageError as exc:
        _one_line(exc)
        return
    assert spec.num_layers > 0


@PROFILE
@given(json_values | st.fixed_dictionaries({"flags": st.lists(flag_spellings() | st.text(max_size=8), max_size=6),
                                            "workload": json_values, "key": st.text(max_size=16)}))
@example({"flags": ["--host", "0.0.0.0"], "workload": {}, "key": ""})
def test_tuned_json_never_carries_a_reserved_flag(tmp_path_factory, document) -> None:
    directory = tmp_path_factory.mktemp("state")
    path = directory / tuned.TUNED_FILE
    path.write_text(json.dumps(document))
    read = tuned.read_tuned(path)
    if read is None:
        return
    config = parse_config({"model": {"path": str(directory)}})
    flags, _why = tuned.tuned_flags(read, config, vllm_version="0.21.0", hardware="H100:1")
    _assert_no_reserved_flag(tuple(flags))


@PROFILE
@given(st.text(max_size=200) | st.builds(json.dumps, json_values))
@example("[" * 100_000)
@example('{"a": NaN}')
def test_plan_json_is_read_or_ignored(tmp_path_factory, text: str) -> None:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(text, errors="surrogatepass")
    document = exporter.read_plan(path)
    assert document is None or isinstance(document, dict)


@PROFILE
@given(st.binary(max_size=300) | st.builds(lambda v: json.dumps(v).encode(), json_values))
@example(b"[" * 100_000)
@example(b'{"data": [{"id": NaN}]}')
def test_engine_answers_are_judged_never_raised(body: bytes) -> None:
    response = httpx.Response(200, content=body, request=httpx.Request("GET", "http://127.0.0.1/v1/models"))
    ids = health._model_ids(response)
    assert ids is None or isinstance(ids, list)
    assert isinstance(health._has_choices(response), bool)
    text = body.decode("utf-8", "replace")
    for parse in (kv_tokens_from_metrics, requests_in_flight):
        with contextlib.suppress(ValueError):  # the callers catch it: metrics text that does not parse
            parse(text)


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_device_files_are_bounded(path: str, tmp_path: Path) -> None:
    assert exporter.read_plan(Path(path)) is None
    assert tuned.read_tuned(Path(path)) is None


# Inventory values: the characters that would rewrite the file a value is rendered into, mixed with
# those that make up ordinary values of every kind.
HOSTILE_PIECES = ["\n", "\r", "\x00", "\u2028", "\x85", "%", "$(", "`", "'", '"', "}", "{{", ";", "#", " ",
                  "\t", "\\", ":", "/", ".", "-", "[", "]", "::1", "10.0.0.1", "/24", "%i"]
inventory_text = st.lists(st.sampled_from(HOSTILE_PIECES) | st.text(string.ascii_letters + string.digits, max_size=4),
                          max_size=8).map("".join)
# Kinds whose accepted values are one token: nothing in them a file's parser would split on. A secret may
# hold any printable character but a space: it lands only in secrets.env, written quoted.
ONE_TOKEN = sorted(set(values.KINDS) - {"line", "local_path", "env", "secret"})


@PROFILE
@given(kind=st.sampled_from(sorted(set(values.KINDS) - {"env"})), value=inventory_text)
@example(kind="cidr", value="::/0\nmeta l4proto tcp accept")
@example(kind="path", value="/opt/kimi$(id)")
def test_inventory_values_are_refused_or_land_as_one_line(kind: str, value: str) -> None:
    """What validation accepts is written into systemd units, supervisord, HAProxy, nftables and Prometheus
    files: it is one line with no control character, and a one-token kind holds no space or quote."""
    rule = values.problem(kind, value)
    if rule is not None:
        assert isinstance(rule, str) and "\n" not in rule
        return
    assert not engine_flags.has_control(value), (kind, value)
    if kind in ONE_TOKEN:
        assert not any(c in value for c in " \t'\"`"), (kind, value)
    if kind == "path":
        assert not any(c in value for c in "$%;#{}\\"), value
    if kind in ("ip", "cidr"):
        assert str(ipaddress.ip_network(value, strict=False)), value
