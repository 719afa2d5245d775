"""Every inventory value lands in the file it is rendered into as the one item it claims to be.

Each template of every role is rendered by Ansible's own templating with each string variable that reaches
it (and each host variable other hosts' files read) set to hostile values: line separators carrying
directives of every format, quotes, `%`, `$(...)`, backticks, `}`, `;`, `#`, NUL. Either the one validation
(roles/kimi_common/tasks/validate.yml, rules in kimi_service/values.py) refuses the value, or the rendered
file parses to exactly the directives the benign render has.
"""

from __future__ import annotations

import configparser
import re
import shlex
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from ansible.errors import AnsibleError
from jinja2 import nodes

from kimi_service import values
from tests.support.unit_templates import REPO, kimi_filters, render_role_template, role_files

TEMPLATES = sorted(REPO.glob("roles/*/templates/*.j2"))
_VALIDATE = yaml.safe_load((REPO / "roles/kimi_common/tasks/validate.yml").read_text())
VALUE_KINDS: dict[str, str] = _VALIDATE[0]["vars"]["_kimi_common_value_kinds"]
HOST_VALUE_KINDS: dict[str, str] = _VALIDATE[1]["vars"]["_kimi_common_host_value_kinds"]

_INJECTED_LINES = ["", "ExecStartPre=/bin/sh -c id", "meta l4proto tcp accept", "[program:root]",
                   "command=/bin/sh", "remote_write: [{url: 'http://203.0.113.66/'}]", "    option httpclose"]
SEPARATORS = ("\n", "\r", "\r\n", "\u2028", "\u2029", "\x85")
PAYLOADS = [*(sep.join(_INJECTED_LINES) for sep in SEPARATORS),
            "\x00", '"', "'", "%n", "$(id)", "`id`", "}", ";", "#", " x", "\\"]
ODD_CHARACTERS = ("\r", "\x00", "\u2028", "\u2029", "\x85")

HOSTS = {
    "gpu-1": {"ansible_host": "203.0.113.10", "kimi_cluster_address": "10.0.0.1"},
    "gpu-2": {"ansible_host": "203.0.113.11", "kimi_cluster_address": "10.0.0.2",
              "kimi_prometheus_scrape_address": "gpu-2.example"},
    "lb": {"ansible_host": "203.0.113.20"},
}
# Every list holds something and every optional feature is on, so that each variable reaches its lines.
BENIGN = {
    "kimi_cluster_group": "kimi_hosts",
    "kimi_model_fanout": True,
    "kimi_served_model_name": "kimi-k2",
    "kimi_api_trusted_cidrs": ["192.0.2.0/24", "2001:db8::/32"],
    "kimi_firewall_allowed_cidrs": ["192.0.2.0/24", "2001:db8::/32"],
    "kimi_firewall_ssh_cidrs": ["198.51.100.0/24", "2001:db8:1::/48"],
    "kimi_firewall_balancer_cidrs": ["203.0.113.20", "2001:db8::20"],
    "kimi_firewall_monitoring_cidrs": ["203.0.113.30", "2001:db8::30"],
    "kimi_firewall_extra_tcp_ports": [9000],
    "kimi_prometheus_alertmanagers": ["alertmanager.example:9093"],
    "kimi_prometheus_vllm_bearer": True,
    "kimi_nvidia_driver_version": "580.95.05",
    "kimi_vllm_extra_args": ["--seed", "1"],
}


def _facts(hosts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    first, *_, balancer = hosts
    replicas = [name for name in hosts if name != balancer]
    return {
        "inventory_hostname": first, "hostvars": hosts,
        "groups": {"all": list(hosts), "kimi_hosts": replicas, "kimi_replicas": replicas,
                   "kimi_balancer": [balancer], "kimi_monitoring": [balancer]},
        "ansible_managed": "Managed by Ansible", "role_path": str(REPO / "roles/kimi_common"),
        "inventory_dir": "/srv/inventory", "playbook_dir": str(REPO), "ansible_port": 22,
        "kimi_host_service_manager": "systemd", "kimi_host_has_systemd": True, "kimi_api_key_effective": "sk-test",
        "_vllm_service_model_bytes": 0, "_vllm_service_uid": 990, "_vllm_service_gid": 990,
        "ansible_facts": {"kernel": "6.8.0-1-generic"}, "_nvidia_driver_repo_distro": "ubuntu2404",
    }


def _role(template: Path) -> str:
    return template.parent.parent.name


def _play_values(role: str, names: Iterable[str], inventory: dict[str, Any], hosts: dict[str, dict[str, Any]]):
    """The values of these variables as the play sees them (defaults that are templates evaluated)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    known = {**role_files("kimi_common", "defaults"), **role_files(role, "defaults"), **inventory,
             **role_files("kimi_common", "vars"), **role_files(role, "vars"), **_facts(hosts)}
    templar = Templar(loader=DataLoader(), variables=known)
    return {name: templar.template(trust_as_template(f"{{{{ {name} }}}}")) for name in names if name in known}


@cache
def _benign(role: str) -> dict[str, Any]:
    return _play_values(role, VALUE_KINDS, BENIGN, HOSTS)


def _derived(role: str) -> set[str]:
    """The variables of the kinds table whose default is computed from others (a template)."""
    defaults = {**role_files("kimi_common", "defaults"), **role_files(role, "defaults")}
    return {name for name, value in defaults.items() if name in VALUE_KINDS and "{" in str(value)}


def _with_payload(benign: Any, payload: str) -> Any:
    if isinstance(benign, list):
        return [*benign[:-1], f"{benign[-1] if benign else ''}{payload}"]
    return f"{benign}{payload}"


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _reaching(template: Path) -> set[str]:
    """The variables a template reads, directly or through the variables it reads (Jinja's own parser)."""
    role = _role(template)

    def read(text: str) -> set[str]:
        return {node.name for node in jinja2.Environment().parse(text).find_all(nodes.Name) if node.ctx == "load"}

    known = {**role_files("kimi_common", "defaults"), **role_files(role, "defaults"),
             **role_files("kimi_common", "vars"), **role_files(role, "vars")}
    todo, seen = read(template.read_text()), set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for text in _strings(known.get(name)):
            todo |= read(str(text)) - seen
    return seen


def _attacks(template: Path):
    """(label, inventory values, hosts) of every hostile case for this template."""
    role, reaching = _role(template), _reaching(template)
    for name in sorted(set(VALUE_KINDS) & reaching):
        benign = _benign(role)[name]
        for payload in PAYLOADS:
            hostile = _with_payload(benign, payload)
            if values.problem(VALUE_KINDS[name], hostile) is None:
                yield f"{name}={hostile!r}", {**BENIGN, name: hostile}, HOSTS
    if not {"hostvars", "groups"} & reaching:
        return
    for name in sorted(set(HOST_VALUE_KINDS) - {"inventory_hostname"}):
        for payload in PAYLOADS:
            hostile = HOSTS["gpu-2"][name] + payload
            if values.problem(HOST_VALUE_KINDS[name], hostile) is None:
                yield f"gpu-2 {name}={hostile!r}", BENIGN, HOSTS | {"gpu-2": HOSTS["gpu-2"] | {name: hostile}}
    for payload in PAYLOADS:
        hostile = "gpu-2" + payload
        if values.problem(HOST_VALUE_KINDS["inventory_hostname"], hostile) is None:
            renamed = {hostile if name == "gpu-2" else name: host for name, host in HOSTS.items()}
            yield f"inventory name {hostile!r}", BENIGN, renamed


def _render(template: Path, inventory: dict[str, Any], hosts: dict[str, dict[str, Any]]) -> str:
    return render_role_template(template, inventory, _facts(hosts))


# Each format's parse, reduced to what must not change: which directives there are, and how many words each has.
def _odd(text: str) -> list[int]:
    return [text.count(character) for character in ODD_CHARACTERS]


def systemd_structure(text: str) -> list[tuple]:
    """Sections and keys of a unit file as systemd reads it: lines joined at a trailing backslash, comments
    skipped; per key the number of specifiers (%x; %% is a percent sign) and of words (Description is prose)."""
    entries: list[tuple] = []
    section, pending = "", ""
    for raw in text.split("\n"):
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending, stripped = "", line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped
            entries.append((section,))
            continue
        key, equals, value = stripped.partition("=")
        specifiers = len(re.findall(r"%[^%]", value.replace("%%", "")))
        entries.append((section, key.strip(), bool(equals), specifiers,
                        0 if key == "Description" else len(value.split())))
    return [*entries, _odd(text)]


def supervisord_structure(text: str) -> list[tuple]:
    """Sections and keys as supervisord reads them (its UnhosedConfigParser: a RawConfigParser with inline
    comments after ; or #, then %(name)s expansion); a command's words as it splits them (shlex)."""
    parser = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"), strict=False)
    parser.read_string(text)
    entries: list[tuple] = []
    for section in parser.sections():
        for key, value in parser.items(section):
            expanded = value % {"here": "/etc", "program_name": "kimi", "ENV_HOME": "/root"}
            words = len(shlex.split(expanded)) if key in ("command", "environment") else len(expanded.split())
            entries.append((section, key, expanded.count("\n"), words))
    return [*entries, _odd(text)]


def nft_structure(text: str) -> list[str]:
    """The ruleset's lines with the contents of every set ({ ... }) left out."""
    return [*(re.sub(r"\{[^{}\n]*\}", "{}", line).strip() for line in text.split("\n")), str(_odd(text))]


def _substitutions(line: str) -> int:
    """$(, ${ and backticks a shell would evaluate: those outside single quotes."""
    count, quoted = 0, False
    for index, character in enumerate(line):
        if character == "'":
            quoted = not quoted
        elif not quoted and (character == "`" or line[index:index + 2] in ("$(", "${")):
            count += 1
    return count


def shell_structure(text: str) -> list[tuple]:
    entries = []
    for line in text.split("\n"):
        try:
            words = len(list(shlex.shlex(line, posix=True, punctuation_chars=True)))
        except ValueError:
            words = -len(line.split())
        entries.append((line.lstrip().startswith("#"), words, _substitutions(line)))
    return [*entries, _odd(text)]


def line_structure(text: str) -> list[tuple]:
    """Line by line: comment or not, and a directive line's words (HAProxy, apt, env files ...)."""
    entries = []
    for line in text.split("\n"):
        comment = line.lstrip().startswith(("#", "//"))
        entries.append((comment, 0 if comment else len(line.split())))
    return [*entries, _odd(text)]


def _shape(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _shape(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_shape(item) for item in node]
    return type(node).__name__


def yaml_structure(text: str) -> Any:
    return [_shape(yaml.safe_load(text)), _odd(text)]


def structure(template: Path, text: str) -> Any:
    name = template.name.removesuffix(".j2")
    if name.endswith((".service", ".timer")):
        return systemd_structure(text)
    if name.endswith("supervisord.conf"):
        return supervisord_structure(text)
    if name.endswith(".nft"):
        return nft_structure(text)
    if name.endswith((".yml", ".yaml")):
        return yaml_structure(text)
    if name.endswith(".sh") or text.startswith("#!/bin/bash"):
        return shell_structure(text)
    return line_structure(text)


def _accepted_by_validation(template: Path, inventory: dict[str, Any], hosts: dict[str, dict[str, Any]]) -> bool:
    """What roles/kimi_common/tasks/validate.yml decides: every value of its tables, as the play sees it."""
    role = _role(template)
    # The values the case changed, and those computed from them; the others are the benign ones.
    changed = [name for name in VALUE_KINDS if name in inventory and inventory[name] != BENIGN.get(name)]
    named = _play_values(role, {*changed, *_derived(role)}, inventory, hosts)
    if values.refusals(named, VALUE_KINDS):
        return False
    return not any(values.refusals({"inventory_hostname": host, **{name: value for name, value in hostvars.items()
                                                                   if name in HOST_VALUE_KINDS}}, HOST_VALUE_KINDS)
                   for host, hostvars in hosts.items())


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: f"{path.parent.parent.name}/{path.name}")
def test_a_hostile_value_is_refused_or_stays_one_item_of_its_file(template):
    benign = structure(template, _render(template, BENIGN, HOSTS))
    injected = []
    for label, inventory, hosts in _attacks(template):
        if not _accepted_by_validation(template, inventory, hosts):
            continue
        try:
            text = _render(template, inventory, hosts)
        except AnsibleError:
            continue  # a kimi_* filter refused to write the value into this format
        try:
            hostile = structure(template, text)
        except (ValueError, KeyError, TypeError, configparser.Error, yaml.YAMLError) as exc:
            injected.append(f"{label}: the file no longer parses ({exc.__class__.__name__}: {exc})")
            continue
        if hostile != benign:
            changed = [line for line in text.split("\n") if line not in _render(template, BENIGN, HOSTS).split("\n")]
            injected.append(f"{label}: changes the file's directives; new lines {changed[:4]!r}")
    assert injected == [], f"{template.relative_to(REPO)}:\n" + "\n".join(injected)


def test_every_string_variable_of_every_role_has_a_kind():
    """A string the operator sets is checked by what it is unless argument_specs already limits it to choices."""
    missing, options = [], set()
    for spec_file in sorted(REPO.glob("roles/*/meta/argument_specs.yml")):
        main = yaml.safe_load(spec_file.read_text())["argument_specs"]["main"]
        for name, option in (main.get("options") or {}).items():
            options.add(name)
            stringish = option.get("type", "str") in ("str", "path") or option.get("elements") in ("str", "path")
            if stringish and "choices" not in option and name not in VALUE_KINDS:
                missing.append(f"{spec_file.parent.parent.name}: {name}")
    assert missing == [], f"string variables without a kind in roles/kimi_common/tasks/validate.yml: {missing}"
    assert set(VALUE_KINDS) - options == set(), "validate.yml names variables no role has"
    unknown = {kind for kind in [*VALUE_KINDS.values(), *HOST_VALUE_KINDS.values()]
               if kind.removesuffix(values.OPTIONAL) not in values.KINDS}
    assert unknown == set()


@pytest.mark.parametrize(("kind", "value"), [
    ("cidr", "::1:\nmeta l4proto tcp accept"), ("cidr", "fe80::1%eth0"), ("cidr", "10.0.0.0/8 "),
    ("cidr", "10.0.0.0/33"), ("ip", "0.0.0.0\n    bind :9999"), ("host", "gpu_1"), ("host", "a..b"),
    ("path", "/opt/kimi\nExecStartPre=/bin/sh"), ("path", "/var/lib/$(id)"), ("path", "/opt/%n"),
    ("path", "relative/dir"), ("path", "/opt/../etc"), ("path", "/opt/kimi/"), ("path", "/opt/a b"),
    ("size", "50MB\ncommand=/bin/sh"), ("duration", "15s\nremote_write:"), ("duration", "1h1d"),
    ("port", "8080\n"), ("port", 0), ("port", "65536"), ("port_range", "60999-32768"),
    ("listen", "127.0.0.1:9090\n--web.enable-admin-api"), ("listen", "::1:9090"),
    ("retry_on", "503\n    server evil 203.0.113.66:80"), ("retry_on", "conn-failure  503"),
    ("url", "https://example.com/x y"), ("url", "ftp://example.com"), ("user", "kimi\n[program:x]"),
    ("word", "580;id"), ("line", "kimi\u2028x"), ("secret", "sk x"), ("model", "a/b\nX=1"),
])
def test_values_that_would_break_out_of_their_file_are_refused(kind, value):
    assert values.problem(kind, value) is not None


@pytest.mark.parametrize(("kind", "value"), [
    ("cidr", "2001:db8::/32"), ("cidr", "10.0.0.5"), ("cidr", "0.0.0.0/0"), ("ip", "::"), ("host", "gpu-1.example"),
    ("host", "fd00::2"), ("path", "/workspace/kimi-service/state"), ("path?", ""), ("size", "50MB"),
    ("duration", "1h30m"), ("port", 8080), ("port", "8080"), ("port_range", "32768-60999"),
    ("listen", "[::1]:9090"), ("listen", ":9090"), ("listen", "am.example:9093"),
    ("retry_on", "conn-failure empty-response 503"), ("url", "https://mirror.example:8443/hf"),
    ("user", "kimi"), ("word", "nvidia-driver=580.*"), ("model", "moonshotai/Kimi-K2.5"), ("model", "/models/k2"),
    ("line", "Kimi K2.5 (100% local)"), ("env", {"NCCL_DEBUG": "INFO"}),
])
def test_values_of_their_kind_pass(kind, value):
    assert values.problem(kind, value) is None


def test_a_refusal_names_the_variable_the_value_and_the_rule_but_never_a_secret():
    found = values.refusals({"kimi_state_dir": "/var/lib/$(id)", "kimi_api_key": "sk\nX"},
                            {"kimi_state_dir": "path", "kimi_api_key": "secret?"})
    assert found[0].startswith("kimi_state_dir: '/var/lib/$(id)' must be an absolute path")
    assert found[1].startswith("kimi_api_key: (a secret: not shown) must be") and "sk" not in found[1]


def test_nftables_sets_take_parsed_addresses_of_their_family_only():
    family = kimi_filters()["kimi_ip_family"]
    items = ["10.0.0.5/32", "10.1.2.3/8", "2001:db8::/32", "gpu-1.example", "::1:\nmeta l4proto tcp accept"]
    assert family(items, 4) == ["10.0.0.5", "10.0.0.0/8"]
    assert family(items, 6) == ["2001:db8::/32"]


@pytest.mark.parametrize("name", ["kimi_systemd", "kimi_supervisord"])
def test_format_filters_keep_a_value_on_its_line_and_escape_percent(name):
    escape = kimi_filters()[name]
    assert escape("Kimi 100%") == "Kimi 100%%"
    with pytest.raises(AnsibleError):
        escape("kimi\nExecStartPre=/bin/sh")
