"""SIGKILL the real pipeline process in the middle of extract and of train, then resume it."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pipeline import atomicio
from pipeline.rundir import RunDir
from tests.conftest import ROOT, TINY, cli

pytestmark = pytest.mark.slow


def start(run_dir, cache_dir, *sets):
    args = [sys.executable, "-m", "pipeline", "run", str(TINY), "--no-tui", "--run-dir", str(run_dir),
            "--set", f'run.cache_dir="{cache_dir}"']
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def wait_for(predicate, proc, timeout=300, poll=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, "the run ended before the kill point was reached"
        time.sleep(poll)
    raise AssertionError("kill point not reached in time")


def stage_status(run_dir, stage):
    try:
        return json.loads((run_dir / "state.json").read_text())["stages"].get(stage, {}).get("status")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def kinds(run_dir, stage):
    return [e["kind"] for e in atomicio.read_jsonl(run_dir / "events.jsonl") if e["stage"] == stage]


def test_sigkill_during_extract_then_resume(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # Many one-sample batches through a wider target: extraction lasts long enough to be caught.
    proc = start(run_dir, cache_dir, "data.num_conversations=150", "extract.batch_size=1",
                 "extract.writer_threads=1", "demo_target.hidden_size=256", "demo_target.intermediate_size=512",
                 "data.regenerate=false")
    hs = run_dir / "data" / "prepared" / "hidden_states"
    wait_for(lambda: stage_status(run_dir, "extract") == "running" and hs.is_dir()
             and len(list(hs.glob("hs_*.safetensors"))) >= 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert stage_status(run_dir, "extract") == "running"  # killed mid-stage, for real
    status = cli("status", run_dir)  # a dead run does not look alive
    assert "state: interrupted" in status.stdout and f"run --resume {run_dir}" in status.stdout
    assert "extract           interrupted" in status.stdout
    survivors = {p.name: p.stat().st_ino for p in hs.glob("hs_*.safetensors")}
    total = RunDir.open(run_dir).stage_state("prepare")["figures"]["rows"]
    assert 5 <= len(survivors) < total

    done = cli("run", "--resume", run_dir, "--no-tui")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = RunDir.open(run_dir)
    for finished in ("build-target", "prepare"):
        assert kinds(run_dir, finished)[-1] == "skip"  # not redone
    figs = run.stage_state("extract")["figures"]
    assert figs["resumed_from"] == len(survivors) and figs["extracted"] == total - len(survivors)
    last = [e for e in run.events() if e["stage"] == "extract" and e["kind"] == "finish"][-1]
    assert run.stage_state("extract")["seconds"] > last["seconds"]  # the killed attempt's time counts too
    # files finished before the kill were kept, not rewritten
    assert all((hs / name).stat().st_ino == ino for name, ino in survivors.items())
    assert not list(hs.glob(".hs_*.tmp"))
    assert run.stage_state("evaluate-offline")["status"] == "done"


def test_sigkill_during_train_then_resume(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache_dir, "train.epochs=4")
    ckpt0 = run_dir / "checkpoints" / "0" / "training_state.json"
    wait_for(lambda: ckpt0.exists() and stage_status(run_dir, "train") == "running", proc, poll=0.01)
    trainer_pgid = RunDir.open(run_dir).stage_state("train")["child_pgid"]
    proc.send_signal(signal.SIGKILL)  # the pipeline process only, as the OOM killer would
    proc.wait()
    assert stage_status(run_dir, "train") == "running"
    # Leave a half-written epoch behind, as a kill during a checkpoint save would.
    half = run_dir / "checkpoints" / "9"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 10)

    done = cli("run", "--resume", run_dir, "--no-tui")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = RunDir.open(run_dir)
    assert all(k == "skip" for k in kinds(run_dir, "extract")[-1:])
    figs = run.stage_state("train")["figures"]
    assert figs["resumed_from_epoch"] is not None and figs["resumed_from_epoch"] >= 0
    assert figs["quarantined"] == ["9"] and (run_dir / "checkpoints" / "incomplete").is_dir()
    assert figs["checkpoint"].endswith("/3")
    log = run.log_path("train").read_text()
    assert "Resuming training on epoch" in log
    assert "left by an earlier attempt" in log or not any(
        p.is_running() for p in psutil.process_iter() if _pgid(p) == trainer_pgid)
    assert run.stage_state("evaluate-offline")["figures"]["lossless"] is True


def _pgid(p):
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, psutil.Error):
        return None
