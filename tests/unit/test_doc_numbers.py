"""Numbers quoted in the docs and the example inventories agree with where they come from: the planner's own
output, the roles' argument specs, the Python checks, the tags the roles' tasks carry."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from kimi_service import catalog, cli
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import spec_from_catalog
from kimi_service.planner import plan

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "roles"
README = ROOT / "README.md"
GIB = 2**30


def _comment(path: Path) -> str:
    """The leading comment of a YAML file, as one line of text."""
    lines = []
    for line in path.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


# --- The planner's verdict in inventory/example-cluster ---------------------------------------------------

CLUSTER = ROOT / "inventory/example-cluster/hosts.yml"


def _verdict(model: str, gpus: str, nodes: int) -> str:
    """The sentence the inventory's comment gives after "->", from the planner's plans for chat and latency."""
    chat, latency = (plan(spec_from_catalog(catalog.get(model)), parse_gpu_spec(gpus), nodes=nodes, workload=workload)
                     for workload in ("chat", "latency"))
    return (f"-> {chat.parallelism}: {chat.weights_bytes_per_gpu / GIB:.1f} GiB of weights and "
            f"{chat.budget.kv_cache_bytes / GIB:.1f} GiB of KV cache per GPU, max_model_len {chat.max_model_len:,}, "
            f"{chat.kv_cache_tokens:,} KV tokens; with kimi_workload latency: {latency.parallelism}, "
            f"max_model_len {latency.max_model_len:,}, {latency.kv_cache_tokens:,} KV tokens.")


def test_the_cluster_inventory_quotes_the_planners_verdict():
    comment = _comment(CLUSTER)
    command = re.search(r"kimi-service plan --model (\S+) --gpus (\S+) --nodes (\d+)", comment)
    assert command, comment
    model, gpus, nodes = command.group(1), command.group(2), int(command.group(3))
    expected = _verdict(model, gpus, nodes)
    assert expected in comment, f"{CLUSTER.relative_to(ROOT)} should say:\n{expected}"
    size = re.search(r"the model \((\d+) GB of INT4 weights\)", comment)
    assert size and int(size.group(1)) == round(spec_from_catalog(catalog.get(model)).weight_bytes / 1e9), comment


# --- README's sample of `kimi-service plan` ---------------------------------------------------------------

SAMPLE_COMMAND = "$ kimi-service plan --model moonshotai/Kimi-K2.5 --gpus A100-SXM4-80GB:8 --nodes 2"


def _readme_sample() -> list[str]:
    lines = README.read_text().splitlines()
    start = lines.index(SAMPLE_COMMAND) + 1
    return lines[start:lines.index("```", start)]


def _shown_where(sample: list[str], output: list[str]) -> list[str]:
    """The sample's lines that the output does not show: each must be the output's next line (after a line
    "..." any number of them), with "..." inside a line standing for any text; spaces are compared as one."""
    def squeeze(text: str) -> str:
        return " ".join(text.split())

    missing, at = [], 0
    skipping = False
    for line in sample:
        if line.strip() == "...":
            skipping = True
            continue
        pattern = re.compile(".*".join(re.escape(squeeze(part)) for part in line.split("...")))
        for index in range(at, len(output) if skipping else min(at + 1, len(output))):
            if pattern.fullmatch(squeeze(output[index])):
                at, skipping = index + 1, False
                break
        else:
            missing.append(line)
    return missing


def test_the_readmes_plan_sample_is_what_the_planner_prints(capsys):
    assert cli.main(shlex.split(SAMPLE_COMMAND)[2:]) == 0
    output = capsys.readouterr().out.splitlines()
    sample = _readme_sample()
    assert len([line for line in sample if line.strip() != "..."]) >= 5
    assert not _shown_where(sample, output), (
        "README's sample differs from the planner's output; the output now:\n" + "\n".join(output))


def test_the_sample_check_catches_a_changed_number():
    output = ["fits", "parallelism: TP 8 x PP 2", "  KV cache tokens   765,888"]
    assert not _shown_where(["fits", "...", "  KV cache tokens 765,888"], output)
    assert _shown_where(["fits", "...", "  KV cache tokens 964,976"], output)
    assert _shown_where(["fits", "  KV cache tokens 765,888"], output)  # a line left out needs "..."


# --- Example values that are the roles' defaults ------------------------------------------------------------

def _spec_defaults() -> dict[str, object]:
    defaults = {}
    for path in ROLES.glob("*/meta/argument_specs.yml"):
        options = yaml.safe_load(path.read_text())["argument_specs"]["main"].get("options") or {}
        defaults.update({name: option["default"] for name, option in options.items() if "default" in option})
    return defaults


def test_the_balancer_example_shows_the_roles_defaults():
    # Its comment explains each knob by the role's reasoning (retries: a poisoned request reaches one more
    # replica); a value there that is not the default would contradict it.
    example = yaml.safe_load((ROOT / "inventory/example/group_vars/kimi_balancer.yml").read_text())
    defaults = _spec_defaults()
    differing = {name: (value, defaults[name]) for name, value in example.items()
                 if name in defaults and "{{" not in str(defaults[name]) and value != defaults[name]}
    assert not differing, f"example value, role default: {differing}"
    assert "kimi_balancer_retries" in example


# --- Python versions ------------------------------------------------------------------------------------------

def test_the_python_versions_agree():
    bootstrap = (ROOT / "scripts/bootstrap.sh").read_text()
    checked = re.search(r"sys\.version_info < \((\d+), (\d+)\)", bootstrap)
    assert checked, "scripts/bootstrap.sh checks no Python version"
    controller = f"{checked.group(1)}.{checked.group(2)}"
    assert f"Python {controller} or newer is needed" in bootstrap
    said = set(re.findall(r"Python (3\.\d+)\+", README.read_text()))
    assert said == {controller}, f"README says Python {said}; scripts/bootstrap.sh checks {controller}"
    # The package also runs on the GPU hosts, under their own python3: it may ask for less than the controller.
    project = (ROOT / "pyproject.toml").read_text()
    package = re.search(r'^requires-python = ">=(3)\.(\d+)"$', project, re.MULTILINE)
    assert package, "pyproject.toml's requires-python is not >=3.N"
    assert f'target-version = "py{package.group(1)}{package.group(2)}"' in project
    assert (3, int(package.group(2))) <= (int(checked.group(1)), int(checked.group(2)))


# --- The small listeners ------------------------------------------------------------------------------------

def test_the_listener_limits_the_readme_states_are_the_code_s():
    from kimi_service.http_limits import IDLE_TIMEOUT, MAX_HANDLERS
    from kimi_service.launcher.supervisor import UNREADY_AFTER_FAILED_PROBES

    words = {2: "two", 3: "three", 4: "four"}
    text = " ".join(README.read_text().split())
    said = re.search(r"drop a client silent for (\S+) s and handle at most (\d+) connections", text)
    assert said, "README's Security section no longer states the listeners' limits"
    assert (float(said.group(1)), int(said.group(2))) == (IDLE_TIMEOUT, MAX_HANDLERS)
    assert f"turns 503 after {words[UNREADY_AFTER_FAILED_PROBES]} missed `/health` probes in a row" in text


# --- Tags the docs name select tasks ------------------------------------------------------------------------

def _tags(item: dict) -> set[str]:
    tags = item.get("tags", [])
    return {tags} if isinstance(tags, str) else set(tags)


def _file(directory: Path, name: str) -> Path:
    return (directory / (name if name.endswith(".yml") else f"{name}.yml")).resolve()


def _selecting(tasks: list, here: Path, roles: Path, inherited: set[str], gate: set[str] | None,
               seen: frozenset[Path] = frozenset()) -> set[str]:
    """The tags that make `--tags TAG` run at least one task of `tasks` (in directory `here`). A static import
    or a block hands its tags down; a dynamic include runs only when its own tags are selected, and hands down
    only `apply`'s. A file that includes itself again (a poll loop) is walked once."""
    found: set[str] = set()

    def walk(directory: Path, name: str, handed: set[str], opened: set[str] | None) -> set[str]:
        path = _file(directory, name)
        if path in seen:
            return set()
        return _selecting(yaml.safe_load(path.read_text()), path.parent, roles, handed, opened, seen | {path})

    for task in tasks or []:
        own = inherited | _tags(task)
        if "block" in task:
            for part in ("block", "rescue", "always"):
                found |= _selecting(task.get(part), here, roles, own, gate, seen)
            continue
        static = task.get("ansible.builtin.import_tasks") or task.get("import_tasks")
        dynamic = task.get("ansible.builtin.include_tasks") or task.get("include_tasks")
        other_role = task.get("ansible.builtin.import_role") or task.get("ansible.builtin.include_role")
        if isinstance(dynamic, str):
            dynamic = {"file": dynamic}
        if static and "{{" not in static:
            found |= walk(here, static, own, gate)
        elif dynamic and "{{" not in dynamic["file"]:
            found |= walk(here, dynamic["file"], _tags(dynamic.get("apply", {})), own if gate is None else gate & own)
        elif other_role:
            directory, entry = roles / other_role["name"] / "tasks", other_role.get("tasks_from", "main")
            if "ansible.builtin.include_role" in task:
                found |= walk(directory, entry, _tags(other_role.get("apply", {})), own if gate is None else gate & own)
            else:
                found |= walk(directory, entry, own, gate)
        else:
            found |= own if gate is None else own & gate
    return found


def _selectable_tags() -> set[str]:
    found: set[str] = set()
    for playbook in [ROOT / "site.yml", *sorted((ROOT / "playbooks").glob("*.yml"))]:
        for play in yaml.safe_load(playbook.read_text()) or []:
            if "import_playbook" in play or "ansible.builtin.import_playbook" in play:
                found |= _tags(play)
                continue
            for role in play.get("roles", []):
                name = role if isinstance(role, str) else role["role"]
                tasks = _file(ROLES / name / "tasks", "main")
                found |= _selecting(yaml.safe_load(tasks.read_text()), tasks.parent, ROLES, _tags(play), None)
            for part in ("pre_tasks", "tasks", "post_tasks"):
                found |= _selecting(play.get(part), playbook.parent, ROLES, _tags(play), None)
    return found


def _documented_tags() -> dict[str, set[str]]:
    """Tag -> the files naming it: `--tags A,B` anywhere in the docs, roles and playbooks, and each role
    README's "Tags:" list."""
    named: dict[str, set[str]] = {}
    sources = [README, *ROOT.glob("docs/*.md"), *ROLES.glob("*/README.md"), *ROLES.glob("*/tasks/*.yml"),
               *(ROOT / "playbooks").glob("*.yml")]
    for path in sources:
        text = path.read_text()
        tags = [tag for listed in re.findall(r"--(?:skip-)?tags[ =]([\w,]+)", text) for tag in listed.split(",")]
        for listed in re.findall(r"Tags: ((?:`\w+`(?:,\s*|\s+and\s+)?)+)", text):
            tags += re.findall(r"`(\w+)`", listed)
        for tag in tags:
            named.setdefault(tag, set()).add(str(path.relative_to(ROOT)))
    return named


def test_every_tag_the_docs_name_selects_a_task():
    selectable = _selectable_tags()
    documented = _documented_tags()
    assert {"firewall", "firewall_configure", "service"} <= set(documented)
    unknown = {tag: sorted(files) for tag, files in documented.items() if tag not in selectable}
    assert not unknown, f"tags that select nothing (where they are named): {unknown}"


@pytest.mark.parametrize("tasks, selected", [
    ([{"include_tasks": {"file": "enable.yml", "apply": {"tags": ["x"]}}, "tags": ["x"]}], {"x"}),
    ([{"block": [{"name": "t", "tags": ["inner"]}], "tags": ["outer"]}], {"inner", "outer"}),
])
def test_the_tag_walk_follows_includes_as_ansible_does(tasks, selected, tmp_path):
    # A dynamic include whose own tags miss the included task's tag never reaches it (`--tags y` runs nothing).
    (tmp_path / "r/tasks").mkdir(parents=True)
    (tmp_path / "r/tasks/enable.yml").write_text(yaml.safe_dump([{"name": "t", "tags": ["y"]}]))
    assert _selecting(tasks, tmp_path / "r/tasks", tmp_path, set(), None) == selected
