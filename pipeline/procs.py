"""Process groups: every child the pipeline starts gets its own session; it is stopped as a group."""
from __future__ import annotations

import os
import signal
import time

import psutil


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group. A zombie holds nothing and, in a container
    whose init does not reap, may never go away, so it does not count."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def stop_group(pgid: int, grace: float = 30.0) -> bool:
    """SIGTERM the group, wait up to `grace` s, SIGKILL what is left; True if it had to SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not group_members(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 10
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True
