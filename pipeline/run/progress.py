"""Turns the event stream into what a terminal shows: one redrawn bar with ETA on a TTY, plain
timestamped lines otherwise (logs, CI, `| tee`)."""
from __future__ import annotations

import sys
import time


def _fmt_secs(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


class ProgressPrinter:
    def __init__(self, stream=None, tty: bool | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.started: dict[str | None, float] = {}  # by the event's stage (None: a run-level event)
        # a count's first report (time, done) and its last done, by (stage, unit, total): the ETA is that count's
        # own rate, not the stage's elapsed time, which holds a server's start or a model's load before the first
        # prompt or step (deploy-measure's first prompt once read "ETA 11:03" for a row that took 2 s more)
        self.counts: dict[tuple, tuple[float, int, int]] = {}
        self._last_plain = 0.0
        self._bar_open = False

    def _line(self, text: str) -> None:
        if self._bar_open:
            self.stream.write("\r\033[K")
            self._bar_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def __call__(self, event: dict) -> None:
        stage, kind = event.get("stage"), event.get("kind")
        if kind == "start":
            self.started[stage] = time.monotonic()
            self._line(f"[{stage}] started")
        elif kind == "skip":
            self._line(f"[{stage}] skipped: {event.get('reason')}")
        elif kind == "finish":
            figs = event.get("figures") or {}
            shown = ", ".join(f"{k}={v}" for k, v in figs.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool))
            self._line(f"[{stage}] done in {event.get('seconds')}s  {shown}")
        elif kind == "fail":
            self._line(f"[{stage}] FAILED: {event.get('error')}")
        elif kind == "progress":
            self._progress(stage, event)

    def _progress(self, stage: str | None, event: dict) -> None:
        done, total, unit = event.get("done", 0), event.get("total"), event.get("unit", "")
        elapsed = time.monotonic() - self.started.get(stage, time.monotonic())
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in event.items()
                         if k not in {"ts", "t", "stage", "kind", "done", "total", "unit"} and v is not None)
        if total:
            frac = min(1.0, done / total)
            now, key = time.monotonic(), (stage, unit, total)
            t0, done0, last = self.counts.get(key, (now, done, done))
            if done < last:  # the same count again (another round): its rate from here
                t0, done0 = now, done
            self.counts[key] = (t0, done0, done)
            eta_s = _fmt_secs((now - t0) / (done - done0) * (total - done)) if done > done0 else "?"
            if self.tty:
                self.stream.write(f"\r\033[K[{stage}] [{'#' * int(frac * 30):<30}] {done}/{total} {unit} "
                                  f"{_fmt_secs(elapsed)} ETA {eta_s} {extra}")
                self.stream.flush()
                self._bar_open = True
                return
            text = f"[{stage}] {done}/{total} {unit} ({frac:.0%}) elapsed {_fmt_secs(elapsed)} ETA {eta_s} {extra}"
        else:
            text = f"[{stage}] {done} {unit} {extra}"
        now = time.monotonic()
        if now - self._last_plain >= 5 or (total and done >= total):
            self._last_plain = now
            self._line(text)
