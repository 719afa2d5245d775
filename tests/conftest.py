"""Runs the longest modules first.

`make test` runs two pytest workers, a module per worker at a time (--dist loadfile) in the order
collected here: started last, a 20-minute module would leave the other worker idle for most of it.
The costs are a fresh-clone run's module totals on the 2-core CI machine (README, Tests); a module not
listed costs nothing and keeps its place after the listed ones.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.cpu_site import engine_env

MODULE_SECONDS = {
    "tests/integration/test_site_e2e.py": 674,
    "tests/integration/test_multinode.py": 635,
    "tests/integration/test_container.py": 741,
    "tests/integration/test_replicas.py": 542,
    "tests/integration/test_gpu_roles.py": 348,
    "tests/integration/test_vllm_runtime.py": 240,
    "tests/engine/test_tune.py": 220,
    "tests/integration/test_model_weights.py": 157,
    "tests/engine/test_bench.py": 97,
    "tests/engine/test_serve.py": 71,
    "tests/engine/test_container_serve.py": 55,
    "tests/unit/test_weights_hardening.py": 36,
    "tests/integration/test_firewall.py": 31,
    "tests/integration/test_testhost_fixture.py": 28,
    "tests/unit/test_launcher.py": 26,
    "tests/integration/test_service_units.py": 21,
    "tests/unit/test_monitoring.py": 20,
    "bench/gpu/tests/test_cpu_end_to_end.py": 16,
}
ROOT = Path(__file__).resolve().parent.parent
# The CPU engines this worker starts on the controller (engine and bench tests) share its placement.
for name, value in engine_env().items():
    os.environ.setdefault(name, value)


def module_cost(path: Path) -> int:
    return MODULE_SECONDS.get(path.resolve().relative_to(ROOT).as_posix(), 0)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -module_cost(Path(item.fspath)))  # stable: tests keep their order in a module
