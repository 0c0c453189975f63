"""A read-only, incremental view of a run's files for whoever displays it (the console): stage
statuses with progress and ETA, key figures as they arrive, notes (a log's tail: `layout/tail.py`). Reads only."""
from __future__ import annotations

import json
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.rundir import RunDir

KEY_FIGURES = ("loss", "train/loss", "val/loss_epoch", "tau", "mean_acceptance_length", "samples_per_s",
               "tokens_per_s", "profile/tokens_per_s", "generate_tok_s", "tok_s", "generated_tok_s", "speedup",
               "step")


@dataclass(frozen=True)
class StageView:
    name: str
    status: str = "pending"
    done: float | None = None
    total: float | None = None
    unit: str = ""
    elapsed_s: float | None = None
    eta_s: float | None = None
    figures: tuple = ()  # (key, value) pairs, short, most telling first (the order of KEY_FIGURES)

    @property
    def fraction(self) -> float | None:
        if self.status in ("done", "stale"):  # stale: done, its outputs changed since
            return 1.0
        return min(1.0, self.done / self.total) if self.total and self.done is not None else None


@dataclass(frozen=True)
class RunView:
    stages: tuple[StageView, ...]
    current: str | None
    notes: tuple[dict, ...] = ()
    train_loss: tuple[float, ...] = ()  # every logged training loss, for a curve
    evaluation: dict | None = None  # eval/online.json when it exists
    checkpoints: dict | None = None  # eval/checkpoints.json (pick-checkpoint) when it exists
    metrics: dict | None = None  # each stage's latest value of every figure its metric events carried


class RunWatcher:
    def __init__(self, run: RunDir, stage_names: list[str], clock=time.time):
        self.run = run
        self.clock = clock
        self.stage_names = stage_names
        self._offset = 0
        # by the event's stage (None: a run-level event)
        self._progress: dict[str | None, dict] = {}
        self._started: dict[str | None, float] = {}
        self._metrics: dict[str | None, dict] = {}
        self._notes_offset = 0
        self._notes: list[dict] = []
        self._loss: list[float] = []
        self._json: dict[Path, tuple[float, dict]] = {}  # by path: its mtime and contents as last read

    def poll(self, statuses: dict[str, str] | None = None) -> RunView:
        """`statuses`: each stage's status as it stands (the run's snapshot: n/a, interrupted), else as
        state.json recorded it."""
        events, self._offset = atomicio.read_jsonl_from(self.run.events_path, self._offset)
        for e in events:
            stage, kind = e.get("stage"), e.get("kind")
            if kind == "start":
                self._started[stage] = e.get("t", self.clock())
                self._progress.pop(stage, None)
            elif kind == "progress":
                self._progress[stage] = e
            elif kind == "metric":
                if isinstance(e.get("train/loss"), (int, float)):
                    self._loss.append(e["train/loss"])
                self._metrics.setdefault(stage, {}).update(
                    {k: v for k, v in e.items() if isinstance(v, (int, float)) and k not in ("t",)})
        notes, self._notes_offset = atomicio.read_jsonl_from(self.run.notes_path, self._notes_offset)
        self._notes += notes
        state = self.run.read_state().get("stages", {})
        views, current = [], None
        now = self.clock()
        for name in self.stage_names:
            entry = state.get(name, {})
            recorded = entry.get("status", "pending")
            status = (statuses or {}).get(name) or recorded  # as it stands: n/a, interrupted, stale
            prog = self._progress.get(name, {})
            started = self._started.get(name)
            if recorded in ("done", "failed", "interrupted"):
                elapsed = entry.get("seconds")
            else:  # up to now, or to its last event when its process is gone
                gone = recorded == "running" and status != "running"
                until = max(prog.get("t", 0), started or 0) if gone else now
                elapsed = entry.get("earlier_seconds", 0) + until - started if started else None
            done, total = prog.get("done"), prog.get("total")
            eta = None
            if status == "running" and started and total and done and prog.get("t", 0) > started:
                # The rate at the last progress report, counted down since: an ETA from "now" and an
                # old fraction would grow between reports instead of falling.
                eta = max(0.0, started + (prog["t"] - started) * total / done - now)
            # the key figures only: never a progress event's own t, done, total…
            figs = (entry.get("figures") or {}) if recorded == "done" else {**self._metrics.get(name, {}), **prog}
            short = tuple((k, figs[k]) for k in KEY_FIGURES if figs.get(k) is not None)
            if status in ("failed", "interrupted") and entry.get("error"):
                short = (("error", entry["error"]),)
            if status == "running":
                current = name
            views.append(StageView(name, status, done, total, prog.get("unit", ""), elapsed, eta, short))
        return RunView(tuple(views), current, tuple(self._notes), tuple(self._loss),
                       self._read_json(self.run.online_result), self._read_json(self.run.checkpoints_result),
                       {stage: dict(m) for stage, m in self._metrics.items() if stage})

    def _read_json(self, path: Path) -> dict | None:
        """`path` read again only when its mtime changed; while it is gone or half written, as last read."""
        with suppress(FileNotFoundError, json.JSONDecodeError):
            if (mtime := path.stat().st_mtime) != self._json.get(path, (0.0,))[0]:
                self._json[path] = (mtime, json.loads(path.read_text()))
        return self._json[path][1] if path in self._json else None


