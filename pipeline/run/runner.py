"""Runs the stages of a run in order: skips the ones whose recorded outputs are still complete,
records state, events and notes around each, and stops at the first failure."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.compat import speculators_logs
from pipeline.host import gpu, portlock, procs
from pipeline.layout import results
from pipeline.layout.rundir import RunDir, RunDirError, now_iso
from pipeline.report import notes
from pipeline.serving import ports, server, vllm_modes
from pipeline.stages import STAGES, stage_names
from pipeline.stages.base import Stage, StageContext, StageError, existing_clears, stop_orphan_child
from pipeline.units import human


class RunnerError(ValueError):
    pass


def dir_digest(path: Path) -> dict | None:
    """What a stage's output directory holds, in one small record: file count, bytes, and a sha256 over
    every file's relative path and size (a renamed, removed, added or resized file changes it). None
    when the directory has no file. Scales to 500k hidden-state files (bench/state_scale.py)."""
    entries: list[tuple[str, int]] = []
    dirs_mtime = dirs_mtime_ns(path, entries)
    if dirs_mtime is None or not entries:
        return None
    entries.sort()
    digest = hashlib.sha256("\n".join(f"{name}\t{size}" for name, size in entries).encode()).hexdigest()
    return {"files": len(entries), "bytes": sum(size for _, size in entries), "sha256": digest,
            "dirs_mtime_ns": dirs_mtime}


def dirs_mtime_ns(path: Path, files: list[tuple[str, int]] | None = None) -> int | None:
    """The newest modification time of a directory and its subdirectories: it moves whenever a file
    is added, removed or renamed (our writers replace files by rename), without a stat per file.
    With `files`, each file's relative path and size is appended to it (a stat each: dir_digest)."""
    newest, stack = 0, [(path, "")]
    while stack:
        folder, prefix = stack.pop()
        try:
            newest = max(newest, os.stat(folder).st_mtime_ns)
            with os.scandir(folder) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append((Path(e.path), f"{prefix}{e.name}/"))
                    elif files is not None and e.is_file():
                        files.append((prefix + e.name, e.stat().st_size))
        except FileNotFoundError:
            return None
    return newest


def manifest(run: RunDir, paths: list[Path]) -> dict[str, int | dict]:
    """Each output of a stage (key relative to the run when inside it): a file's size, a directory's
    digest record."""
    out: dict[str, int | dict] = {}
    for path in paths:
        record = path.stat().st_size if path.is_file() else dir_digest(path) if path.is_dir() else None
        if record is None:
            raise StageError(f"expected output missing: {path}")
        out[str(path.relative_to(run.root) if path.is_relative_to(run.root) else path)] = record
    return out


def outputs_intact(run: RunDir, recorded: dict[str, int | dict], quick: bool = False) -> bool:
    """quick (status, the console): a directory whose tree's modification time is unchanged counts as
    unchanged; else (resume) every file's name and size is checked against the digest."""
    for key, want in recorded.items():
        p = Path(key) if Path(key).is_absolute() else run.root / key
        if isinstance(want, dict):
            if quick and want.get("dirs_mtime_ns") is not None and dirs_mtime_ns(p) == want["dirs_mtime_ns"]:
                continue
            got = dir_digest(p)
            if got is None or any(got[k] != want.get(k) for k in ("files", "bytes", "sha256")):
                return False
            continue
        try:
            if p.stat().st_size != want:
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
    # Checks that must hold before any work (preflight) run whatever --from says.
    chosen = [s for s in STAGES[:lo] if s.always_run] + STAGES[lo:hi + 1]
    return [s for s in chosen if s.applies(profile)]


def _stage_logger(run: RunDir, stage: str) -> tuple[logging.Logger, logging.Handler]:
    log = logging.getLogger(f"eagle3.{run.root.name}.{stage}")
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = logging.FileHandler(run.log_path(stage))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log, handler


def is_done(run: RunDir, stage: Stage, quick: bool = False) -> bool:
    if stage.always_run:
        return False
    entry = run.stage_state(stage.name)
    return entry.get("status") == "done" and outputs_intact(run, entry.get("outputs", {}), quick)


class Interrupted(BaseException):
    """The run was told to stop (SIGTERM from `timeout`, systemd, kill): recorded as interrupted,
    its children stopped, and resumable."""


def _stop_signal(signum, _frame):
    """The first stop signal interrupts the run (SIGINT as KeyboardInterrupt); later ones while it
    cleans up (stops its servers) are noted, not raised, so that the cleanup finishes."""
    name = signal.Signals(signum).name
    if server.STOPPING.is_set():
        print(f"eagle3-console: {name} again: already stopping (servers and children are being stopped)",
              file=sys.stderr, flush=True)
        return
    server.STOPPING.set()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(f"stopped by {name}")


def recorded_status(run: RunDir, stage: Stage, profile, entry: dict, check_outputs: bool = True) -> str:
    """A stage's status as the run's files tell it (`entry`: its record in state.json): n/a where the
    profile skips it, "stale" when it was done but its outputs changed or vanished (it will re-run; asked
    only with `check_outputs`). A check that runs on every attempt (preflight) is never stale."""
    if not stage.applies(profile):
        return "n/a"
    status = entry.get("status", "pending")
    if (check_outputs and status == "done" and not stage.always_run
            and not outputs_intact(run, entry.get("outputs", {}), quick=True)):
        return "stale"
    return status


def run_stages(run: RunDir, start: str | None = None, until: str | None = None,
               on_event: Callable[[dict], None] = lambda r: None) -> dict:
    profile = run.profile()
    stages = select(profile, start, until)
    try:
        lock = portlock.hold(profile, run.root)
    except portlock.PortTaken as exc:
        raise RunnerError(str(exc)) from None
    run.update_state(runner=procs.identity())
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _stop_signal) for sig in procs.STOP_SIGNALS} if in_main else {}
    server.STOPPING.clear()
    try:
        stop_orphans(run, profile, stages)
        summary = _run_stages(run, profile, stages, on_event)
    except BaseException as exc:
        server.STOPPING.set()  # server starts in flight (other threads) give up
        stop_servers(run, profile, "the run stopped")
        if not isinstance(exc, (KeyboardInterrupt, Interrupted)):  # an interrupt is asked to end, not to serve
            production_back(run, profile)
        raise
    else:
        server.STOPPING.set()  # a stop signal now is noted, not raised: the cleanup finishes
        stop_servers(run, profile, "the run ended")
        return summary
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.STOPPING.clear()
        lock.close()


def production_back(run: RunDir, profile) -> None:
    """A run that failed after one of its stages stopped the operator's production, with server.after_run
    asking for production after the run: production is started again before the failure is said (the
    handover never came) — only where the port is empty (the operator may have served it since) and what was
    stopped is what the profile starts (production without a head); else the note says what to start. Never
    raises: the run's own failure is what ends it."""
    stopped = run.read_state().get("production_stopped")
    if not stopped or profile.server.after_run == "stop":
        return
    by = f"the run failed after {stopped['by']} stopped production (pid {stopped['pid']})"
    server.STOPPING.clear()  # the run's own server starts gave up; this one is the operator's
    try:
        if ports.controller(profile).status().get("state") == "running":
            run.update_state(production_stopped=None)
            notes.add(run, f"{by}; the port serves again (not started by the run)", source="auto")
            return
        target = run.target_dir(profile)
        argv = procs.redact_argv(vllm_modes.server_argv(profile, "production", target))
        if stopped.get("argv") != argv:
            notes.add(run, f"{by}, whose command line is not the one the profile starts ("
                           f"{' '.join(stopped.get('argv') or [])[:300]}): not started again; start it as before",
                      source="auto")
            return
        rec = ports.start_production(profile, run, target, logging.getLogger("eagle3.production").info)
    except BaseException as exc:  # an interrupt too: the run's own failure goes on
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        notes.add(run, f"{by}, and production did not come back: {why}", source="auto")
        return
    run.update_state(production_stopped=None)
    notes.add(run, f"{by}: production started again without a head (pid {rec.pid}, port {rec.port})", source="auto")


def stop_servers(run: RunDir, profile, why: str) -> None:
    """Every server this run owns on any port is stopped when the run ends, fails or is interrupted
    (production after a handover belongs to the operator, not the run). Each one stopped is noted."""
    try:
        ports.stop_run_servers(profile, run.root, lambda text: notes.add(run, f"{why}: {text}", source="auto"))
    except server.ServerError as exc:
        notes.add(run, f"{why}: a server could not be stopped: {exc}", source="auto")


def stop_orphans(run: RunDir, profile, stages: list[Stage]) -> None:
    """Before anything starts: the servers an earlier attempt of this run left (its process was killed)
    are stopped, on every port the run used — except the one on the serving port that the first stage to
    run asks for exactly (it is reused, as after a handed-on server)."""
    first = next((s for s in stages if not s.always_run and not is_done(run, s)), None)
    wanted = None
    if first is not None:
        ctx = StageContext(run=run, profile=profile, log=logging.getLogger("eagle3.resume"), stage=first.name)
        try:
            wanted = first.server_argv(ctx)
        except (StageError, ValueError, OSError, RunDirError):
            wanted = None

    def reusable(rec) -> bool:
        keep = (wanted is not None and rec.port == profile.server.port and rec.argv == procs.redact_argv(wanted)
                and ports.controller(profile).status().get("healthy", False))
        if keep and first is not None:
            notes.add(run, f"resume: reusing {rec.describe()} that an earlier attempt left, for {first.name}",
                      source="auto")
        return keep

    ports.stop_run_servers(profile, run.root, lambda text: notes.add(
        run, f"resume: {text}, which an earlier attempt left", source="auto"), keep=reusable)


def attempt_seconds(run: RunDir, stage: str) -> list[float]:
    """Seconds of each earlier attempt of a stage, from the events: the recorded duration where the
    attempt ended in an event, else (killed) until its last event."""
    attempts: list[float] = []
    open_start = last_seen = None
    for e in run.events():
        if e.get("stage") != stage or not isinstance(e.get("t"), (int, float)):
            continue
        if e.get("kind") == "start":
            if open_start is not None:
                attempts.append(round(last_seen - open_start, 2))
            open_start = last_seen = e["t"]
        elif open_start is not None and e.get("kind") in ENDINGS:
            attempts.append(float(e.get("seconds") or round(e["t"] - open_start, 2)))
            open_start = None
        elif open_start is not None:
            last_seen = e["t"]
    if open_start is not None:
        attempts.append(round(last_seen - open_start, 2))
    return attempts


def _run_stages(run: RunDir, profile, stages: list[Stage], on_event: Callable[[dict], None]) -> dict:
    run.logs_dir.mkdir(exist_ok=True)
    summary = {}
    for stage in stages:
        if is_done(run, stage):
            on_event(run.emit(stage.name, "skip", reason="outputs recorded and intact"))
            summary[stage.name] = "skipped"
            continue
        if stage.makes_head and (cleared := existing_clears(run, profile)) is not None:
            skip_for_existing(run, stage, cleared, on_event)
            summary[stage.name] = "skipped"
            continue
        log, handler = _stage_logger(run, stage.name)
        ctx = StageContext(run=run, profile=profile, log=log, on_event=on_event, stage=stage.name)
        attempt = run.stage_state(stage.name).get("attempts", 0) + 1
        earlier = sum(attempt_seconds(run, stage.name))
        # The event first: a kill between the two leaves a start event, never a "running" without one.
        on_event(run.emit(stage.name, "start", attempt=attempt))
        run.update_stage(stage.name, status="running", started=now_iso(), attempts=attempt, outputs={},
                         earlier_seconds=round(earlier, 2), error=None)
        notes.add(run, f"{stage.name} started (attempt {attempt})", source="auto", stage=stage.name)
        t0 = time.monotonic()
        monitor = gpu.StageMonitor(timeline=run.gpu_timeline)
        try:
            with monitor, speculators_logs.into(log):
                stop_orphan_child(run, stage.name, log)  # first: a killed attempt's child would still be writing
                require_inputs(stage, ctx)
                figures = results.stored(stage.name, stage.run(ctx))  # its model's: typed where others read it
            recorded = manifest(run, stage.outputs(ctx))
        except BaseException as exc:
            seconds = round(time.monotonic() - t0, 2)
            reason = _one_line(exc)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                reason = _disk_full(run, exc)
            stopped = isinstance(exc, (Interrupted, KeyboardInterrupt))
            status, kind = ("interrupted", "interrupt") if stopped else ("failed", "fail")
            log.error("%s: %s", status, reason, exc_info=not isinstance(exc, (StageError, Interrupted,
                                                                               KeyboardInterrupt)))
            on_event(run.emit(stage.name, kind, error=reason, seconds=seconds))
            run.update_stage(stage.name, status=status, error=reason, seconds=round(earlier + seconds, 2),
                             finished=now_iso())
            notes.add(run, f"{stage.name} {status} after {seconds}s: {reason}", source="auto", stage=stage.name)
            raise
        finally:
            log.removeHandler(handler)
            handler.close()
        seconds = round(time.monotonic() - t0, 2)
        on_event(run.emit(stage.name, "finish", seconds=seconds, figures=figures))
        run.update_stage(stage.name, status="done", finished=now_iso(), seconds=round(earlier + seconds, 2),
                         figures=figures, outputs=recorded, error=None)
        notes.add(run, f"{stage.name} finished in {seconds}s" +
                  (f" ({earlier + seconds:.1f}s over {attempt} attempts)" if attempt > 1 else ""),
                  source="auto", stage=stage.name, figures=_scalars(figures))
        if (usage := monitor.summary()):
            run.update_stage(stage.name, gpu=usage)
            notes.add(run, f"{stage.name} GPU usage", source="auto", stage=stage.name, figures=usage)
        summary[stage.name] = "done"
    return summary


ENDINGS = ("finish", "fail", "interrupt")


def skip_for_existing(run: RunDir, stage: Stage, measured: results.MeasureExistingResult,
                      on_event: Callable[[dict], None]) -> None:
    """A stage that only makes a new head, not needed: the existing head cleared the deploy decision under
    evaluate.existing_policy = "deploy". Recorded done, its reason in the event, the state and the notes, and
    the measurement that made it unneeded as its output: a measure-existing that measures again (and changes
    eval/existing.json) makes the stage run, or be skipped, anew."""
    reason = (f"evaluate.existing_policy = deploy: the existing head ({measured.existing_head or measured.head}) "
              f"clears the deploy decision ({measured.reason}); no new head is made")
    on_event(run.emit(stage.name, "skip", reason=reason))
    run.update_stage(stage.name, status="done", finished=now_iso(), seconds=0.0, skipped=reason,
                     figures={"skipped": reason}, outputs=manifest(run, [run.existing_result]), error=None)
    notes.add(run, f"{stage.name} skipped: {reason}", source="auto", stage=stage.name)


def require_inputs(stage: Stage, ctx: StageContext) -> None:
    """A stage whose declared inputs are missing fails before any work, naming the first one."""
    if missing := [p for p in stage.inputs(ctx) if not p.exists()]:
        raise StageError(f"{stage.name} needs {missing[0]}, which an earlier stage writes: run from that "
                         f"stage (--from), or resume the whole run")


def _disk_full(run: RunDir, exc: OSError) -> str:
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"no space left on the disk of {run.root}{where} ({human(shutil.disk_usage(run.root).free)} free)"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if isinstance(exc, (StageError, Interrupted)):
        return text[0] if text else "stage failed"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _scalars(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if isinstance(v, (int, float, str, bool)) and not str(k).endswith("_dir")}
