"""matplotlib for the PNGs `bench --plot` and `tune` write: an optional dependency, imported when a plot is made."""

from __future__ import annotations

from typing import Any

from kimi_service.errors import KimiError


def pyplot(what: str) -> Any:
    """matplotlib's pyplot drawing to files only, or a clear error naming what needed it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KimiError(f"{what} needs matplotlib (pip install matplotlib)") from None
    return plt
