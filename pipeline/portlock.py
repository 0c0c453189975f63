"""One run at a time per serving port: a run holds an exclusive flock on runs/.servers/port-N.lock
while its stages run, so a second run of the same box cannot stop or replace the first one's vLLM
server. The kernel drops the lock when the holder dies (a SIGKILLed run resumes freely); the file
names the holder for the error message."""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from pipeline.profile import Profile


class PortTaken(RuntimeError):
    pass


def lock_path(profile: Profile) -> Path:
    return Path(profile.run.runs_dir).resolve() / ".servers" / f"port-{profile.server.port}.lock"


def _read(fh) -> dict:
    fh.seek(0)
    try:
        return json.loads(fh.read() or "{}")
    except json.JSONDecodeError:
        return {}


def hold(profile: Profile, run_root: Path):
    """Take the port's lock for this process (kept until the returned file is closed or the process
    ends); PortTaken names the run that holds it."""
    path = lock_path(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")  # noqa: SIM115 - held open for the life of the run
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = _read(fh)
        fh.close()
        raise PortTaken(f"port {profile.server.port} belongs to another run in progress (pid {other.get('pid', '?')}, "
                        f"{other.get('run', '?')}): one run at a time per serving port") from None
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"pid": os.getpid(), "run": str(run_root)}))
    fh.flush()
    return fh


def holder(profile: Profile) -> dict | None:
    """The run holding the port's lock, if another process holds it; None when free or held by us."""
    path = lock_path(profile)
    if not path.exists():
        return None
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read(fh)
            return None if other.get("pid") == os.getpid() else other
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None
