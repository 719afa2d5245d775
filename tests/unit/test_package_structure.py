"""The package stays readable: no import circle among its modules, and no module, function or positional
parameter list past the sizes a newcomer can take in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kimi_service"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL_PARAMETERS = 6  # self and cls count; keyword-only parameters (after `*`) do not


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, tree: ast.AST) -> set[str]:
    """The package's modules this one imports, at load time or inside a function alike. `from P import
    name` names module P.name when that is a module, else P itself; the parent packages Python also
    loads on the way are not counted (they would make every package with a facade look circular)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names)
    return {name for name in found if name in MODULES and name != module}


def import_graph() -> dict[str, set[str]]:
    return {module: _imported(module, ast.parse(path.read_text())) for module, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it (first repeated last), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            if cycle := visit(target, [*path, module]):
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module, []):
            return cycle
    return None


def test_the_graph_sees_the_package_imports():
    graph = import_graph()
    assert "kimi_service.planner.fit" in graph["kimi_service.planner.planning"]
    assert "kimi_service.planner" in graph["kimi_service.cli.model"]  # `from kimi_service import planner`, in a def
    assert "kimi_service.catalog" in graph["kimi_service.model"]


def test_the_circle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_package_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_catalog_is_pure_data():
    assert import_graph()["kimi_service.catalog"] == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_functions_and_parameter_lists_stay_small(module: str):
    path = MODULES[module]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{module} has {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = f"{module}.{node.name} (line {node.lineno})"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{where} is {length} lines long"
            positional = len(node.args.posonlyargs) + len(node.args.args)
            assert positional <= MAX_POSITIONAL_PARAMETERS, (
                f"{where} takes {positional} positional parameters; make the rest keyword-only or pass a dataclass"
            )
