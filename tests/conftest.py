"""Runs the longest modules first.

`make test` runs three pytest workers, a module per worker at a time (--dist loadfile) in the order
collected here: started last, a 15-minute module would leave the other workers idle for most of it.
The costs are a fresh-clone run's module totals on the 2-core CI machine (README, Tests: three workers,
warm caches); a module not listed costs nothing and keeps its place after the listed ones.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.cpu_site import engine_env

MODULE_SECONDS = {
    "tests/integration/test_site_e2e.py": 1112,
    "tests/integration/test_gpu_roles.py": 712,
    "tests/integration/test_replicas.py": 672,
    "tests/integration/test_multinode.py": 619,
    "tests/integration/test_container.py": 608,
    "tests/integration/test_vllm_runtime.py": 480,
    "tests/engine/test_tune.py": 281,
    "tests/integration/test_model_weights.py": 230,
    "tests/engine/test_bench.py": 106,
    "tests/engine/test_serve.py": 76,
    "tests/engine/test_container_serve.py": 72,
    "tests/integration/test_firewall.py": 39,
    "tests/unit/test_weights_hardening.py": 38,
    "tests/integration/test_testhost_fixture.py": 32,
    "tests/unit/test_launcher.py": 26,
    "tests/unit/test_monitoring.py": 24,
    "tests/integration/test_service_units.py": 20,
    "bench/gpu/tests/test_cpu_end_to_end.py": 20,
}
ROOT = Path(__file__).resolve().parent.parent
# The CPU engines this worker starts on the controller (engine and bench tests) share its placement.
for name, value in engine_env().items():
    os.environ.setdefault(name, value)


def module_cost(path: Path) -> int:
    return MODULE_SECONDS.get(path.resolve().relative_to(ROOT).as_posix(), 0)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -module_cost(Path(item.fspath)))  # stable: tests keep their order in a module
