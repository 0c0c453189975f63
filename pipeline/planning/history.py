"""Earlier runs of a profile (same name, under its runs_dir) and the figures their stages recorded in
state.json, newest first: what the planner prefers to a calibration or an estimate."""
from __future__ import annotations

import contextlib
import json
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from pipeline.profile import Profile

T = TypeVar("T")


def _earlier_runs(profile: Profile) -> Iterator[tuple[Path, dict]]:
    """(run dir, state) of earlier runs of the same profile name, newest first."""
    runs = Path(profile.run.runs_dir).glob("*/state.json")
    for state_file in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True):
        with contextlib.suppress(OSError, ValueError):
            if tomllib.loads((state_file.parent / "profile.toml").read_text()).get("name") == profile.name:
                yield state_file.parent, json.loads(state_file.read_text())


def measured(profile: Profile, stages: tuple[str, ...], value_of: Callable[[dict], T | None],
             done: bool = False) -> tuple[T, Path] | None:
    """The newest earlier run of this profile in which `value_of` finds a figure of one of `stages` (`done`:
    of a finished stage only), with that figure."""
    for run_dir, state in _earlier_runs(profile):
        for stage in stages:
            entry = state.get("stages", {}).get(stage, {})
            if (not done or entry.get("status") == "done") and (value := value_of(entry.get("figures") or {})):
                return value, run_dir
    return None


def per_row(profile: Profile, stage: str, key: str) -> float | None:
    """An earlier run's `key` per row of `stage` (the newest that recorded both)."""
    m = measured(profile, (stage,), lambda fig: fig.get("rows") and fig.get(key) and fig[key] / fig["rows"])
    return m[0] if m else None
