"""SIGKILL the real pipeline process in the middle of extract and of train, then resume it."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline import atomicio, procs
from pipeline.rundir import RunDir
from pipeline.stages.train import epoch_complete, epoch_dirs
from tests.conftest import ROOT, TINY, cli, free_port

pytestmark = pytest.mark.slow


def start(run_dir, cache_dir, *sets):
    args = [sys.executable, "-m", "pipeline", "run", str(TINY), "--no-tui", "--run-dir", str(run_dir),
            "--set", f'run.cache_dir="{cache_dir}"', "--set", f"server.port={free_port()}"]  # a port no other run holds
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
    """The trainer runs in its own session, so SIGKILLing the pipeline process leaves it running. It is
    frozen (SIGSTOP) just before the kill, so that it can neither finish, nor die of its closed pipe, nor
    write another checkpoint before the resume looks: the resume must find it alive, stop it (SIGTERM,
    then SIGKILL after the grace, since a stopped process does not act on SIGTERM), and quarantine exactly
    the directories that are incomplete in the frozen tree."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    proc = start(run_dir, cache_dir, "train.epochs=4")
    wait_for(lambda: (ckpts / "0" / "training_state.json").exists() and stage_status(run_dir, "train") == "running",
             proc, poll=0.01)
    trainer_pgid = RunDir.open(run_dir).stage_state("train")["child_pgid"]
    os.killpg(trainer_pgid, signal.SIGSTOP)
    proc.send_signal(signal.SIGKILL)  # the pipeline process only, as the OOM killer would
    proc.wait()
    assert stage_status(run_dir, "train") == "running"
    orphans = procs.group_members(trainer_pgid)
    assert orphans, "the trainer's group should outlive the pipeline process"
    # Leave a half-written epoch behind, as a kill during a checkpoint save would.
    half = ckpts / "9"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 10)
    complete = [d.name for d in epoch_dirs(ckpts) if epoch_complete(d)]
    incomplete = [d.name for d in epoch_dirs(ckpts) if not epoch_complete(d)]
    assert complete and complete[0] == "0" and incomplete[-1] == "9"

    try:
        done = cli("run", "--resume", run_dir, "--no-tui")
        alive = [p for p in orphans if _alive(p)]
    finally:
        for p in orphans:  # never leave a frozen trainer behind, whatever the resume did
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert alive == [] and procs.group_members(trainer_pgid) == []
    run = RunDir.open(run_dir)
    assert kinds(run_dir, "extract")[-1] == "skip"
    log = run.log_path("train").read_text()
    assert f"stopping trainer process group {trainer_pgid} left by an earlier attempt" in log
    figs = run.stage_state("train")["figures"]
    assert figs["resumed_from_epoch"] == int(complete[-1]) and figs["quarantined"] == incomplete
    assert sorted(p.name.split("-")[0] for p in (ckpts / "incomplete").iterdir()) == sorted(incomplete)
    assert Path(figs["checkpoint"]).resolve() == (ckpts / str(run.profile().train.epochs - 1)).resolve()
    assert "Resuming training on epoch" in log
    assert run.stage_state("evaluate-offline")["figures"]["lossless"] is True


def _alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
