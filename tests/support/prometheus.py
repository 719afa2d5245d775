"""The real Prometheus tools for the tests: promtool from Debian's `prometheus` package, the rules and
dashboard of monitoring/, and the names of the series their PromQL reads.

promtool compares the annotations of a firing alert verbatim, so the rule unit tests run on a copy of
the rules without annotations (their templates are checked by `promtool check rules` on the originals).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MONITORING = PROJECT_ROOT / "monitoring"
RULES_DIR = MONITORING / "rules"
RULE_TESTS_DIR = MONITORING / "tests"
DASHBOARD = MONITORING / "dashboards" / "kimi-service.json"
# Debian's package puts it here; scripts/bootstrap.sh installs it on the controller.
PROMTOOL = Path("/usr/bin/promtool")
PROMETHEUS = Path("/usr/bin/prometheus")


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not PROMTOOL.exists():
        raise FileNotFoundError(f"{PROMTOOL} is missing: run scripts/bootstrap.sh (Debian's prometheus package)")
    return subprocess.run([str(PROMTOOL), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def rules(path: Path) -> Iterator[dict]:
    for group in yaml.safe_load(path.read_text())["groups"]:
        yield from group["rules"]


def alerts() -> list[dict]:
    return [rule for path in rule_files() for rule in rules(path) if "alert" in rule]


def rule_tests_without_annotations(scratch: Path) -> list[Path]:
    """Copies of monitoring/tests/*.yml next to copies of the rules with their annotations removed."""
    (scratch / "rules").mkdir(parents=True, exist_ok=True)
    for path in rule_files():
        document = yaml.safe_load(path.read_text())
        for group in document["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
        (scratch / "rules" / path.name).write_text(yaml.safe_dump(document, sort_keys=False))
    (scratch / "tests").mkdir(exist_ok=True)
    return [Path(shutil.copy(path, scratch / "tests" / path.name)) for path in sorted(RULE_TESTS_DIR.glob("*.yml"))]


# --- PromQL: the expressions of the rules and the dashboard, and the series they read -------------------

# Grafana's variables, replaced by values Prometheus accepts so the expressions can be parsed and run.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$host": ".*", "$gpu": ".*"}
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
             "bool", "inf", "nan"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()")


def series_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords, labels and durations left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub("", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the selectors of its variables."""
    board = dashboard()
    exprs = [target["expr"] for panel in _panels(board["panels"]) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(re.fullmatch(r"label_values\((.*), *\w+\)", variable["definition"]).group(1))
    return [grafana_to_promql(expr) for expr in exprs]


def rule_expressions() -> list[str]:
    return [rule["expr"] for path in rule_files() for rule in rules(path)]


def names_used() -> set[str]:
    """Every series the alert rules and the dashboard read."""
    return {name for expr in rule_expressions() + dashboard_expressions() for name in series_names(expr)}


def check_expressions(exprs: list[str], scratch: Path) -> subprocess.CompletedProcess:
    """Parse expressions with Prometheus's own parser: as recording rules, through `promtool check rules`."""
    path = scratch / "expressions.yml"
    group = {"name": "expressions", "rules": [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}
    path.write_text(yaml.safe_dump({"groups": [group]}, sort_keys=False))
    return promtool("check", "rules", path)
