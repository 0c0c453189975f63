"""Every command the console sends to the engine, through pipeline/ as the CLI's: the serving port's server
stopped or started in a mode, a note appended, the notes exported. Run in worker threads; each returns
what to tell the operator or raises with the engine's own one-line reason."""
from __future__ import annotations

from pathlib import Path

from pipeline import box, jobs, notes, portlock
from pipeline.profile import Profile
from pipeline.rundir import RunDir

PortHeld = box.PortHeld  # a run in progress holds the port: the operator is asked before forcing it


def serve(profile: Profile, rundir: RunDir, what: str, mode: str | None, force: bool) -> str:
    """Stop the port's server (`what` = "stop") or start it in `mode`; `force`: past the run that holds it."""
    if what == "stop":
        return f"stopped: {box.free_port(profile, lambda m: None, force=force)}"
    if mode is None:  # the start commands all name a mode
        raise ValueError("no server mode chosen")
    target_dir, mode_args = box.mode_inputs(profile, rundir, mode)
    rec = box.start_mode(profile, mode, target_dir, log_path=rundir.log_path(f"server-{mode}"),
                         cache_root=rundir.cache_root, say=lambda m: None, force=force, **mode_args)
    return f"{mode} server healthy, pid {rec.pid}"


def port_holder(profile: Profile) -> dict | None:
    """The run holding the serving port, if any; None also when its lock cannot be read from here (the
    command itself checks again and says)."""
    try:
        return portlock.holder(profile)
    except OSError:
        return None


add_note = notes.add  # append to the run's notes; OSError: a read-only run, a full disk


def export_notes(rundir: RunDir) -> Path:
    """The notes as Markdown into the run. The destination is opened first: a run that cannot be written
    fails before anything is rendered (the report may render matplotlib plots: seconds)."""
    from pipeline.atomicio import atomic_write_rendered

    out = rundir.notes_export
    atomic_write_rendered(out, lambda: notes.export(rundir, "md", jobs.snapshot(rundir), out).encode())
    return out
