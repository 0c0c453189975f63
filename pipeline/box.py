"""The serving port of the box: which vLLM runs there, and switching it between modes.

One record per port under `<runs_dir>/.servers/`, shared by runs and by `eagle3-console server`, so a
server started by a run can be stopped from the command line and the other way round."""
from __future__ import annotations

from pathlib import Path

from pipeline import portlock, procs, vllm_modes
from pipeline.profile import Profile
from pipeline.server import ServerController, ServerError, is_vllm, port_owner


class PortHeld(ServerError):
    """A run in progress holds the port: its stages own the server there."""

    def __init__(self, holder: dict, port: int):
        self.holder = holder
        super().__init__(f"port {port} is held by a run in progress (pid {holder.get('pid', '?')}, "
                         f"{holder.get('run', '?')}): its stages use the server there; wait for it, stop it, "
                         f"or pass --force")


def guard(profile: Profile, force: bool = False) -> None:
    """Refuse to touch the port's server while another process's run holds the port (the operator may
    insist with force). The run's own stages hold the lock themselves and pass."""
    holder = portlock.holder(profile)
    if holder is not None and not force:
        raise PortHeld(holder, profile.server.port)


def controller(profile: Profile) -> ServerController:
    return ServerController(Path(profile.run.runs_dir).resolve() / ".servers" / f"port-{profile.server.port}.json")


def free_port(profile: Profile, log, force: bool = False) -> dict | None:
    """Stop whatever vLLM serves the profile's port (recorded, or found there and adopted). Returns
    what was stopped. A non-vLLM process on the port is an error: it is not ours to stop."""
    guard(profile, force)
    ctl = controller(profile)
    status = ctl.status()
    if status["state"] == "none":
        owner = port_owner(profile.server.host, profile.server.port)
        if owner is None:
            return None
        if not is_vllm(owner):
            raise ServerError(f"port {profile.server.port} is in use by pid {owner.pid} "
                              f"({procs.shown_cmdline(owner)}), which is not vLLM")
        ctl.adopt(profile.server.host, profile.server.port)
        status = ctl.status()
    log(f"stopping {status['mode']} server pid {status['pid']} (processes {status.get('pids')}) on port "
        f"{profile.server.port}")
    return ctl.stop(grace=profile.server.shutdown_grace)


def start_mode(profile: Profile, mode: str, target_dir: Path, log_path: Path, cache_root: Path, log,
               on_wait=lambda s: None, force: bool = False, **mode_args):
    """Serve `mode` on the port: reuse the running server if it is exactly this command and healthy,
    else stop what is there and start it."""
    guard(profile, force)
    argv = vllm_modes.server_argv(profile, mode, target_dir, **mode_args)
    ctl = controller(profile)
    rec, status = ctl.record(), ctl.status()
    if rec is not None and rec.argv == procs.redact_argv(argv) and status.get("healthy"):
        log(f"reusing the running {mode} server pid {rec.pid}")
        return rec
    free_port(profile, log, force)
    log(f"starting {mode} server: {' '.join(procs.redact_argv(argv))}")
    return ctl.start(argv, host=vllm_modes.bind_host(profile, mode), port=profile.server.port, mode=mode,
                     log=log_path, env=vllm_modes.server_env(profile, cache_root, mode),
                     health_timeout=profile.server.health_timeout, on_wait=on_wait)


def adopt(profile: Profile, force: bool = False):
    guard(profile, force)
    return controller(profile).adopt(profile.server.host, profile.server.port, mode="production")


def mode_inputs(profile: Profile, run, mode: str, draft: str | None = None, storage: str | None = None):
    """The target directory and mode arguments a server start needs, from a run (demo target, published
    draft, hidden-state storage) or from the profile and explicit paths."""
    from pipeline.stages.base import target_dir as run_target_dir
    from pipeline.target import resolve_layer_ids

    if profile.target.source == "demo" and run is None:
        raise ValueError("a demo target lives in a run: pass --run-dir RUN_DIR")
    target_dir = run_target_dir(run, profile) if run else Path(profile.target.model_path)
    if mode == "extraction":
        from pipeline.targetinfo import from_config
        n = from_config(target_dir / "config.json").layers  # multimodal wrappers: text_config
        where = Path(storage) if storage else (run.hs_raw_dir if run else None)
        if where is None:
            raise ValueError("extraction mode needs --storage DIR (or --run-dir)")
        return target_dir, {"layer_ids": resolve_layer_ids(profile.extract.layer_ids, n), "storage": where}
    if mode == "speculative" or draft:
        where = Path(draft) if draft else (run.draft_dir if run else None)
        if where is None or not (where / "config.json").is_file():
            raise ValueError(f"no published draft at {where}: pass --draft DIR (a deploy-measure output)")
        return target_dir, {"draft_dir": where}
    return target_dir, {}
