"""Every command the console sends to the engine, through pipeline/ as the CLI's: the serving port's server
stopped or started in a mode, a note appended, the notes exported. Run in worker threads; each returns
what to tell the operator or raises with the engine's own one-line reason."""
from __future__ import annotations

from pathlib import Path

from pipeline.host import portlock, procs
from pipeline.layout.rundir import RunDir
from pipeline.profile import Profile
from pipeline.report import notes
from pipeline.run import jobs
from pipeline.serving import ports, vllm_modes

PortHeld = ports.PortHeld  # a run in progress holds the port: the operator is asked before forcing it
MODES = vllm_modes.MODES  # every mode the CLI's `server start --mode` has


def serve(profile: Profile, rundir: RunDir, what: str, mode: str | None, force: bool,
          expect: int | None = None) -> str:
    """Stop the port's server (`what` = "stop"), or start it in `mode` ("start": an identical healthy
    server is kept; "restart": it is replaced). `force`: past the run that holds the port or owns the
    server; `expect`: the pid the operator's question named — only that process is stopped (a vLLM no
    record names included), another one there now is refused."""
    if what == "stop":
        stopped = ports.stop_server_on_port(profile, lambda m: None, force=force, expect=expect, by=BY['stop'])
        return f"stopped: {stopped}"
    if mode is None:  # the start commands all name a mode
        raise ValueError("no server mode chosen")
    rec = ports.start_server(profile, rundir, mode, say=lambda m: None, force=force, expect=expect,
                             by=f"{BY[what]} ({mode})", restart=what == "restart")
    return f"{mode} server healthy, pid {rec.pid}"


# what a run whose server the console stopped is told (server.stopped_by)
BY = {"stop": "eagle3-console console: Stop (x)", "restart": "eagle3-console console: Restart (r)",
      "start": "eagle3-console console: Start in mode (m)"}


def start_preview(profile: Profile, rundir: RunDir, mode: str) -> dict:
    """What a start in `mode` would run, for the operator's question: the argv (secrets redacted), where it
    binds, and the draft it serves. ValueError: the mode cannot start from this run (no draft, no target)."""
    target_dir, mode_args = ports.mode_inputs(profile, rundir, mode)
    argv = procs.redact_argv(vllm_modes.server_argv(profile, mode, target_dir, **mode_args))
    return {"argv": " ".join(argv), "host": vllm_modes.bind_host(profile, mode), "port": profile.server.port,
            "draft": str(mode_args["draft_dir"]) if mode_args.get("draft_dir") else None,
            "gpus": profile.server.cuda_visible_devices or f"the first {profile.server.tensor_parallel_size}"}


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
    from pipeline.layout.atomicio import atomic_write_rendered

    out = rundir.notes_export
    atomic_write_rendered(out, lambda: notes.export(rundir, "md", jobs.snapshot(rundir), out).encode())
    return out
