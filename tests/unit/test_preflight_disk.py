"""Preflight's disk check, as the role evaluates it: the measuring script of roles/preflight/tasks/disk.yml run
here, and its assertion rendered with Ansible's templar from what was measured. Each path (the weights, the
venv, the caches) is measured on its own filesystem, and the needs of paths sharing one add up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from kimi_service import catalog
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import spec_from_catalog
from kimi_service.planner import plan

GIB = 1024**3
ROLE = Path(__file__).resolve().parents[2] / "roles/preflight"
MEASURE, CHECK = yaml.safe_load((ROLE / "tasks/disk.yml").read_text())
DEFAULTS = yaml.safe_load((ROLE / "defaults/main.yml").read_text())


def _render(template: str, variables: dict):
    templar = Templar(loader=DataLoader(), variables={k: trust_as_template(v) if isinstance(v, str) else v
                                                      for k, v in variables.items()})
    return templar.template(trust_as_template(template))


def _line(what: str, free_gib: float, held_gib: float, mount: str, path: str) -> str:
    return f"{what}\t{int(free_gib * GIB)}\t{int(held_gib * GIB)}\t{mount}\t{path}"


def _check(measured: str, model_gib: float, **settings) -> tuple[bool, str]:
    """Whether the assertion holds for what the script measured, and the message it would fail with."""
    variables = {
        **{name: DEFAULTS[name] for name in ("kimi_preflight_disk_headroom_gb", "kimi_preflight_venv_size_gb",
                                             "kimi_preflight_cache_size_gb")},
        **CHECK["vars"],
        "_preflight_df": {"stdout": measured, "stdout_lines": measured.splitlines()},
        "_preflight_model_gb": model_gib,
        **settings,
    }
    check = CHECK["ansible.builtin.assert"]
    holds = bool(_render("{{ " + check["that"][0] + " }}", variables))
    return holds, " ".join((_render(check["fail_msg"], variables) or "").split())


def _on_root(weights: tuple[float, float], venv_held: float = 1, cache_held: float = 5, free: float = 100) -> str:
    """One filesystem holding everything: the weights (model GiB there), a venv built, caches grown."""
    return "\n".join([
        _line("weights", free, weights[1], "/", "/var/lib/kimi-service/models/org/m@main"),
        _line("venv", free, venv_held, "/", "/opt/kimi-service"),
        _line("cache", free, cache_held, "/", "/var/lib/kimi-service/cache"),
    ])


def test_a_rerun_with_the_weights_in_place_needs_only_the_headroom():
    # The H100 rerun that failed before: 28.9 GiB free, a 15 GiB model already there, 20 GiB headroom.
    assert _check(_on_root((15, 15), free=28.9), 15.0)[0]
    assert not _check(_on_root((15, 0), free=28.9), 15.0)[0]


def test_partly_downloaded_weights_count_for_what_they_hold():
    assert _check(_on_root((15, 10), free=30), 15)[0]
    assert not _check(_on_root((15, 4), free=30), 15)[0]


def test_more_on_disk_than_the_model_needs_no_negative_room():
    assert not _check(_on_root((15, 40), free=10), 15)[0]


@pytest.mark.parametrize("headroom", ["20", "20.0"])
def test_a_headroom_given_as_a_string_on_the_command_line_is_a_number(headroom):
    assert _check(_on_root((15, 0), free=36), 15, kimi_preflight_disk_headroom_gb=headroom)[0]
    assert not _check(_on_root((15, 0), free=34), 15, kimi_preflight_disk_headroom_gb=headroom)[0]


def test_no_model_size_means_no_room_for_weights():
    assert _check(_on_root((0, 0), free=0), 0)[0]


def test_the_weights_on_another_filesystem_than_the_state_are_checked_there():
    measured = "\n".join([
        _line("weights", 10, 0, "/data", "/data/models/org/m@main"),
        _line("venv", 500, 0, "/", "/opt/kimi-service"),
        _line("cache", 500, 0, "/", "/var/lib/kimi-service/cache"),
    ])
    holds, message = _check(measured, 15)
    assert not holds
    assert message.startswith("Not enough disk space. /data has 10.0 GiB free and needs 35.0 GiB: "
                              "the weights at /data/models/org/m@main,")
    assert "plus 20 GiB headroom (kimi_preflight_disk_headroom_gb)." in message and "venv" not in message, message


def test_paths_on_one_filesystem_add_their_needs_up():
    # Each fits the 45 GiB alone; together (15 + 20 headroom, a 10 GiB venv, 5 GiB of caches) they do not.
    measured = _on_root((15, 0), venv_held=0, cache_held=0, free=45)
    holds, message = _check(measured, 15)
    assert not holds
    assert message.startswith("Not enough disk space. / has 45.0 GiB free and needs 50.0 GiB:"), message
    assert "the runtime's venv under /opt/kimi-service, 10 GiB (kimi_preflight_venv_size_gb);" in message
    assert "the engine's caches at /var/lib/kimi-service/cache, 5 GiB (0.0 GiB of it already there;" in message
    assert _check(measured.replace(str(45 * GIB), str(50 * GIB)), 15)[0]


def test_a_built_venv_needs_no_room_and_caches_count_for_what_they_hold():
    assert _check(_on_root((0, 0), venv_held=3, cache_held=2, free=3), 0)[0]
    assert not _check(_on_root((0, 0), venv_held=0, cache_held=2, free=3), 0)[0]


def test_the_model_size_is_the_whole_checkpoint_under_data_parallel_experts():
    # DP 8 x EP 8: each GPU holds 1/8 of the experts and the rest whole, but each host keeps every file.
    spec = spec_from_catalog(catalog.get("moonshotai/Kimi-K2.5"))
    layout = plan(spec, parse_gpu_spec("8xH200"))
    assert layout.data_parallel_size > 1
    values = dict(DataLoader().load_from_file(str(ROLE / "vars/main.yml"), trusted_as_template=True))
    values.update(kimi_plan=layout.to_json(), kimi_preflight_model_size_gb=0)
    model_gib = Templar(loader=DataLoader(), variables=values).template(trust_as_template("{{ _preflight_model_gb }}"))
    assert float(model_gib) == pytest.approx(spec.weight_bytes / GIB)


def _measure(variables: dict) -> str:
    script = _render(MEASURE["ansible.builtin.shell"], variables)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout


def _mount(path: Path) -> str:
    return subprocess.run(["df", "--output=target", str(path)], capture_output=True, text=True,
                          check=True).stdout.splitlines()[1].strip()


def test_the_script_measures_each_path_on_its_own_filesystem(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or _mount(shm) == _mount(tmp_path):
        pytest.skip("needs /dev/shm on a filesystem of its own")
    weights = shm / f"kimi-preflight-{os.getpid()}/models/org/m@main"  # not made: measured on /dev/shm
    measured = _measure({"kimi_state_dir": str(tmp_path / "state"), "kimi_model": "org/m",
                         "kimi_model_dir": str(weights), "kimi_install_dir": str(tmp_path / "opt"),
                         "kimi_cache_dir": str(tmp_path / "state/cache")})
    lines = [line.split("\t") for line in measured.splitlines()]
    assert [(what, mount, path) for what, _, _, mount, path in lines] == [
        ("weights", "/dev/shm", str(weights)),
        ("venv", _mount(tmp_path), str(tmp_path / "opt")),
        ("cache", _mount(tmp_path), str(tmp_path / "state/cache")),
    ]
    shm_free = int(lines[0][1]) / GIB
    holds, message = _check(measured, shm_free + 1, kimi_preflight_disk_headroom_gb=0,
                            kimi_preflight_venv_size_gb=0, kimi_preflight_cache_size_gb=0)
    assert not holds and message.startswith(f"Not enough disk space. /dev/shm has {shm_free:.1f} GiB free"), message


def test_a_refusal_names_the_copies_of_other_models_and_their_sizes(tmp_path):
    # Switching kimi_model on a small disk (the GPU run's 64 GiB): the old copy is what holds the space.
    state = tmp_path / "state"
    old = state / "models/e2e/llama-3.1-8b@main"
    old.mkdir(parents=True)
    with open(old / "model.safetensors", "wb") as weights:  # 1.5 GiB of blocks, allocated at once
        os.posix_fallocate(weights.fileno(), 0, 3 * GIB // 2)
    (state / "models/gpt2@main").mkdir()
    (state / "models/e2e/deepseek-v3-4l@main").mkdir()  # the model asked for: not "another" copy
    measured = _measure({
        "kimi_state_dir": str(state), "kimi_model": "e2e/deepseek-v3-4l",
        "kimi_model_dir": str(state / "models/e2e/deepseek-v3-4l@main"),
        "kimi_install_dir": str(tmp_path / "opt"), "kimi_cache_dir": str(state / "cache"),
    })
    copies = [line.split("\t") for line in measured.splitlines() if line.startswith("copy\t")]
    assert [copy[4] for copy in copies] == [str(old), str(state / "models/gpt2@main")]
    assert round(int(copies[0][2]) / GIB, 1) == 1.5

    holds, message = _check(measured, 10**6)
    assert not holds
    assert f"hold 1.5 GiB: {old} (1.5 GiB), {state}/models/gpt2@main (0.0 GiB);" in message, message
    assert "deepseek-v3-4l@main (" not in message
    assert "remove those no longer served" in message, message


def test_a_refusal_without_other_copies_says_to_free_space(tmp_path):
    measured = _measure({"kimi_state_dir": str(tmp_path / "absent"), "kimi_model": "org/m",
                         "kimi_model_dir": str(tmp_path / "absent/models/org/m@main"),
                         "kimi_install_dir": str(tmp_path / "opt"), "kimi_cache_dir": str(tmp_path / "absent/cache")})
    holds, message = _check(measured, 10**6)
    assert not holds
    assert "Free space, attach a larger volume at" in message and "Copies of other models" not in message
