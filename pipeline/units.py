"""Sizes and counts as people read them: GIB, bytes in decimal units, parameter counts. The planner,
preflight, the run's messages and the offline evaluator's fit check write them the same way."""
from __future__ import annotations

GIB = 2**30


def count(n: float) -> str:
    """A parameter count as people say it: 1.1 M, 8.03 B, 1.03 T."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
