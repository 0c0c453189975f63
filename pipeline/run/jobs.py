"""A run as a detached job: its own session, output to a file, so that closing the terminal (SIGHUP)
or quitting the console never stops it (docs/reference.md §5: a child writing to a pipe dies with the
console, one writing to a file survives)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil

from pipeline.host import procs
from pipeline.layout import atomicio
from pipeline.layout.results import Peer, RunSnapshot, StageStatus
from pipeline.layout.rundir import RunDir


def start_detached(run: RunDir, start: str | None = None, until: str | None = None) -> int:
    argv = [sys.executable, "-m", "pipeline", "run", "--resume", str(run.root), "--no-tui"]
    if start:
        argv += ["--from", start]
    if until:
        argv += ["--until", until]
    run.logs_dir.mkdir(exist_ok=True)
    with open(run.job_log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    atomicio.atomic_write_json(run.job_record, {"pid": proc.pid, "argv": argv, "started": time.time()})
    return proc.pid


def runner_alive(run: RunDir) -> int | None:
    """The pid of the process running this run's stages (recorded in state.json by the runner, checked
    by its start time so a reused pid does not count), or of its detached job; None when none lives."""
    runner = run.read_state().get("runner") or {}
    with suppress(psutil.Error, KeyError):
        if runner and procs.is_process(runner["pid"], runner["since"], runner.get("start", "")):
            return runner["pid"]
    with suppress(FileNotFoundError, json.JSONDecodeError, KeyError, psutil.Error):
        job = json.loads(run.job_record.read_text())
        p = psutil.Process(job["pid"])
        if p.status() != psutil.STATUS_ZOMBIE and str(run.root) in " ".join(p.cmdline()):
            return job["pid"]
    return None


def live_status(recorded: str, pid: int | None) -> str:
    """A stage's status as it stands: one recorded "running" while no process runs the job was
    interrupted (SIGKILL, power loss). The one place `status`, the job's state and the console read it."""
    return "interrupted" if recorded == "running" and not pid else recorded


def job_state(run: RunDir) -> dict:
    """running / interrupted / failed / finished / not started, from the live processes and the run's
    state: a stage recorded "running" whose process is gone was interrupted (SIGKILL, power loss)."""
    pid = runner_alive(run)
    stages = run.read_state().get("stages", {})
    statuses = {live_status(str(s.get("status")), pid) for s in stages.values()}
    first_that_holds = (("running", bool(pid)), ("interrupted", "interrupted" in statuses),
                        ("failed", "failed" in statuses), ("finished", bool(stages) and statuses == {"done"}),
                        ("stopped", bool(stages)))
    return {"state": next((state for state, holds in first_that_holds if holds), "not started"), "pid": pid}


def next_step(state: str, root: str | Path, pid: int | None = None) -> str:
    """What the operator does next with a run in `state` (status's hint, the console's Run tab)."""
    return {"running": f"pid {pid}; watch with: eagle3-console attach {root}",
            "interrupted": f"its process is gone; resume with: eagle3-console run --resume {root}",
            "failed": f"the failed stage's log says why; resume with: eagle3-console run --resume {root}",
            "stopped": f"resume with: eagle3-console run --resume {root}",
            "finished": f"the report: eagle3-console notes export {root} -o report.md"}.get(state, "")


def process_roles(run: RunDir, server: dict) -> dict[int, str]:
    """Which processes of the box serve and which train this run (the GPU view labels them): the port's
    vLLM server group, and the trainer's process group while it lives."""
    from pipeline.host import procs

    roles = {pid: f"serve ({server.get('mode')})" for pid in server.get("pids", [])}
    pgid = run.stage_state("train").get("child_pgid")
    if pgid and run.stage_state("train").get("status") == "running":
        roles.update({p.pid: "train" for p in procs.group_members(pgid)})
    return roles


def snapshot(run: RunDir, check_outputs: bool = True, peers: bool = True) -> RunSnapshot:
    """`check_outputs` = False: a done stage's outputs are not checked, so no row says "stale" (the
    console polls every second); `peers` = False: the other nodes are not asked (an exporter, the console
    between its reads of them)."""
    from pipeline.run.runner import recorded_status
    from pipeline.serving import ports
    from pipeline.stages import STAGES

    profile = run.profile()
    job, recorded = job_state(run), run.read_state().get("stages", {})
    rows = []
    for stage in STAGES:
        entry = recorded.get(stage.name, {})
        status = recorded_status(run, stage, profile, entry, check_outputs)
        rows.append(StageStatus(stage.name, live_status(status, job["pid"]),
                                entry.get("seconds"), entry.get("attempts"), entry.get("figures", {}),
                                entry.get("error"), entry.get("gpu")))
    server = ports.controller(profile).status()
    return RunSnapshot(str(run.root), profile.name, job["state"], job["pid"], tuple(rows), server,
                       process_roles(run, server), other_nodes(profile) if peers else ())


def other_nodes(profile) -> tuple[Peer, ...]:
    """What node 0 shows of a multi-node job's other nodes, from their exporters (train.node_exporters)."""
    if not (profile.train.first_node and profile.train.node_exporters):
        return ()
    from pipeline.run import peers
    return peers.read_all(list(profile.train.node_exporters))
