"""Sizes and counts as people read them: GIB, bytes in binary units, parameter counts. The planner,
preflight, the run's messages and the offline evaluator's fit check write them the same way."""
from __future__ import annotations

GIB = 2**30


def count(n: float) -> str:
    """A parameter count as people say it: 1.1 M, 8.03 B, 1.03 T."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def human(n: float | None, sep: str = " ") -> str:
    """Bytes in binary units (KiB, MiB, GiB, …): the profile's sizes are GiB keys (`hardware.min_free_disk_gib`,
    `extract.cache_gib`), so a sentence that names a key and a size never mixes GB and GiB. The console's
    tables write it without the space (`sep=""`)."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f}{sep}{unit}" if unit == "B" else f"{n:.1f}{sep}{unit}"
        n /= 1024
    return str(n)
