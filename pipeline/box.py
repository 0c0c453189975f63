"""The serving ports of the box: which vLLM runs on each, switching a port between modes, and which run
owns which server.

One record per port under `<runs_dir>/.servers/`, shared by runs and by `eagle3-console server`, so a
server started by a run can be stopped from the command line and the other way round. A record names the
run that owns the server (its stages start and stop it; "" = the operator's, e.g. production after a
handover), so that a run stopping or resuming cleans up exactly its own servers, on every port it used."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from pipeline import gpu, portlock, procs, vllm_modes
from pipeline.profile import Profile
from pipeline.server import ServerController, ServerError, ServerRecord, is_vllm, port_owner

Say = Callable[[str], object]  # what it returns is not used


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


def registry(profile: Profile) -> Path:
    return Path(profile.run.runs_dir).resolve() / ".servers"


def controller(profile: Profile) -> ServerController:
    return ServerController(registry(profile) / f"port-{profile.server.port}.json")


def orphan_text(rec: ServerRecord) -> str:
    """A server whose owner is gone, named for the operator."""
    return f"{rec.describe()}, left by a run whose process is gone"


def free_port(profile: Profile, say: Say, force: bool = False) -> dict | None:
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
    rec = ctl.record()
    whose = f" ({orphan_text(rec)})" if rec and rec.run and not rec.owner_alive() else ""
    say(f"stopping {status['mode']} server pid {status['pid']} (processes {status.get('pids')}) on port "
        f"{profile.server.port}{whose}")
    return ctl.stop(grace=profile.server.shutdown_grace)


def free_ports(profiles: list[Profile], say: Say) -> None:
    """free_port on each; one that cannot be stopped does not keep the others running (the first error
    is raised once all were tried)."""
    errors = []
    for p in profiles:
        try:
            free_port(p, say)
        except ServerError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def start_mode(profile: Profile, mode: str, target_dir: Path, *, log_path: Path, cache_root: Path, say: Say,
               on_wait=lambda s: None, force: bool = False, owner: str = "", **mode_args) -> ServerRecord:
    """Serve `mode` on the port: reuse the running server if it is exactly this command and healthy,
    else stop what is there and start it. `owner`: the run whose stages own it ("" = the operator)."""
    guard(profile, force)
    argv = vllm_modes.server_argv(profile, mode, target_dir, **mode_args)
    ctl = controller(profile)
    rec, status = ctl.record(), ctl.status()
    if rec is not None and rec.argv == procs.redact_argv(argv) and status.get("healthy"):
        say(f"reusing the running {mode} server pid {rec.pid}")
        return ctl.claim(owner) if owner else rec  # this process owns it now (an orphan's owner was dead)
    free_port(profile, say, force)
    say(f"starting {mode} server: {' '.join(procs.redact_argv(argv))}")
    return ctl.start(argv, host=vllm_modes.bind_host(profile, mode), port=profile.server.port, mode=mode,
                     log=log_path, env=vllm_modes.server_env(profile, cache_root, mode),
                     health_timeout=profile.server.health_timeout, on_wait=on_wait, run=owner)


def adopt(profile: Profile, force: bool = False):
    guard(profile, force)
    return controller(profile).adopt(profile.server.host, profile.server.port, mode="production")


def run_servers(profile: Profile, run_root: Path) -> list[tuple[Profile, ServerRecord]]:
    """Every server the run owns, on any port (its serving port and the side-by-side ones), as recorded."""
    recs = (ServerController(path).record() for path in sorted(registry(profile).glob("port-*.json")))
    return [(profile.with_port(rec.port), rec) for rec in recs if rec is not None and rec.run == str(run_root)]


def stop_run_servers(profile: Profile, run_root: Path, say: Say,
                     keep: Callable[[ServerRecord], bool] = lambda rec: False) -> list[ServerRecord]:
    """Stop every server the run owns (by process group), except those `keep` names. Returns the stopped."""
    stopped, errors = [], []
    for port_profile, rec in run_servers(profile, run_root):
        if keep(rec):
            continue
        if procs.group_members(rec.pgid):
            say(f"stopping {rec.describe()}")
        try:
            controller(port_profile).stop(grace=profile.server.shutdown_grace)
            stopped.append(rec)
        except ServerError as exc:  # the others are still stopped; this one is said
            errors.append(exc)
    if errors:
        raise ServerError("; ".join(str(e) for e in errors))
    return stopped


CONTEXT_BYTES = 1 << 30  # a CUDA context and allocator slack per server process, beyond its share


def side_by_side(profile: Profile, wanted: int, snapshot: gpu.GpuSnapshot | None = None) -> tuple[int, str]:
    """How many of the profile's servers can start side by side on this box, and why. On a CPU box,
    `wanted`. On GPUs each server asks vLLM for server.gpu_memory_utilization of every GPU it uses and
    vLLM refuses to start when less than that is free: the servers that start together must fit the free
    memory of each GPU (their shares plus a context each), else fewer start at once (one at a time)."""
    if wanted <= 1:
        return max(wanted, 1), "one server at a time (evaluate.start_together = 1)"
    snap = snapshot or gpu.sample()
    if snap.unavailable or not snap.gpus:
        return wanted, f"{wanted} servers side by side (no GPU: memory is not the limit)"
    s = profile.server
    # the GPUs one server uses: server.cuda_visible_devices, else the first tensor_parallel_size GPUs
    visible = s.cuda_visible_devices
    used = [int(d) for d in visible.split(",")] if visible else range(s.tensor_parallel_size)
    util = s.gpu_memory_utilization
    fits, limits = wanted, []
    by_index = {g.index: g for g in snap.gpus}
    for i in used[: s.tensor_parallel_size]:
        g = by_index.get(i)
        if g is None or g.lost or not g.mem_total or g.mem_used is None:
            return 1, f"GPU {i} cannot be read: one server at a time"
        free = g.mem_total - g.mem_used
        share = util * g.mem_total + CONTEXT_BYTES
        fits = min(fits, max(1, math.floor(free / share)))
        limits.append(f"GPU {i}: {free / gpu.GIB:.1f} of {g.mem_total / gpu.GIB:.1f} GiB free, "
                      f"{share / gpu.GIB:.1f} GiB per server (server.gpu_memory_utilization {util:g} + context)")
    if fits >= wanted:
        return wanted, f"{wanted} servers side by side ({'; '.join(limits)})"
    how = "one at a time" if fits == 1 else f"{fits} at a time"
    return fits, (f"evaluate.start_together = {wanted} does not fit the GPU memory, {how}: " + "; ".join(limits))


def mode_inputs(profile: Profile, run, mode: str, draft: str | None = None, storage: str | None = None):
    """The target directory and mode arguments a server start needs, from a run (demo target, published
    draft, hidden-state storage) or from the profile and explicit paths."""
    from pipeline.target import resolve_layer_ids

    if profile.target.source == "demo" and run is None:
        raise ValueError("a demo target lives in a run: pass --run-dir RUN_DIR")
    target_dir = run.target_dir(profile) if run else Path(profile.target.model_path)
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
