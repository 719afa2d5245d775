"""Render the roles' templates as Ansible would.

`render` renders the systemd unit templates of roles/vllm_service, roles/gpu_exporter and roles/firewall
with plain jinja2 and the filters they use (Ansible's own `comment`, so `{{ ansible_managed | comment }}`
renders exactly as in a play, and the project's kimi_* filters); the variables are the defaults of
kimi_common and the roles, plus the derived start window and the firewall's rules file. `fanout_argv`
renders the command line of model_weights' transient fan-out unit. `render_role_template` renders any
template of any role with Ansible's own templating, every role variable evaluated lazily as in a play.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import yaml
from ansible.plugins.filter.core import comment

REPO = Path(__file__).resolve().parents[2]
KIMI_FILTERS_DIR = REPO / "roles" / "kimi_common" / "filter_plugins"
ROLE_OF_UNIT = {
    "kimi-vllm.service": "vllm_service",
    "kimi-exporter.service": "gpu_exporter",
    "kimi-health.service": "gpu_exporter",
    "kimi-health.timer": "gpu_exporter",
    "kimi-firewall.service": "firewall",
}
UNITS = tuple(ROLE_OF_UNIT)


def _defaults(role: str) -> dict[str, object]:
    return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()) or {}


def variables(install_dir: Path, **extra: object) -> dict[str, object]:
    common = _defaults("kimi_common")
    # Paths derived from kimi_persist_root (empty: the usual host paths), evaluated as Ansible would.
    common["kimi_state_dir"] = jinja2.Environment().from_string(common["kimi_state_dir"]).render(common)
    values = {
        **common,
        **_defaults("vllm_service"),
        **_defaults("gpu_exporter"),
        "kimi_served_name": "moonshotai/Kimi-K2.5",
        "ansible_managed": "Managed by Ansible: do not edit",
        "kimi_install_dir": str(install_dir),
        "_vllm_service_model_bytes": 0,
        "_firewall_rules_file": _firewall_rules_file(),
        **extra,
    } | {"_vllm_service_start_timeout": start_timeout(int(extra.get("_vllm_service_model_bytes", 0)))}
    return values | {"_vllm_service_stop_window": _role_var("_vllm_service_stop_window", values)}


def _role_var(name: str, values: dict[str, object]) -> int:
    """A derived value of vllm_service's vars/main.yml, evaluated as Ansible would."""
    role_vars = yaml.safe_load((REPO / "roles" / "vllm_service" / "vars" / "main.yml").read_text())
    return int(jinja2.Environment().from_string(role_vars[name]).render(values))


def _firewall_rules_file() -> str:
    """The firewall role's rules file (vars/main.yml), evaluated as Ansible would."""
    role_vars = yaml.safe_load((REPO / "roles" / "firewall" / "vars" / "main.yml").read_text())
    return jinja2.Environment().from_string(role_vars["_firewall_rules_file"]).render(role_vars)


def fanout_argv(**values: object) -> list[str]:
    """The `systemd-run` command line model_weights starts its fan-out server with (tasks/fanout.yml),
    rendered from `values` over the defaults of kimi_common and model_weights."""
    tasks = yaml.safe_load((REPO / "roles" / "model_weights" / "tasks" / "fanout.yml").read_text())
    block = next(task for task in tasks if "block" in task)["block"]
    start = next(task for task in block if task["name"] == "Start a temporary HTTP server on the first host")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    known = {**_defaults("kimi_common"), **_defaults("model_weights"), **values}
    return [env.from_string(arg).render(known) for arg in start["ansible.builtin.command"]["argv"]]


def start_timeout(model_bytes: int) -> int:
    """The role's derived start window (vars/main.yml), evaluated as Ansible would."""
    role_vars = yaml.safe_load((REPO / "roles" / "vllm_service" / "vars" / "main.yml").read_text())
    expression = role_vars["_vllm_service_start_timeout"]
    return int(jinja2.Environment().from_string(expression).render(_vllm_service_model_bytes=model_bytes))


def render(name: str, values: dict[str, object]) -> str:
    templates = REPO / "roles" / ROLE_OF_UNIT[name] / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True)
    env.filters["comment"] = comment
    env.filters.update(kimi_filters())
    return env.get_template(f"{name}.j2").render(values)


def kimi_filters() -> dict[str, Any]:
    """The project's own filters (roles/kimi_common/filter_plugins), as Ansible loads them."""
    spec = importlib.util.spec_from_file_location("kimi_values_filters", KIMI_FILTERS_DIR / "kimi_values.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def _trusted(node: Any) -> Any:
    """YAML from the roles' own files, trusted as templates the way Ansible trusts the files it loads."""
    from ansible.template import trust_as_template

    if isinstance(node, str):
        return trust_as_template(node)
    if isinstance(node, dict):
        return {key: _trusted(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_trusted(value) for value in node]
    return node


def role_files(role: str, kind: str) -> dict[str, Any]:
    """A role's defaults or vars (kind), trusted as templates."""
    return copy.copy(_role_files(role, kind))


@cache
def _role_files(role: str, kind: str) -> dict[str, Any]:
    path = REPO / "roles" / role / kind / "main.yml"
    return _trusted(yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def render_role_template(template: Path, inventory: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
    """`template` (roles/ROLE/templates/NAME.j2) rendered by Ansible's templating as the template module does:
    the defaults of kimi_common and the role under the `inventory` values, their vars/main.yml above them (role
    vars outrank the inventory), `facts` (set_fact, magic variables) on top; each evaluated when it is read."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import add_all_plugin_dirs
    from ansible.template import Templar, trust_as_template

    add_all_plugin_dirs(str(KIMI_FILTERS_DIR.parent))
    role = template.parent.parent.name
    known = {**role_files("kimi_common", "defaults"), **role_files(role, "defaults"), **inventory,
             **role_files("kimi_common", "vars"), **role_files(role, "vars"), **facts}
    templar = Templar(loader=DataLoader(), variables=known).copy_with_new_env(searchpath=[str(template.parent)])
    return templar.template(trust_as_template(template.read_text()), escape_backslashes=False)
