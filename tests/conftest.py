"""Runs the longest modules first.

`make test` runs three pytest workers, a module per worker at a time (--dist loadfile) in the order
collected here: started last, a 15-minute module would leave the other workers idle for most of it.
The costs are a fresh-clone run's module totals on the 2-core CI machine (README, Tests; measured with
two workers on cold caches); a module not listed costs nothing and keeps its place after the listed ones.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.cpu_site import engine_env

MODULE_SECONDS = {
    "tests/integration/test_site_e2e.py": 967,
    "tests/integration/test_container.py": 886,
    "tests/integration/test_multinode.py": 759,
    "tests/integration/test_replicas.py": 546,
    "tests/integration/test_gpu_roles.py": 420,
    "tests/integration/test_vllm_runtime.py": 281,
    "tests/engine/test_tune.py": 218,
    "tests/integration/test_model_weights.py": 164,
    "tests/engine/test_bench.py": 122,
    "tests/engine/test_serve.py": 75,
    "tests/engine/test_container_serve.py": 62,
    "tests/unit/test_weights_hardening.py": 37,
    "tests/integration/test_firewall.py": 35,
    "tests/integration/test_testhost_fixture.py": 27,
    "tests/unit/test_launcher.py": 26,
    "tests/integration/test_service_units.py": 22,
    "bench/gpu/tests/test_cpu_end_to_end.py": 22,
    "tests/unit/test_monitoring.py": 21,
}
ROOT = Path(__file__).resolve().parent.parent
# The CPU engines this worker starts on the controller (engine and bench tests) share its placement.
for name, value in engine_env().items():
    os.environ.setdefault(name, value)


def module_cost(path: Path) -> int:
    return MODULE_SECONDS.get(path.resolve().relative_to(ROOT).as_posix(), 0)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -module_cost(Path(item.fspath)))  # stable: tests keep their order in a module
