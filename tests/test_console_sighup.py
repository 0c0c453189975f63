"""End to end: a console attached to a running demo run gets SIGHUP (the SSH session closed); the job,
detached in its own session, still completes, and attaching again shows the same state."""
import json
import os
import pty
import signal
import sys
import threading
import time

import pytest

from pipeline.layout.rundir import RunDir
from pipeline.run import jobs
from tests.conftest import ROOT, TINY, free_port

pytestmark = pytest.mark.slow


def test_sighup_to_console_leaves_the_job_running(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    port = free_port()  # not the profile's port, which another run on this box may hold
    pid, fd = pty.fork()
    if pid == 0:  # the child: the console in a real terminal
        os.chdir(ROOT)
        os.environ.update(TERM="xterm-256color", HF_HUB_OFFLINE="1")
        os.execv(sys.executable, [sys.executable, "-m", "pipeline", "run", str(TINY), "--run-dir", str(run_dir),
                                  "--set", f'run.cache_dir="{cache_dir}"', "--set", f"server.port={port}"])
    seen = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()

    def job_working():
        """The console is drawn and the detached job's runner has recorded itself and started a stage."""
        if not (run_dir / "job.json").exists() or b"eagle3-console" not in bytes(seen):
            return False
        state = RunDir.open(run_dir).read_state()
        job_pid = json.loads((run_dir / "job.json").read_text())["pid"]
        return (state.get("runner") or {}).get("pid") == job_pid and any(
            s.get("status") == "running" for s in state.get("stages", {}).values())

    deadline = time.monotonic() + 120
    while not job_working():
        assert time.monotonic() < deadline, bytes(seen)[-2000:]
        time.sleep(0.2)
    run = RunDir.open(run_dir)
    job = jobs.job_state(run)
    assert job["state"] == "running"
    os.kill(pid, signal.SIGHUP)
    t0 = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert time.monotonic() - t0 < 15  # the console went away
    # the job did not: the same process still runs it (the tiny run lasts minutes, the console's exit seconds)
    assert jobs.job_state(run) == {"state": "running", "pid": job["pid"]}
    deadline = time.monotonic() + 600
    while jobs.job_state(run)["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(1)
    assert jobs.job_state(run)["state"] == "finished"
    state = run.read_state()["stages"]
    assert state["evaluate-offline"]["status"] == "done" and state["evaluate-offline"]["figures"]["lossless"]
