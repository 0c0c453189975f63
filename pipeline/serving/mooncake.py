"""The Mooncake master a run starts for its own states (extract.transfer = "mooncake" with
extract.mooncake_master on this host): started before the extraction server and the trainer, stopped by
process group after both, its port locked like a serving port, its process group recorded so that a
resume after a SIGKILL stops the orphan. A master named on another host is that host's to run.

The master is the wheel's `mooncake_master` (mooncake-transfer-engine-non-cuda 0.3.13.post1 on CPU; the
CUDA builds ship the same binary), bound to loopback: its defaults listen on 0.0.0.0 and keep a metrics
port 9003 (NOTES.md "Several nodes")."""
from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from pipeline.host import portlock, procs
from pipeline.host.waiting import wait_until
from pipeline.layout.rundir import RunDir
from pipeline.profile import Profile
from pipeline.serving.server import port_in_use

LOOPBACK = ("127.0.0.1", "localhost")
RECORD = "mooncake_master_pgid"  # in the train stage's state


class MasterError(RuntimeError):
    """The run's Mooncake master did not come up; the message is one line."""


def address(profile: Profile) -> tuple[str, int]:
    host, _, port = profile.extract.mooncake_master.rpartition(":")
    return host, int(port)


def runs_here(profile: Profile) -> bool:
    """The run starts its own master: Mooncake transfer with the master on this host's loopback."""
    return profile.extract.transfer == "mooncake" and address(profile)[0] in LOOPBACK


def binary() -> Path:
    """The wheel's launcher beside this interpreter (the venv's bin/)."""
    return Path(sys.executable).parent / "mooncake_master"


def _answers(port: int) -> bool:
    with closing(socket.socket()) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def master(profile: Profile, run: RunDir, stage: str, timeout: float = 30.0) -> Iterator[int | None]:
    """The run's master for the block (its pid, or None when the profile names one elsewhere)."""
    if not runs_here(profile):
        yield None
        return
    if (orphan := run.stage_state(stage).get(RECORD)) and procs.group_members(orphan):
        procs.stop_group(orphan, grace=10)  # a SIGKILLed attempt's master: ours, by its recorded group
    host, port = address(profile)
    if not binary().exists():
        raise MasterError(f"extract.mooncake_master = {profile.extract.mooncake_master!r}: no {binary()} "
                          "(pip install mooncake-transfer-engine-non-cuda, or a CUDA build, into this environment)")
    try:
        lock = portlock.hold(profile.with_port(port), run.root)
    except portlock.PortTaken as exc:
        raise MasterError(f"extract.mooncake_master port {port}: {exc}") from None
    with closing(lock):
        if port_in_use("127.0.0.1", port):
            raise MasterError(f"extract.mooncake_master = {profile.extract.mooncake_master!r}: port {port} is "
                              "already in use by another process")
        log = run.log_path("mooncake-master")
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(binary()), "-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1",
                "-metrics_port=0", "-logtostderr", "-enable_metric_reporting=false"]  # all on loopback
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        run.update_stage(stage, **{RECORD: proc.pid})
        try:
            def listening() -> bool:
                if proc.poll() is not None and not _answers(port):
                    raise MasterError(f"the Mooncake master exited with {proc.returncode} before listening on "
                                      f"{host}:{port}: {procs.last_error_line(log)} (log: {log})")
                return _answers(port)
            if not wait_until(listening, timeout, 0.1):
                raise MasterError(f"the Mooncake master did not listen on {host}:{port} within {timeout:g} s "
                                  f"(log: {log})")
            yield proc.pid
        finally:
            procs.stop_group(proc.pid, grace=10)
            proc.wait()
            run.update_stage(stage, **{RECORD: None})
