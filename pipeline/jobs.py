"""A run as a detached job: its own session, output to a file, so that closing the terminal (SIGHUP)
or quitting the console never stops it (REFERENCE.md §5: a child writing to a pipe dies with the
console, one writing to a file survives)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline import atomicio
from pipeline.rundir import RunDir


def job_path(run: RunDir) -> Path:
    return run.root / "job.json"


def start_detached(run: RunDir, start: str | None = None, until: str | None = None) -> int:
    argv = [sys.executable, "-m", "pipeline", "run", "--resume", str(run.root), "--no-tui"]
    if start:
        argv += ["--from", start]
    if until:
        argv += ["--until", until]
    run.logs_dir.mkdir(exist_ok=True)
    with open(run.logs_dir / "job.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=Path(__file__).resolve().parent.parent)
    atomicio.atomic_write_json(job_path(run), {"pid": proc.pid, "argv": argv, "started": time.time()})
    return proc.pid


def job_state(run: RunDir) -> dict:
    """running / finished / failed / not started, from the job record and the run's state."""
    try:
        job = json.loads(job_path(run).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        job = None
    alive = False
    if job:
        try:
            p = psutil.Process(job["pid"])
            alive = p.status() != psutil.STATUS_ZOMBIE and str(run.root) in " ".join(p.cmdline())
        except psutil.Error:
            alive = False
    stages = run.read_state().get("stages", {})
    if alive:
        state = "running"
    elif any(s.get("status") == "failed" for s in stages.values()):
        state = "failed"
    elif stages and all(s.get("status") == "done" for s in stages.values()):
        state = "finished"
    else:
        state = "stopped" if job else "not started"
    return {"state": state, "pid": job["pid"] if job else None}
