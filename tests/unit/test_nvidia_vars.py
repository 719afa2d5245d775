"""The per-OS data of nvidia_driver renders NVIDIA's published repository lines and package names.

Expected values are written out here from NVIDIA's Driver Installation Guide (r580) and the repository
indexes under https://developer.download.nvidia.com/compute/cuda/repos/<distro>/x86_64/, independently
of the vars files, so a typo or a wrong branch substitution in a vars file fails.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import yaml
from ansible.plugins.filter.core import to_bool

ROLE = Path(__file__).resolve().parents[2] / "roles" / "nvidia_driver"
NVIDIA = "https://developer.download.nvidia.com/compute/cuda/repos"

EXPECTED = {
    "Debian-12": {
        "distro": "debian12",
        "kernel_open": ["nvidia-kernel-open-dkms"],
        "kernel_proprietary": ["nvidia-kernel-dkms"],
        "userspace": ["nvidia-driver-cuda", "libcuda1", "libnvidia-ml1", "nvidia-persistenced"],
        "fabricmanager": ["nvidia-fabricmanager", "libnvidia-nscq"],
    },
    **{
        f"Ubuntu-{major}": {
            "distro": f"ubuntu{major}04",
            "kernel_open": ["nvidia-dkms-{b}-open"],
            "kernel_proprietary": ["nvidia-dkms-{b}"],
            "userspace": ["libnvidia-compute-{b}", "nvidia-utils-{b}", "nvidia-compute-utils-{b}"],
            "fabricmanager": ["nvidia-fabricmanager-{b}", "libnvidia-nscq-{b}"],
        }
        for major in ("22", "24")
    },
}


def render(os_name: str, **operator) -> dict:
    """Resolve the role's vars like Ansible does: defaults < operator vars, then lazy templating."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["regex_replace"] = lambda value, pattern, repl: __import__("re").sub(pattern, repl, value)
    env.filters["bool"] = to_bool
    context = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    context.update(operator)
    raw = {**yaml.safe_load((ROLE / f"vars/{os_name}.yml").read_text()),
           **yaml.safe_load((ROLE / "vars/main.yml").read_text())}
    context.update(raw)

    def resolve(value):
        if isinstance(value, str) and "{{" in value:
            for _ in range(5):  # nested references resolve within a few passes
                rendered = env.from_string(value).render(context)
                if "{{" not in rendered:
                    break
                value = rendered
            try:
                return yaml.safe_load(rendered) if rendered.strip().startswith("[") else rendered
            except yaml.YAMLError:
                return rendered
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    resolved = {}
    for name, value in raw.items():
        try:
            resolved[name] = resolve(value)
        except jinja2.UndefinedError:
            continue  # derived from a task's result (registered at run time)
    return resolved


@pytest.mark.parametrize("os_name", sorted(EXPECTED))
@pytest.mark.parametrize("branch", ["580", "590"])
def test_package_names_follow_nvidia_naming(os_name, branch):
    expected = {k: [n.format(b=branch) for n in v] if isinstance(v, list) else v for k, v in EXPECTED[os_name].items()}
    data = render(os_name, kimi_nvidia_driver_branch=branch)
    assert data["_nvidia_driver_kernel_packages"]["open"] == expected["kernel_open"]
    assert data["_nvidia_driver_kernel_packages"]["proprietary"] == expected["kernel_proprietary"]
    assert data["_nvidia_driver_userspace_packages"] == expected["userspace"]
    assert data["_nvidia_driver_fabricmanager_packages"] == expected["fabricmanager"]
    assert data["_nvidia_driver_core_package"] == expected["userspace"][0]


@pytest.mark.parametrize("os_name", sorted(EXPECTED))
def test_repository_line_and_key_url(os_name):
    distro = EXPECTED[os_name]["distro"]
    data = render(os_name)
    assert data["_nvidia_driver_repo_line"] == (
        f"deb [signed-by=/etc/apt/keyrings/kimi-nvidia-cuda.asc] {NVIDIA}/{distro}/x86_64/ /"
    )
    assert data["_nvidia_driver_repo_key"] == f"{NVIDIA}/{distro}/x86_64/3bf863cc.pub"


def test_a_mirror_url_keeps_the_layout():
    data = render("Ubuntu-24", kimi_nvidia_driver_repo_url="http://mirror.example/cuda/repos/")
    assert data["_nvidia_driver_repo_line"].endswith(" http://mirror.example/cuda/repos/ubuntu2404/x86_64/ /")


@pytest.mark.parametrize(("version", "glob"), [("", "580.*"), ("580.95.05", "580.95.05-*")])
def test_version_pin(version, glob):
    assert render("Debian-12", kimi_nvidia_driver_version=version)["_nvidia_driver_version_glob"] == glob


def test_open_and_proprietary_select_the_kernel_package():
    assert render("Ubuntu-22")["_nvidia_driver_kernel"] == ["nvidia-dkms-580-open"]
    assert render("Ubuntu-22", kimi_nvidia_driver_kernel_modules="proprietary")["_nvidia_driver_kernel"] == [
        "nvidia-dkms-580"
    ]


def test_every_supported_os_has_a_vars_file():
    supported = yaml.safe_load((ROLE.parent / "preflight/defaults/main.yml").read_text())["kimi_preflight_supported_os"]
    assert sorted(supported) == sorted(EXPECTED)
    for os_name in supported:
        assert (ROLE / f"vars/{os_name}.yml").is_file()
