"""A measured row's levels, read the same way wherever they are read: keyed by concurrency, an int while
deploy-measure holds them, a string once they went through JSON (eval/online.json, production.json)."""
from __future__ import annotations


def second_instance(row: str) -> str:
    """The row of `row` served once more, by another server (as baseline-2 is the baseline's): the name
    deploy-measure gives it and eval/online.json's second_server holds."""
    return f"{row}-2"


def level_of(row: dict | None, concurrency: int | str) -> dict:
    """The level of `row` at `concurrency` ({} when not measured), whichever way its keys are written."""
    levels = {str(c): level for c, level in ((row or {}).get("levels") or {}).items()}
    return levels.get(str(concurrency)) or {}
