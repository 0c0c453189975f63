"""A measured row's levels, read the same way wherever they are read: keyed by concurrency, an int while
deploy-measure holds them, a string once they went through JSON (eval/online.json, production.json)."""
from __future__ import annotations


def level_of(row: dict | None, concurrency: int | str) -> dict:
    """The level of `row` at `concurrency` ({} when not measured), whichever way its keys are written."""
    levels = (row or {}).get("levels") or {}
    found = levels.get(concurrency)
    if found is None:
        found = levels.get(str(concurrency)) if isinstance(concurrency, int) else levels.get(_as_int(concurrency))
    return found or {}


def _as_int(key: str) -> int | None:
    try:
        return int(key)
    except ValueError:
        return None
