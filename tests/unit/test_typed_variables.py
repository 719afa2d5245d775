"""Every use of a bool, int or float role variable converts it where it is read.

`-e kimi_uninstall_weights=false` reaches the play as the string "false": argument validation accepts it
without converting it, and extra vars outrank set_fact, so nothing can convert it once for all. A string
"false" is truthy and "4" * 2 is "44"; only a `| bool`, `| int` or `| float` at the point of use reads
what the operator meant. This test parses every Jinja expression of the roles, playbooks and inventories
with Jinja's own parser and finds each read of a typed variable that is not filtered by its type.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import pytest
import yaml
from jinja2 import nodes

ROOT = Path(__file__).resolve().parents[2]

TYPE_FILTERS = {"bool": "bool", "int": "int", "float": "float"}
# Filters that may stand between a variable and its type filter: they supply a value, never a type.
PASS_THROUGH_FILTERS = {"default", "d"}
# Task keywords whose strings Ansible evaluates as bare Jinja expressions.
BARE_EXPRESSION_KEYS = {"when", "changed_when", "failed_when", "until", "that"}
LOOP_KEY = re.compile(r"^(loop|with_\w+)$")
# Lookups that read a variable by its name: lookup('vars', 'kimi_x'), query('vars', ...).
LOOKUP_FUNCTIONS = {"lookup", "query", "q"}
ROLE_YAML_DIRS = ("tasks", "handlers", "vars", "defaults", "meta")


def typed_variables() -> dict[str, str]:
    """Each bool, int or float variable of any role's argument_specs, with its type."""
    types: dict[str, str] = {}
    for spec_file in sorted(ROOT.glob("roles/*/meta/argument_specs.yml")):
        specs = yaml.safe_load(spec_file.read_text())["argument_specs"]
        for entry_point in specs.values():
            for name, option in (entry_point.get("options") or {}).items():
                kind = option.get("type", "str")
                if kind not in TYPE_FILTERS:
                    continue
                if types.setdefault(name, kind) != kind:
                    raise AssertionError(f"{spec_file}: {name} is {kind} here, {types[name]} elsewhere")
    return types


def checked_files() -> list[Path]:
    files: list[Path] = []
    for role in sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir()):
        for directory in ROLE_YAML_DIRS:
            files += sorted((role / directory).rglob("*.yml"))
        files += sorted((role / "templates").rglob("*.j2"))
    files += sorted((ROOT / "playbooks").rglob("*.yml"))
    files.append(ROOT / "site.yml")
    files += sorted(p for p in (ROOT / "inventory").rglob("*") if p.is_file())
    return files


@dataclass(frozen=True)
class Expression:
    """A Jinja template (or a bare expression wrapped into one) and the file line it starts on."""

    template: str
    line: int


def _scalar_line(node: yaml.ScalarNode) -> int:
    # A block scalar's text starts on the line after its | or > indicator.
    return node.start_mark.line + 1 + (1 if node.style in ("|", ">") else 0)


def _has_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _string_expressions(node: yaml.Node, bare: bool) -> Iterator[Expression]:
    if isinstance(node, yaml.ScalarNode):
        if node.tag != "tag:yaml.org,2002:str":
            return
        if bare and not _has_jinja(node.value):
            yield Expression("{{ (" + node.value + ") }}", _scalar_line(node))
        elif _has_jinja(node.value):
            yield Expression(node.value, _scalar_line(node))
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _string_expressions(item, bare)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            key_name = key.value if isinstance(key, yaml.ScalarNode) else ""
            bare_value = key_name in BARE_EXPRESSION_KEYS or (
                LOOP_KEY.match(key_name) is not None and isinstance(value, yaml.ScalarNode)
            )
            yield from _string_expressions(value, bare=bare_value)


def yaml_expressions(text: str) -> Iterator[Expression]:
    for document in yaml.compose_all(text, Loader=yaml.SafeLoader):
        if document is not None:
            yield from _string_expressions(document, bare=False)


def file_expressions(path: Path) -> Iterator[Expression]:
    text = path.read_text()
    if path.suffix == ".j2":
        yield Expression(text, 1)
    elif path.suffix in (".yml", ".yaml"):
        yield from yaml_expressions(text)


def _use_of_typed(node: nodes.Node, types: dict[str, str]) -> str | None:
    """The typed variable this node reads, by name or by a name given as a string; None if none."""
    if isinstance(node, nodes.Name) and node.ctx == "load":
        return node.name if node.name in types else None
    if isinstance(node, nodes.Getattr) and node.attr in types:
        return node.attr  # hostvars[host].kimi_x
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value in types:
        return node.arg.value  # vars['kimi_x'], hostvars[host]['kimi_x']
    if (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.Name)
        and node.node.name in LOOKUP_FUNCTIONS
        and node.args
        and isinstance(node.args[0], nodes.Const)
        and node.args[0].value == "vars"
    ):
        for argument in node.args[1:]:
            if isinstance(argument, nodes.Const) and argument.value in types:
                return argument.value
    return None


def _is_typed(use: nodes.Node, parents: dict[int, nodes.Node], wanted_filter: str) -> bool:
    node, parent = use, parents.get(id(use))
    # Both the input and the argument of default(...) flow out of it: x | default(kimi_n) | int types kimi_n.
    while (
        isinstance(parent, nodes.Filter)
        and parent.name in PASS_THROUGH_FILTERS
        and (parent.node is node or any(argument is node for argument in parent.args))
    ):
        node, parent = parent, parents.get(id(parent))
    return isinstance(parent, nodes.Filter) and parent.node is node and parent.name == wanted_filter


def untyped_uses(template: str, types: dict[str, str]) -> list[tuple[int, str]]:
    """(template line, variable) for each read of a typed variable not filtered by its type."""
    tree = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"]).parse(template)
    parents: dict[int, nodes.Node] = {}
    found = []
    stack: list[nodes.Node] = [tree]
    while stack:
        node = stack.pop()
        for child in node.iter_child_nodes():
            parents[id(child)] = node
            stack.append(child)
        name = _use_of_typed(node, types)
        if name is not None and not _is_typed(node, parents, TYPE_FILTERS[types[name]]):
            found.append((node.lineno, name))
    return sorted(found)


def violations(path: Path, types: dict[str, str], root: Path = ROOT) -> list[str]:
    where = path.relative_to(root)
    found = []
    for expression in file_expressions(path):
        try:
            uses = untyped_uses(expression.template, types)
        except jinja2.TemplateSyntaxError as error:
            found.append(f"{where}:{expression.line + (error.lineno or 1) - 1}: Jinja does not parse: {error}")
            continue
        found += [
            f"{where}:{expression.line + line - 1}: {name} ({types[name]}) is used untyped"
            for line, name in uses
        ]
    return found


def test_every_typed_role_variable_is_converted_where_it_is_read():
    types = typed_variables()
    found = [problem for path in checked_files() for problem in violations(path, types)]
    assert not found, "convert with | bool, | int or | float where read:\n" + "\n".join(found)


def test_the_scan_covers_roles_playbooks_and_inventories():
    files = {str(p.relative_to(ROOT)) for p in checked_files()}
    assert "site.yml" in files
    assert "playbooks/uninstall.yml" in files
    assert any(name.startswith("roles/vllm_service/templates/") for name in files)
    assert any(name.startswith("inventory/") for name in files)
    assert {"kimi_uninstall_weights", "kimi_api_port", "kimi_model_free_space_headroom"} <= set(typed_variables())


TOY_TYPES = {"kimi_x": "bool", "kimi_n": "int", "kimi_f": "float"}


@pytest.mark.parametrize(
    "document",
    [
        "a: '{{ kimi_x }}'",
        "when: kimi_x",
        "when: not kimi_x",
        "when: [kimi_x | bool, kimi_n > 2]",
        "that: kimi_x | string",
        "a: '{{ (kimi_x) | bool if true else kimi_x }}'",
        "a: \"{{ kimi_x | default(false) | to_json }}\"",
        "a: \"{{ kimi_n | float }}\"",
        "a: \"{{ kimi_f | int }}\"",
        "a: \"{{ vars['kimi_x'] }}\"",
        "a: \"{{ lookup('vars', 'kimi_n') * 2 }}\"",
        "a: \"{{ hostvars[host]['kimi_x'] }}\"",
        "a: \"{{ hostvars[host].kimi_n + 1 }}\"",
        "a: \"{{ hostvars[host].kimi_n | default(kimi_n) }}\"",
        "a: \"{{ other | default(kimi_n) + 1 }}\"",
        "loop: \"{{ range(kimi_n) }}\"",
        "a: |\n  {% if kimi_x %}on{% endif %}",
    ],
)
def test_the_scan_flags_an_untyped_read(document):
    found = [name for e in yaml_expressions(document) for _, name in untyped_uses(e.template, TOY_TYPES)]
    assert found, document


@pytest.mark.parametrize(
    "document",
    [
        "a: '{{ kimi_x | bool }}'",
        "when: kimi_x | bool",
        "when: not kimi_x | bool",
        "when: [kimi_x | bool, kimi_n | int > 2]",
        "a: \"{{ kimi_x | default(false) | bool | to_json }}\"",
        "a: \"{{ kimi_n | d(0) | int * 2 }}\"",
        "a: \"{{ kimi_f | float }}\"",
        "a: \"{{ vars['kimi_x'] | bool }}\"",
        "a: \"{{ lookup('vars', 'kimi_n') | int * 2 }}\"",
        "a: \"{{ hostvars[host]['kimi_x'] | default(false) | bool }}\"",
        "a: \"{{ hostvars[host].kimi_n | int + 1 }}\"",
        "a: \"{{ hostvars[host].kimi_n | default(kimi_n) | int }}\"",
        "loop: \"{{ range(kimi_n | int) }}\"",
        "a: |\n  {% if kimi_x | bool %}on{% endif %}",
        "a: '{{ kimi_other }} and kimi_x as text'",
        "kimi_x: true",
        "a: '{% set kimi_x = 1 %}'",
    ],
)
def test_the_scan_accepts_a_typed_read(document):
    found = [name for e in yaml_expressions(document) for _, name in untyped_uses(e.template, TOY_TYPES)]
    assert not found, document


def test_a_violation_names_file_line_variable_and_type(tmp_path):
    playbook = tmp_path / "play.yml"
    playbook.write_text("---\n- hosts: all\n  tasks:\n    - name: Remove\n      when: kimi_x\n")
    assert violations(playbook, TOY_TYPES, root=tmp_path) == ["play.yml:5: kimi_x (bool) is used untyped"]
