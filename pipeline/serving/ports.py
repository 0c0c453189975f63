"""The serving ports of the host: which vLLM runs on each, switching a port between modes, and which run
owns which server.

A port is the host's, so its records are too: one place for every folder and user of the tool
(portlock.runtime_dir, e.g. /tmp/eagle3-console), where each user writes its own record file per port
(`port-N.u<UID>.json`) and every user reads all of them. A server started by a run can be stopped from
the command line and the other way round, from any folder. A record names the run that owns the server
(its stages start and stop it; "" = the operator's, e.g. production after a handover), so that a run
stopping or resuming cleans up exactly its own servers, on every port it used. Records an older version
left in a folder's runs/.servers/ are moved here when a command of that folder reads them (migrate)."""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from pipeline.host import gpu, portlock, procs
from pipeline.profile import Profile
from pipeline.serving import vllm_modes
from pipeline.serving.server import (
    ServerController,
    ServerError,
    ServerRecord,
    is_live,
    is_vllm,
    port_in_use,
    port_owner,
)

Say = Callable[[str], object]  # what it returns is not used
log = logging.getLogger("eagle3.box")


class PortHeld(ServerError):
    """A run in progress holds the port, or owns the server there: its stages use it."""

    def __init__(self, holder: dict, port: int, message: str | None = None):
        self.holder = holder
        super().__init__(message or (
            f"port {port} is held by a run in progress (pid {holder.get('pid', '?')}, {holder.get('run', '?')}"
            f"{', user ' + holder['user'] if holder.get('user') else ''}): its stages use the server there; wait "
            f"for it, stop it, or pass --force"))


class Unrecorded(ServerError):
    """A vLLM serves the port that no record names: it is stopped only when the operator named it."""

    def __init__(self, listener: dict, port: int):
        self.listener = listener
        super().__init__(f"port {port} is served by a vLLM that no record names: {listener_text(listener)}; "
                         f"not stopped — `server adopt` records it, `--force` stops it")


def listener_text(s: dict) -> str:
    """An unrecorded listener for the operator: pid, group, user and argv."""
    return f"pid {s.get('pid')} (process group {s.get('pgid')}, user {s.get('user')}): {s.get('argv')}"


class PortController(ServerController):
    """The server of one port as the host-wide registry knows it. Each user writes its own file
    (`port-N.u<UID>.json`, 0644); the port's record is the one naming a live server, else this user's
    own, else the newest. `record_path` is where this user writes."""

    def __init__(self, directory: Path, port: int, host: str = "127.0.0.1", profile: Profile | None = None):
        super().__init__(directory / f"port-{port}.u{os.getuid()}.json")
        self.directory, self.port, self.host = directory, port, host
        self.profile = profile  # its status names the run holding the port (portlock.holder)
        self.source: Path | None = None  # the file the last record() came from

    def files(self) -> list[Path]:
        return sorted(self.directory.glob(f"port-{self.port}.u*.json"))

    def record(self) -> ServerRecord | None:
        best = None
        for path in self.files():
            rec = ServerController(path).record()
            if rec is None:
                continue
            rank = (is_live(rec), path == self.record_path, rec.started)
            if best is None or rank > best[0]:
                best = (rank, path, rec)
        self.source = best[1] if best else None
        return best[2] if best else None

    def user(self) -> str:
        """The user whose file holds the port's record (who started or adopted the server)."""
        try:
            return portlock.user_name(self.source.stat().st_uid) if self.source else "?"
        except OSError:
            return "?"

    def _save(self, rec: ServerRecord | None) -> None:
        if rec is not None:
            portlock.write_shared(self.record_path, asdict(rec))
        # the record it replaces (claimed or dropped) goes; another user's file stays unless we are root,
        # and a dead record is ranked below a live one anyway
        if self.source is not None and (rec is None or self.source != self.record_path):
            try:
                self.source.unlink(missing_ok=True)
            except PermissionError:
                pass
        self.source = self.record_path if rec is not None else None

    def status(self) -> dict:
        status = super().status()
        if status["state"] != "none":
            rec = self.record()
            status |= {"user": self.user(), "argv": rec.argv if rec else []}
        elif (found := unrecorded(self.host, self.port)) is not None:
            status = found
        if self.profile is not None and (held := portlock.holder(self.profile)) is not None:
            status["held_by"] = held  # a run of any folder or user whose stages use the port
        return status


def unrecorded(host: str, port: int) -> dict | None:
    """What listens on the port when no record names a server there: pid, group, user, argv and whether
    it is vLLM; a listener of another user that this user cannot see is said as such. None: nothing."""
    if not port_in_use(host, port):
        return None
    owner = port_owner(host, port)
    if owner is None:  # another user's socket: its pid is not ours to read
        return {"state": "unrecorded", "port": port, "host": host, "pid": None, "pgid": None, "user": "?",
                "argv": "(a process this user cannot see)", "vllm": False}
    try:
        pgid = os.getpgid(owner.pid)
    except OSError:
        pgid = None
    return {"state": "unrecorded", "port": port, "host": host, "pid": owner.pid, "pgid": pgid,
            "user": procs.user_of(owner.pid), "argv": procs.shown_cmdline(owner, 400), "vllm": is_vllm(owner)}


def registry(profile: Profile | None = None, writable: bool = True) -> Path:
    """The host-wide registry (the same for every profile and folder: the port is the host's)."""
    return portlock.runtime_dir(writable)


def legacy_registry(profile: Profile) -> Path:
    return Path(profile.run.runs_dir).resolve() / ".servers"


def migrate(profile: Profile, say: Say = log.warning) -> list[str]:
    """Move the records an older version kept in the folder's runs/.servers/ into the host-wide registry:
    a live server's record moves (so every folder sees it), a dead one's is dropped. Each said."""
    said: list[str] = []
    old = legacy_registry(profile)
    if not old.is_dir():
        return said
    for path in sorted(old.glob("port-*.json")):
        rec = ServerController(path).record()
        if rec is None:
            continue
        here = PortController(registry(), rec.port, rec.host)
        if is_live(rec):
            current = here.record()
            if current is not None and is_live(current) and current.pgid != rec.pgid:
                said.append(f"{path}: {rec.describe()} left where it is: the host-wide registry already names "
                            f"{current.describe()} on that port")
                continue
            if current is None or current.pgid != rec.pgid:
                portlock.write_shared(here.record_path, asdict(rec))
            said.append(f"{rec.describe()}: its record moved from {path} to the host-wide {here.record_path}")
        else:
            said.append(f"{path}: dropped the record of {rec.describe()}, which is gone")
        try:
            path.unlink()
        except OSError as exc:
            said.append(f"{path}: cannot remove it ({exc.strerror}); the host-wide record is the one used")
    for line in said:
        say(line)
    return said


def guard(profile: Profile, force: bool = False) -> None:
    """Refuse to touch the port's server while another process's run holds the port, or while a run
    that still lives owns the server there (the operator may insist with force). The run's own stages
    hold the lock and own their servers themselves, and pass."""
    if force:
        return
    holder = portlock.holder(profile)
    if holder is not None:
        raise PortHeld(holder, profile.server.port)
    ctl = controller(profile)
    rec = ctl.record()
    if rec is not None and rec.run and rec.owner_pid != os.getpid() and rec.owner_alive() and is_live(rec):
        owner = {"pid": rec.owner_pid, "run": rec.run, "user": procs.user_of(rec.owner_pid)}
        raise PortHeld(owner, profile.server.port, (
            f"{rec.describe()} belongs to run {rec.run} (pid {rec.owner_pid}, user {owner['user']}), still "
            f"running: not touched; wait for it, stop it, or pass --force"))


def controller(profile: Profile) -> PortController:
    try:
        migrate(profile)
    except (OSError, portlock.PortTaken) as exc:  # the host-wide records are still read
        log.warning("%s: the records there were not moved: %s", legacy_registry(profile), exc)
    return PortController(registry(writable=False), profile.server.port, profile.server.host, profile)


def orphan_text(rec: ServerRecord) -> str:
    """A server whose owner is gone, named for the operator."""
    return f"{rec.describe()}, left by a run whose process is gone"


def writes_into(pid: int | None, run_root: str) -> bool:
    """Whether the process's output goes into `run_root`'s logs: a server that run started (each server's
    stdout is its `logs/server-*.log`), whatever became of its record."""
    if not pid or not run_root:
        return False
    try:
        out = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except OSError:
        return False
    return out.is_relative_to(Path(run_root) / "logs")


def stop_server_on_port(profile: Profile, say: Say, force: bool = False, *, expect: int | None = None,
                        by: str = "", own_run: str = "") -> dict | None:
    """Stop whatever vLLM serves the profile's port. Returns what was stopped. A vLLM that no record names
    is stopped only with `force` or when `expect` names its pid (the operator was asked, naming it); a
    non-vLLM process on the port is an error: it is not ours to stop. `expect`: the pid the operator was
    told of — another server there now is refused, not stopped. `by`: the command, for the run it hits."""
    guard(profile, force)
    ctl = controller(profile)
    status = ctl.status()
    if status["state"] == "unrecorded":
        if status["pid"] is None:
            raise ServerError(f"port {profile.server.port} is in use by {status['argv']} (another user's?): "
                              f"not stopped")
        if not status["vllm"]:
            raise ServerError(f"port {profile.server.port} is in use by {listener_text(status)}, which is not vLLM")
        mine = writes_into(status["pid"], own_run)
        if not force and expect != status["pid"] and not mine:
            raise Unrecorded(status, profile.server.port)
        if mine:  # this run's own server, its record lost (a kill at the wrong moment): it is ours to stop
            say(f"port {profile.server.port}: pid {status['pid']} writes into this run's logs but no record names "
                f"it: adopted and stopped as the run's own")
        ctl.adopt(profile.server.host, profile.server.port)
        status = ctl.status()
    if status["state"] == "none":
        return None
    if expect is not None and status.get("pid") != expect:
        raise ServerError(f"port {profile.server.port} is now served by pid {status.get('pid')}, not pid {expect} "
                          f"as asked: nothing stopped")
    rec = ctl.record()
    whose = f" ({orphan_text(rec)})" if rec and rec.run and not rec.owner_alive() else ""
    say(f"stopping {status['mode']} server pid {status['pid']} (processes {status.get('pids')}, user "
        f"{status.get('user')}) on port {profile.server.port}{whose}")
    return ctl.stop(grace=profile.server.shutdown_grace, by=by)


def stop_servers_on_ports(profiles: list[Profile], say: Say, own_run: str = "") -> None:
    """stop_server_on_port on each; one that cannot be stopped does not keep the others running (the first error
    is raised once all were tried)."""
    errors = []
    for p in profiles:
        try:
            stop_server_on_port(p, say, own_run=own_run)
        except ServerError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def start_mode(profile: Profile, mode: str, target_dir: Path, *, log_path: Path, say: Say,
               on_wait=lambda s: None, force: bool = False, owner: str = "", expect: int | None = None,
               by: str = "", restart: bool = False, **mode_args) -> ServerRecord:
    """Serve `mode` on the port: reuse the running server if it is exactly this command and healthy
    (unless `restart`), else stop what is there (stop_server_on_port: `expect`, `by`) and start it. `owner`: the
    run whose stages own it ("" = the operator)."""
    guard(profile, force)
    argv = vllm_modes.server_argv(profile, mode, target_dir, **mode_args)
    ctl = controller(profile)
    rec, status = ctl.record(), ctl.status()
    # another user's server is never taken over: this user could not stop it when the run ends
    if (not restart and rec is not None and rec.argv == procs.redact_argv(argv) and status.get("healthy")
            and (ctl.source is None or ctl.source.stat().st_uid == os.getuid() or os.getuid() == 0)):
        say(f"reusing the running {mode} server pid {rec.pid}")
        # this process (or, owner "", the operator) owns it now, as `mode`: an orphan's owner was dead, and a
        # run's baseline of production's argv handed on as production is no longer that run's to stop
        return ctl.claim(owner, mode)
    env = vllm_modes.server_env(profile, mode)  # before anything is stopped: it may refuse (a key)
    stop_server_on_port(profile, say, force, expect=expect, by=by, own_run=owner)
    say(f"starting {mode} server: {' '.join(procs.redact_argv(argv))}")
    return ctl.start(argv, host=vllm_modes.bind_host(profile, mode), port=profile.server.port, mode=mode,
                     log=log_path, env=env,
                     health_timeout=profile.server.health_timeout, on_wait=on_wait, run=owner)


def start_production(profile: Profile, run, target_dir: Path, say: Say, **mode_args) -> ServerRecord:
    """The operator's production started again by a run (the handover, or a failed run putting back what it
    stopped): owner "", so that no cleanup of the run ever stops it; its log in the run's."""
    return start_mode(profile, "production", target_dir, log_path=run.log_path("server-production"), say=say,
                      owner="", **mode_args)


def adopt(profile: Profile, force: bool = False):
    guard(profile, force)
    ctl = controller(profile)
    if (rec := ctl.record()) is not None and is_live(rec):
        raise ServerError(f"{rec.describe()} is already recorded (user {ctl.user()}): nothing to adopt")
    return ctl.adopt(profile.server.host, profile.server.port, mode="production")


def run_records(profile: Profile, run_root: Path) -> list[tuple[Path, ServerRecord]]:
    """The record files naming servers that the run owns, on any port, in the host-wide registry."""
    try:
        migrate(profile)
    except (OSError, portlock.PortTaken) as exc:
        log.warning("%s: the records there were not moved: %s", legacy_registry(profile), exc)
    found = []
    for path in sorted(registry(writable=False).glob("port-*.u*.json")):
        rec = ServerController(path).record()
        if rec is not None and rec.run == str(run_root):
            found.append((path, rec))
    return found


def run_servers(profile: Profile, run_root: Path) -> list[tuple[Profile, ServerRecord]]:
    """Every server the run owns, on any port (its serving port and the side-by-side ones), as recorded."""
    return [(profile.with_port(rec.port), rec) for _, rec in run_records(profile, run_root)]


def stop_run_servers(profile: Profile, run_root: Path, say: Say,
                     keep: Callable[[ServerRecord], bool] = lambda rec: False) -> list[ServerRecord]:
    """Stop every server the run owns (by process group), except those `keep` names. Returns the stopped."""
    stopped, errors = [], []
    for path, rec in run_records(profile, run_root):
        if keep(rec):
            continue
        if procs.group_members(rec.pgid):
            say(f"stopping {rec.describe()}")
        try:
            ServerController(path).stop(grace=profile.server.shutdown_grace)  # this record, whoever's the port
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
    from pipeline.data.target import resolve_layer_ids

    if profile.target.source == "demo" and run is None:
        raise ValueError("a demo target lives in a run: pass --run-dir RUN_DIR")
    target_dir = run.target_dir(profile) if run else Path(profile.target.model_path)
    if mode == "extraction":
        from pipeline.data.targetinfo import from_config
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


def start_server(profile: Profile, run, mode: str, *, say: Say, force: bool = False, expect: int | None = None,
                 by: str = "", restart: bool = False, draft: str | None = None,
                 storage: str | None = None) -> ServerRecord:
    """The operator's server start, the CLI's `server start` and the console's: `mode` on the profile's port
    from a run (its target, draft, hidden-state storage; its logs) or, with no run, from the
    profile and the paths given (logs under runs_dir/.servers); vLLM's caches are run.cache_dir's
    (vllm_modes.server_cache)."""
    target_dir, mode_args = mode_inputs(profile, run, mode, draft, storage)
    logs = run.logs_dir if run else Path(profile.run.runs_dir).resolve() / ".servers"
    return start_mode(profile, mode, target_dir, log_path=logs / f"server-{mode}.log", say=say,
                      force=force, expect=expect, by=by, restart=restart, **mode_args)
