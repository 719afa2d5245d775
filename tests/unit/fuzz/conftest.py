"""Hypothesis profiles for the generated-input layer, chosen by HYPOTHESIS_PROFILE (read in the tests).

"ci" (the default) keeps the whole layer near a minute on the 2-core CI machine; "fuzz" (`make fuzz`)
runs many more examples with no per-example deadline. Inputs that once broke something are kept as
explicit @example(...) decorators beside the property they broke, so every run replays them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# capsys and the tmp_path factory are reset by hand per example; the CI machine is slow and busy.
settings.register_profile("ci", max_examples=150, deadline=2000, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("fuzz", max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck),
                          print_blob=True)
PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"


def chosen_profile() -> settings:
    """Applied to this layer's tests only: other modules' @given keep hypothesis' own defaults."""
    return settings.get_profile(os.environ.get(PROFILE_VARIABLE, "ci"))
