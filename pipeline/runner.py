"""Runs the stages of a run in order: skips the ones whose recorded outputs are still complete,
records state, events and notes around each, and stops at the first failure."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from pipeline import gpu, notes, portlock
from pipeline.rundir import RunDir, now_iso
from pipeline.stages import STAGES, stage_names
from pipeline.stages.base import Stage, StageContext, StageError


class RunnerError(ValueError):
    pass


def manifest(run: RunDir, paths: list[Path]) -> dict[str, int]:
    """Every file under the stage's outputs with its size (paths relative to the run when inside it)."""
    out: dict[str, int] = {}
    for path in paths:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        if not files:
            raise StageError(f"expected output missing: {path}")
        for f in files:
            try:
                key = str(f.relative_to(run.root))
            except ValueError:
                key = str(f)
            out[key] = f.stat().st_size
    return out


def outputs_intact(run: RunDir, recorded: dict[str, int]) -> bool:
    for key, size in recorded.items():
        p = Path(key) if Path(key).is_absolute() else run.root / key
        try:
            if p.stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
    return bool(recorded)


def select(profile, start: str | None, until: str | None) -> list[Stage]:
    names = stage_names()
    for flag, value in (("--from", start), ("--until", until)):
        if value is not None and value not in names:
            raise RunnerError(f"{flag} {value!r}: unknown stage (stages: {', '.join(names)})")
    lo = names.index(start) if start else 0
    hi = names.index(until) if until else len(names) - 1
    if lo > hi:
        raise RunnerError(f"--from {start} comes after --until {until}")
    chosen = STAGES[lo:hi + 1]
    # Checks that must hold before any work (preflight) run whatever --from says.
    chosen = [s for s in STAGES[:lo] if getattr(s, "always_run", False)] + chosen
    return [s for s in chosen if s.applies(profile)]


def _stage_logger(run: RunDir, stage: str) -> tuple[logging.Logger, logging.Handler]:
    log = logging.getLogger(f"eagle3.{run.root.name}.{stage}")
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = logging.FileHandler(run.log_path(stage))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log, handler


def is_done(run: RunDir, stage: Stage) -> bool:
    if getattr(stage, "always_run", False):
        return False
    entry = run.stage_state(stage.name)
    return entry.get("status") == "done" and outputs_intact(run, entry.get("outputs", {}))


def run_stages(run: RunDir, start: str | None = None, until: str | None = None,
               on_event: Callable[[dict], None] = lambda r: None) -> dict:
    profile = run.profile()
    stages = select(profile, start, until)
    try:
        lock = portlock.hold(profile, run.root)
    except portlock.PortTaken as exc:
        raise RunnerError(str(exc)) from None
    try:
        return _run_stages(run, profile, stages, on_event)
    finally:
        lock.close()


def _run_stages(run: RunDir, profile, stages: list[Stage], on_event: Callable[[dict], None]) -> dict:
    run.logs_dir.mkdir(exist_ok=True)
    summary = {}
    for stage in stages:
        if is_done(run, stage):
            on_event(run.emit(stage.name, "skip", reason="outputs recorded and intact"))
            summary[stage.name] = "skipped"
            continue
        log, handler = _stage_logger(run, stage.name)
        ctx = StageContext(run=run, profile=profile, log=log, on_event=on_event)
        attempt = run.stage_state(stage.name).get("attempts", 0) + 1
        run.update_stage(stage.name, status="running", started=now_iso(), attempts=attempt, outputs={})
        on_event(run.emit(stage.name, "start", attempt=attempt))
        notes.add(run, f"{stage.name} started (attempt {attempt})", source="auto", stage=stage.name)
        t0 = time.monotonic()
        monitor = gpu.StageMonitor(timeline=run.root / "gpu_timeline.jsonl")
        try:
            with monitor:
                figures = stage.run(ctx) or {}
            recorded = manifest(run, stage.outputs(ctx))
        except BaseException as exc:
            seconds = round(time.monotonic() - t0, 2)
            reason = _one_line(exc)
            log.error("failed: %s", reason, exc_info=not isinstance(exc, (StageError, KeyboardInterrupt)))
            run.update_stage(stage.name, status="failed", error=reason, seconds=seconds, finished=now_iso())
            on_event(run.emit(stage.name, "fail", error=reason, seconds=seconds))
            notes.add(run, f"{stage.name} failed after {seconds}s: {reason}", source="auto", stage=stage.name)
            raise
        finally:
            log.removeHandler(handler)
            handler.close()
        seconds = round(time.monotonic() - t0, 2)
        run.update_stage(stage.name, status="done", finished=now_iso(), seconds=seconds, figures=figures,
                         outputs=recorded, error=None)
        on_event(run.emit(stage.name, "finish", seconds=seconds, figures=figures))
        notes.add(run, f"{stage.name} finished in {seconds}s", source="auto", stage=stage.name,
                  figures=_scalars(figures))
        if (usage := monitor.summary()):
            run.update_stage(stage.name, gpu=usage)
            notes.add(run, f"{stage.name} GPU usage", source="auto", stage=stage.name, figures=usage)
        summary[stage.name] = "done"
    return summary


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ") if not isinstance(exc, StageError) \
        else (text[0] if text else "stage failed")


def _scalars(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if isinstance(v, (int, float, str, bool)) and not str(k).endswith("_dir")}
