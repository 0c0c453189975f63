"""vLLM server control: start from an argv list in its own session with a pid file and a log file,
wait for health, stop by process group (SIGTERM, grace, SIGKILL, verify nothing is left), adopt a
server this tool did not start. vLLM's EngineCore does not notice its API server dying
(docs/reference.md §2.3), so stopping is always by group, never by pid."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from pipeline.host import portlock, procs
from pipeline.host.httpio import get as http_get
from pipeline.host.procs import last_error_line
from pipeline.host.waiting import wait_until
from pipeline.layout import atomicio

# Set by the runner when the run is told to stop: a server start waiting for health gives up at once
# (its server is stopped), so that an interrupted run never waits minutes for a server it will not use.
STOPPING = threading.Event()
# The servers this process started, by pid: their exit status (a signal, an exit code) once they die.
_CHILDREN: dict[int, subprocess.Popen] = {}


class ServerError(RuntimeError):
    """One line: what went wrong and, when the server said why, its own reason. `tail` holds the last
    lines of the server log for whoever shows the error."""

    def __init__(self, message: str, tail: list[str] | None = None):
        super().__init__(message)
        self.tail = tail or []


WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}


@dataclass(frozen=True)
class ServerRecord:
    pid: int
    pgid: int
    host: str
    port: int
    mode: str
    argv: list[str]
    log: str
    started: float
    adopted: bool = False
    log_offset: int = 0  # where this instance's part of the (shared, appended) log begins
    run: str = ""  # the run that owns it (its stages start and stop it); "" = the operator's
    owner_pid: int = 0  # the process that started it, with its start time (a dead owner leaves an orphan)
    owner_since: float = 0.0
    owner_start: str = ""  # the owner's start mark (procs.start_mark; "" in records older than it)
    start: str = ""  # the server's own (its first process's) start mark

    def owner_alive(self) -> bool:
        return procs.is_process(self.owner_pid, self.owner_since, self.owner_start)

    def describe(self) -> str:
        """The server in a message: mode, pid, port and who owns it."""
        whose = f", run {self.run}" if self.run else ""
        return f"the {self.mode} vLLM server (pid {self.pid}, port {self.port}{whose})"

    @property
    def base_url(self) -> str:
        """Where this machine reaches the server: a wildcard bind is reached on loopback."""
        return f"http://{WILDCARD_HOSTS.get(self.host, self.host)}:{self.port}"

    def reason(self) -> str:
        """The server's own last error line, from this instance's part of its log."""
        return last_error_line(Path(self.log), since=self.log_offset) if self.log else "no log (adopted server)"

    def tail(self) -> list[str]:
        """The last 8 lines of this instance's part of its log."""
        text = procs.read_log(Path(self.log), self.log_offset) if self.log else None
        return [line.rstrip() for line in (text or "").splitlines() if line.strip()][-8:]


BORN_WITHIN_S = 3600.0  # a server's processes (API server, engine cores, workers) start within this of it


def _started_with(rec: ServerRecord, group: list[psutil.Process]) -> bool:
    """Whether the process group is still the recorded server's: one of its processes was born when the
    server started (a group id reused after a reboot names processes born much later). By the start marks
    where the record has one (no clock moves them), else by the epoch times."""
    if (near := procs.born_near(rec.start, [p.pid for p in group], 5, BORN_WITHIN_S)) is not None:
        return near
    return any(rec.started - 5 <= (p.info["create_time"] or 0) <= rec.started + BORN_WITHIN_S for p in group)


def is_live(rec: ServerRecord) -> bool:
    """Whether the recorded server still runs: its process group lives and is still that server's."""
    group = procs.group_members(rec.pgid)
    return bool(group) and _started_with(rec, group)


def exit_status(pid: int, wait: float = 0.0) -> str | None:
    """How a server this process started ended ("killed by SIGKILL", "exited with 1"); None while it
    runs or when another process started it (its status is not ours to read). `wait`: seconds to wait for
    the status of one that is seen dying — a process whose main thread has ended shows as a zombie while
    its other threads still exit (vLLM has dozens; seconds on a loaded machine), and the kernel gives its
    status only once the last one has."""
    proc = _CHILDREN.get(pid)
    code = proc.poll() if proc is not None else None
    if code is None and proc is not None and wait > 0:
        try:
            code = proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None
    if code is None:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


STATUS_WAIT_S = 15.0  # a dying server's threads all exited (see exit_status) on a loaded 2-core machine

STOPPED_BY_KEPT_S = 7 * 86400  # a stop is told to the run it hit; older ones are cleared by their writer


def _stopped_by_path(rec: ServerRecord, uid: int | None = None) -> Path:
    # one file per server and per stopping user: a user never has to change another's file
    return portlock.runtime_dir(writable=uid is None or uid == os.getuid()) / \
        f"stopped-{rec.pgid}.u{os.getuid() if uid is None else uid}.json"


def note_stopped_by(rec: ServerRecord, by: str) -> Path | None:
    """Say, before signalling it, that `by` (a command of this tool) stops the server: the run that owns it
    notices its death within a moment and must be able to tell the operator who did it, not "exited with
    0". Returns the file (removed again when the stop fails); None when it cannot be written."""
    me = psutil.Process()
    path = _stopped_by_path(rec)
    try:
        for old in path.parent.glob(f"stopped-*.u{os.getuid()}.json"):
            if time.time() - old.stat().st_mtime > STOPPED_BY_KEPT_S:
                old.unlink(missing_ok=True)
        portlock.write_shared(path, {"pid": rec.pid, "pgid": rec.pgid, "started": rec.started, "by": by,
                                     "by_pid": me.pid, "by_user": portlock.user_name(os.getuid()),
                                     "at": time.time()})
    except (OSError, portlock.PortTaken):
        return None  # the stop itself goes on; its owner then reports only how the server ended
    return path


def stopped_by(rec: ServerRecord) -> str | None:
    """Who stopped this server, if a command of this tool did: "`eagle3-console server stop` (pid N, user U)"."""
    try:
        paths = list(portlock.runtime_dir(writable=False).glob(f"stopped-{rec.pgid}.u*.json"))
    except (OSError, portlock.PortTaken):
        return None
    for path in paths:
        try:
            said = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if said.get("pid") == rec.pid and said.get("started") == rec.started:  # this server, not a reused pid
            return f"`{said.get('by')}` (pid {said.get('by_pid')}, user {said.get('by_user')})"
    return None


def _api_server_gone(rec: ServerRecord) -> bool:
    if exit_status(rec.pid) is not None:
        return True
    try:
        return psutil.Process(rec.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def death(rec: ServerRecord, wait: float = 5.0) -> str | None:
    """If the server is dead (its API server gone: vLLM's engine core can outlive it, docs/reference.md
    §2.3), what it died of — the signal or exit code, and its own last error line; None while it serves.
    A client sees a reset connection a moment before the process is gone: allow `wait` seconds."""
    def gone_or_serving() -> str | None:
        if _api_server_gone(rec):
            return "gone"
        return "serving" if http_get(f"{rec.base_url}/health", timeout=1)[0] == 200 else None
    if wait_until(gone_or_serving, wait) != "gone":
        return None
    if (by := stopped_by(rec)) is not None:  # not a crash: a command of this tool stopped it
        return f"was stopped by {by}"
    text = procs.read_log(Path(rec.log), rec.log_offset) if rec.log else None
    said = procs.error_line(text) if text else None
    how = exit_status(rec.pid, wait=STATUS_WAIT_S)
    how = (f"was {how}" if how.startswith("killed") else how) if how else \
        (f"is gone (its exit status not given within {STATUS_WAIT_S:.0f} s)" if rec.pid in _CHILDREN else
         "is gone (not started by this process: its exit status is unknown)")
    return how + (f"; its last error: {said}" if said else "; no error in its log")


def explain_failure(rec: ServerRecord, client: str) -> str:
    """A client's failure against a server we run, told from the server's side when it has something
    to say: it died (how, and its own last error), or it logged an error since it started. Else the client's."""
    where = f" (log: {rec.log})" if rec.log else ""
    if (died := death(rec)) is not None:
        return f"{rec.describe()} {died}{where}"
    text = procs.read_log(Path(rec.log), rec.log_offset) if rec.log else None
    said = procs.error_line(text) if text else None
    return f"{client}; vLLM ({rec.mode}) logged: {said}{where}" if said else client


def port_listeners(host: str, port: int) -> list[psutil.Process]:
    """Every process listening on the port that this user can see. More than one is possible: vLLM binds with
    SO_REUSEPORT, so a second vLLM started on a port that a first one is still starting on binds too."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(conn.pid))
    return found


def port_owner(host: str, port: int) -> psutil.Process | None:
    listeners = port_listeners(host, port)
    return listeners[0] if listeners else None


def _listeners_by_group(rec: ServerRecord) -> tuple[bool, psutil.Process | None]:
    """Whether a process of the server's own group listens on its port, and the first listener of another
    group (None: only its own, or listeners this user cannot see)."""
    own, other = False, None
    for proc in port_listeners(rec.host, rec.port):
        try:
            mine = os.getpgid(proc.pid) == rec.pgid
        except OSError:
            continue
        own = own or mine
        other = other or (None if mine else proc)
    return own, other


def answered_by_another(rec: ServerRecord) -> psutil.Process | None:
    """A process listening on the server's port that is not of the server's own process group, else None
    (only its own, or listeners this user cannot see)."""
    return _listeners_by_group(rec)[1]


def listens_itself(rec: ServerRecord) -> bool:
    """Whether a process of the server's own group listens on its port."""
    return _listeners_by_group(rec)[0]


def port_in_use(host: str, port: int) -> bool:
    # the family the host is written in: an IPv6 host ("::", "::1") does not bind an AF_INET socket at all
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_vllm(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "vllm" in cmd and ("api_server" in cmd or " serve" in cmd or "VLLM::" in cmd)


class ServerController:
    """One controller per record file (e.g. RUN_DIR/server/server.json)."""

    def __init__(self, record_path: Path):
        self.record_path = Path(record_path)

    # ---- record
    def record(self) -> ServerRecord | None:
        try:
            return ServerRecord(**json.loads(self.record_path.read_text()))
        except (OSError, ValueError, TypeError):  # missing, unreadable or not a record
            return None

    def _save(self, rec: ServerRecord | None) -> None:
        if rec is None:
            self.record_path.unlink(missing_ok=True)
        else:
            atomicio.atomic_write_json(self.record_path, asdict(rec))

    # ---- start
    def start(self, argv: list[str], *, host: str, port: int, mode: str, log: Path, env: dict | None = None,
              health_timeout: float = 600.0, on_wait=lambda seconds: None, run: str = "") -> ServerRecord:
        current = self.record()
        if current and procs.group_members(current.pgid):
            raise ServerError(f"a {current.mode} server is already running (pid {current.pid}, port "
                              f"{current.port}); stop it first")
        if port_in_use(host, port):
            owner = port_owner(host, port)
            who = f" by pid {owner.pid} ({procs.shown_cmdline(owner)})" if owner else ""
            raise ServerError(f"port {port} on {host} is already in use{who}")
        if STOPPING.is_set():
            raise ServerError(f"vLLM ({mode}) not started: the run is stopping")
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        me = procs.identity()
        with open(log, "ab") as fh, procs.stop_signals_deferred():  # started and recorded, or neither
            offset = fh.tell()
            fh.write(f"\n=== eagle3-console: starting {mode} server: {' '.join(procs.redact_argv(argv))}\n".encode())
            fh.flush()
            # held at its gate until its record is written: killed in between, this process leaves no server
            gated = procs.spawn_gated(argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
            proc = gated.proc
            _CHILDREN[proc.pid] = proc
            try:
                rec = ServerRecord(pid=proc.pid, pgid=proc.pid, host=host, port=port, mode=mode,
                                   argv=procs.redact_argv(argv), log=str(log), started=time.time(),
                                   log_offset=offset, run=run, owner_pid=me["pid"], owner_since=me["since"],
                                   owner_start=me["start"], start=procs.start_mark(proc.pid))
                self._save(rec)
            except BaseException:
                gated.drop()
                raise
            gated.go()
        try:
            self.wait_healthy(rec, proc, health_timeout, on_wait)
        except BaseException:
            self.stop(grace=10)
            raise
        return rec

    def wait_healthy(self, rec: ServerRecord, proc: subprocess.Popen | None, timeout: float,
                     on_wait=lambda seconds: None) -> None:
        t0 = time.monotonic()
        other = None
        while True:
            code, _ = http_get(f"{rec.base_url}/health", timeout=2)
            if code == 200 and http_get(f"{rec.base_url}/v1/models", timeout=5)[0] in (200, 401):
                # 401: an API key guards /v1. Healthy only if it is this server that answers: a server left on
                # the port (a run killed between starting one and recording it) would answer in its place
                # while this one fails to bind
                if (other := answered_by_another(rec)) is None:
                    return
            exited = proc.poll() if proc is not None else (None if procs.group_members(rec.pgid) else -1)
            if exited is None and other is not None and listens_itself(rec):
                raise ServerError(f"vLLM ({rec.mode}): port {rec.port} is served by two servers at once, this one "
                                  f"(pid {rec.pid}) and pid {other.pid} ({procs.shown_cmdline(other, 200)}), which "
                                  f"started on it while this one did (vLLM binds with SO_REUSEPORT); stop that one "
                                  f"(log: {rec.log})", rec.tail())
            if exited is not None and other is not None:
                raise ServerError(f"vLLM ({rec.mode}) exited: port {rec.port} is held by pid {other.pid} "
                                  f"({procs.shown_cmdline(other, 200)}), which answered in its place "
                                  f"(log: {rec.log})", rec.tail())
            if exited is not None:
                if (by := stopped_by(rec)) is not None:
                    raise ServerError(f"vLLM ({rec.mode}) was stopped by {by} before becoming healthy "
                                      f"(log: {rec.log})", rec.tail())
                how = exit_status(rec.pid) or f"exited with {exited}"
                text = procs.read_log(Path(rec.log), rec.log_offset) if rec.log else None
                # killed from outside, its last line says nothing: only an error line of its own is a reason
                said = (procs.error_line(text) if text else None) if how.startswith("killed") else rec.reason()
                raise ServerError(f"vLLM ({rec.mode}) {how} before becoming healthy: "
                                  f"{said or 'no error in its log'} (log: {rec.log})", rec.tail())
            if STOPPING.is_set():
                raise ServerError(f"vLLM ({rec.mode}) start abandoned: the run is stopping")
            waited = time.monotonic() - t0
            if waited > timeout:
                raise ServerError(f"vLLM ({rec.mode}) not healthy after {timeout:.0f}s: "
                                  f"{rec.reason()} (log: {rec.log})", rec.tail())
            on_wait(waited)
            time.sleep(1.0)

    # ---- stop
    def stop(self, grace: float = 30.0, by: str = "") -> dict:
        """`by`: the command stopping it (recorded for the run that owns the server, see note_stopped_by)."""
        rec = self.record()
        if rec is None:
            return {"stopped": False, "reason": "no server recorded"}
        group = procs.group_members(rec.pgid)
        if group and not _started_with(rec, group):
            # The record outlived its server (a reboot, a container restart) and the group id now names
            # processes born long after it: never signal them, only forget the record.
            self._save(None)
            return {"stopped": False, "mode": rec.mode,
                    "reason": f"process group {rec.pgid} is no longer the recorded server: record dropped"}
        members = [p.pid for p in group]
        said = note_stopped_by(rec, by) if by and members else None
        try:
            killed = procs.stop_group(rec.pgid, grace) if members else False
        except PermissionError:
            if said:
                said.unlink(missing_ok=True)
            raise ServerError(f"{rec.describe()} runs as user {procs.user_of(rec.pid)}: user "
                              f"{portlock.user_name(os.getuid())} may not signal process group {rec.pgid} "
                              f"(operation not permitted); stop it as that user or root") from None
        if left := [p.pid for p in procs.group_members(rec.pgid)]:
            raise ServerError(f"processes {left} of server group {rec.pgid} survived SIGKILL")
        gpu_left = self._gpu_memory_held(members)
        self._save(None)
        if gpu_left:
            raise ServerError(f"server stopped but GPU memory is still held by pids {sorted(gpu_left)}")
        return {"stopped": bool(members), "pids": members, "sigkill": killed, "mode": rec.mode,
                "gpu_checked": gpu_left is not None}

    @staticmethod
    def _gpu_memory_held(pids: list[int], wait: float = 10.0) -> dict[int, int] | None:
        """Where NVML exists: which of the stopped pids still hold GPU memory (the driver frees it
        shortly after exit, so allow a few seconds). None when there is no NVML."""
        from pipeline.host import gpu

        def left() -> tuple[dict[int, int] | None, bool]:  # (what is held, whether to stop asking)
            held = gpu.gpu_memory_by_pid()
            still = None if held is None else {pid: b for pid, b in held.items() if pid in pids}
            return still, not still
        return wait_until(left, wait, 0.5)[0]

    def claim(self, run: str, mode: str | None = None) -> ServerRecord:
        """A running server taken over by `run` ("" = the operator's: no run stops it when done), reused as it
        is, now recorded as `mode` (a run's baseline of the same argv becomes production)."""
        rec = self.record()
        if rec is None:
            raise ServerError(f"no server recorded in {self.record_path}")
        me = procs.identity()
        rec = replace(rec, run=run, mode=mode or rec.mode, owner_pid=me["pid"], owner_since=me["since"],
                      owner_start=me["start"])
        self._save(rec)
        return rec

    # ---- status / adopt
    def status(self) -> dict:
        rec = self.record()
        if rec is None:
            return {"state": "none"}
        alive = procs.group_members(rec.pgid)
        code, _ = http_get(f"{rec.base_url}/health", timeout=2) if alive else (0, "")
        return {"state": "running" if alive else "dead", "healthy": code == 200, "mode": rec.mode,
                "pid": rec.pid, "pgid": rec.pgid, "port": rec.port, "host": rec.host,
                "pids": [p.pid for p in alive], "uptime_s": round(time.time() - rec.started, 1) if alive else 0,
                "adopted": rec.adopted, "log": rec.log, "run": rec.run}

    def adopt(self, host: str, port: int, mode: str = "adopted") -> ServerRecord:
        """Take over a vLLM server found listening on `port` (checked to be vLLM)."""
        owner = port_owner(host, port)
        if owner is None:
            raise ServerError(f"nothing is listening on port {port}")
        if not is_vllm(owner):
            raise ServerError(f"port {port} belongs to pid {owner.pid} ({procs.shown_cmdline(owner)}), "
                              f"which is not a vLLM server")
        pgid = os.getpgid(owner.pid)
        family = {owner.pid} | {c.pid for c in owner.children(recursive=True)}
        if strangers := [p.pid for p in procs.group_members(pgid) if p.pid not in family]:
            # Stopping by group would hit them too (e.g. the shell script that launched vLLM).
            raise ServerError(f"vLLM pid {owner.pid} shares process group {pgid} with other processes "
                              f"{strangers[:5]}; stop it where it was started")
        rec = ServerRecord(pid=owner.pid, pgid=pgid, host=host, port=port, mode=mode,
                           argv=procs.redact_argv(owner.cmdline()), log="", started=owner.create_time(),
                           adopted=True, start=procs.start_mark(owner.pid))
        self._save(rec)
        return rec
