"""The one small interface every stage implements, and the context a stage runs in."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.profile import Profile
from pipeline.rundir import RunDir


class StageError(RuntimeError):
    """A stage failed for a reason the operator can act on; the message is one line. `resumable`:
    False when the cause is in the run's own profile, which a resume keeps."""

    def __init__(self, message: str, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


def target_dir(run: RunDir, profile: Profile) -> Path:
    """The served target: the profile's model path, or the demo target build-target recorded."""
    if profile.target.source == "path":
        return Path(profile.target.model_path)
    recorded = run.stage_state("build-target").get("figures", {}).get("target_dir")
    if not recorded:
        raise StageError("build-target has not run: no demo target recorded in state.json")
    return Path(recorded)


@dataclass
class StageContext:
    run: RunDir
    profile: Profile
    log: logging.Logger
    on_event: Callable[[dict], None] = lambda record: None
    _last_progress: float = field(default=0.0, repr=False)

    def emit(self, kind: str, stage: str, **data) -> None:
        self.on_event(self.run.emit(stage, kind, **data))

    def progress(self, stage: str, done: int, total: int | None, unit: str = "", force: bool = False,
                 **figures) -> None:
        """Record progress; throttled to 4 events/s so a tight loop cannot flood the event log."""
        now = time.monotonic()
        if not force and total is not None and done < total and now - self._last_progress < 0.25:
            return
        self._last_progress = now
        self.emit("progress", stage, done=done, total=total, unit=unit, **figures)

    # What earlier stages produced, typed (one place decides where a stage's inputs are).
    def target_dir(self) -> Path:
        return target_dir(self.run, self.profile)

    def source_conversations(self) -> Path:
        spec = self.profile.data.conversations
        return self.run.demo_conversations if spec == "demo" else Path(spec)

    def training_conversations(self) -> Path:
        if self.profile.data.regenerate:
            return self.run.regenerated_conversations
        return self.source_conversations()

    def extract_mode(self) -> str:
        """offline / online: the profile's, or what preflight decided for `auto` on this run's disk."""
        if self.profile.extract.mode != "auto":
            return self.profile.extract.mode
        decided = self.run.stage_state("preflight").get("figures", {}).get("extract_mode")
        if decided not in ("offline", "online"):
            raise StageError("extract.mode auto: preflight has not decided offline or online for this run")
        return decided

    def offline_tau(self) -> float | None:
        """τ that evaluate-offline measured for this run's head (None before it ran)."""
        tau = self.run.stage_state("evaluate-offline").get("figures", {}).get("tau")
        return float(tau) if tau is not None else None

    def deploy_decision(self) -> str | None:
        """deploy-measure's decision line ("deploy: …" / "do not deploy: …"), None when it did not run."""
        decision = self.run.stage_state("deploy-measure").get("figures", {}).get("decision")
        return str(decision) if decision else None

    def draft_checkpoint(self) -> Path:
        recorded = self.run.stage_state("train").get("figures", {}).get("checkpoint")
        if not recorded:
            raise StageError("train has not finished: no checkpoint recorded in state.json")
        return Path(recorded)


class Stage:
    """name: the CLI name. inputs(): the files earlier stages wrote that this one reads (checked before
    it runs). outputs(): what the stage writes (recorded when it finishes; the stage counts as done only
    while they are all still there, unchanged). run(): does the work and returns the key figures that go
    into the state, the events and the notes."""

    name: str = ""
    always_run: bool = False  # a check that must hold on every attempt (preflight): never skipped as done

    def applies(self, profile: Profile) -> bool:
        return True

    def inputs(self, ctx: StageContext) -> list[Path]:
        return []

    def outputs(self, ctx: StageContext) -> list[Path]:
        raise NotImplementedError

    def run(self, ctx: StageContext) -> dict:
        raise NotImplementedError


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token sequences differ (the shorter's length when one is a prefix)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
