"""Process groups: every child the pipeline starts gets its own session; it is stopped as a group."""
from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import psutil

from pipeline.compat import vllm_errors
from pipeline.host.waiting import wait_until

# psutil (7.x, Linux) gives a process's start as its ticks since boot plus /proc/stat's btime, which the kernel
# recomputes from the wall clock at every read (psutil #2541, #2544): a clock stepped or slewed moves every
# process's recorded start. A run's own port lock read as held by a dead process that way on CI, twice (the second
# time past a 2-s tolerance). So a process is known by what no clock moves: the boot's id and its start in clock
# ticks since boot (/proc/PID/stat field 22, what psutil itself uses to tell processes apart). The epoch start
# is kept beside it for people and for systems without /proc, where it is compared within SAME_START_S.
SAME_START_S = 2.0
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def start_mark(pid: int | None = None) -> str:
    """`pid`'s (default: this process's) start as "BOOT_ID:TICKS", unmoved by any clock change; "" where
    /proc cannot tell (another system, a gone process)."""
    try:
        stat = Path(f"/proc/{os.getpid() if pid is None else int(pid)}/stat").read_text()
        ticks = stat.rsplit(")", 1)[1].split()[19]  # after the command's name, which may hold spaces: field 22
        return f"{_BOOT_ID.read_text().strip()}:{int(ticks)}"
    except (OSError, ValueError, TypeError, IndexError):
        return ""


def identity(pid: int | None = None) -> dict:
    """What a record keeps to know a process again: pid, start (epoch seconds, for people) and start mark."""
    proc = psutil.Process(pid)
    return {"pid": proc.pid, "since": proc.create_time(), "start": start_mark(proc.pid)}


def is_process(pid, since, start: str = "") -> bool:
    """Whether `pid` is still the process recorded as started at `since` (epoch seconds) with start mark
    `start` (exact where both sides have one; an older record without one is compared by `since`): a reused
    pid, a gone process or a bad record is False."""
    if start and (now := start_mark(pid)):
        return now == start
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(since)) <= SAME_START_S
    except (psutil.Error, ValueError, TypeError, OverflowError):
        return False


def born_near(mark: str, pids: list[int], before_s: float, after_s: float) -> bool | None:
    """Whether one of `pids` started between `before_s` seconds before and `after_s` after the process of
    start mark `mark`, in clock ticks since the same boot; None where marks cannot tell (no mark, no /proc)."""
    boot, _, ticks = mark.partition(":")
    if not ticks:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        other_boot, _, other = start_mark(pid).partition(":")
        if other and other_boot == boot and -before_s * hz <= int(other) - int(ticks) <= after_s * hz:
            return True
    return False


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group, each with its `info` (status, create_time). A zombie
    holds nothing and, in a container whose init does not reap, may never go away, so it does not count."""
    members = []
    for proc in psutil.process_iter(["pid", "status", "create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def stop_group(pgid: int, grace: float = 30.0) -> bool:
    """SIGTERM the group, wait up to `grace` s, SIGKILL what is left; True if it had to SIGKILL."""
    for sig, wait, step in ((signal.SIGTERM, grace, 0.2), (signal.SIGKILL, 10, 0.1)):
        if sig == signal.SIGKILL and not group_members(pgid):
            return False
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        wait_until(lambda: not group_members(pgid), wait, step)
    return True


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_deferred():
    """Hold the stop signals back (main thread) while a child is started and recorded: a signal between
    the two would leave a child in its own session that no record names, so no cleanup could find it.
    Held by a handler that notes them, handed to the handlers in place when the block ends; not by the
    signal mask, which a child inherits through fork and exec: every child started under it ran with
    SIGHUP, SIGINT and SIGTERM blocked, a trainer's group SIGKILLed after the whole grace of every stop."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    # an ignored signal stays ignored (nohup's SIGHUP): nothing to hold, and a child keeps ignoring it, as it did
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in STOP_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


# The gate a child is started through (spawn_gated): it waits on a pipe for one byte, then becomes the command
# (exec: same pid, same start mark, the command's own argv from then on); end of file instead of the byte (the
# parent died before it said go) and it exits without running anything. Its stdin then is /dev/null.
# The gate is the system shell, not this interpreter: a server may be started by another user (the
# host-wide registry lets two operators share a box) who cannot reach a venv under /root. Its only
# script is this fixed text; the server's argv reaches it as positional arguments, never as shell text.
_GATE = ["/bin/sh", "-c", 'IFS= read -r go; exec </dev/null; if [ "$go" = g ]; then exec "$@"; fi', "e3-gate"]


class Gated:
    """A child held at its gate (spawn_gated): `go()` lets it run, `drop()` lets it exit unrun."""

    def __init__(self, proc, write_fd: int):
        self.proc, self._fd = proc, write_fd

    def _say(self, what: bytes) -> None:
        if self._fd < 0:
            return
        try:
            if what:
                os.write(self._fd, what)
        finally:
            os.close(self._fd)
            self._fd = -1

    def go(self) -> None:
        self._say(b"g")

    def drop(self) -> None:
        self._say(b"")


def spawn_gated(cmd: list[str], **popen_kw) -> Gated:
    """`cmd` started in a session of its own but held before it runs, so that its record can be written first:
    SIGKILL cannot be deferred, and a run killed between starting a server and recording it left a vLLM that
    no record named — the resume then started a second one on the same port (vLLM binds with SO_REUSEPORT:
    both served it) and waited for it forever. Killed before `go()`, this process leaves a child that exits
    at once having run nothing (its gate reads end of file)."""
    import subprocess

    r, w = os.pipe()  # both not inheritable: only the gate's stdin (a dup of r) reaches the child
    try:
        proc = subprocess.Popen([*_GATE, *cmd], stdin=r, start_new_session=True, **popen_kw)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return Gated(proc, w)


def run_logged(cmd: list[str], log_path, *, env: dict, cwd=None, on_line=lambda line: None,
               on_start=lambda proc: None) -> int:
    """Run `cmd` in its own session, appending its output to `log_path` and handing each line to
    `on_line`; `on_start` records it before any stop signal is let through. If this process is
    interrupted, the child's whole group is stopped."""
    import subprocess

    with open(log_path, "a", buffering=1) as log_fh:
        with stop_signals_deferred():
            gated = spawn_gated(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
            proc = gated.proc
            try:
                on_start(proc)
            except BaseException:
                gated.drop()
                stop_group(proc.pid)
                raise
            gated.go()
        try:
            for line in proc.stdout:
                log_fh.write(line)
                on_line(line)
            return proc.wait()
        except BaseException:
            stop_group(proc.pid)
            raise


def read_log(log: Path, since: int = 0) -> str | None:
    """The text of a log from byte `since` on (one server instance's part of a shared log); None
    when there is no log."""
    try:
        with open(log, "rb") as fh:
            fh.seek(since)
            return fh.read().decode(errors="replace")
    except FileNotFoundError:
        return None


def last_error_line(log: Path, tail: int = 200, since: int = 0) -> str:
    """The line of a log that best says why a child failed: its last error line (with the indented
    detail line after it, as pydantic prints the actual reason there), else its last line. `since`:
    read only what this instance wrote (every start appends to the same log)."""
    text = read_log(log, since)
    return "no log" if text is None else last_error_text(text, tail)


_LOG_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN)\b[ :]")


def error_line(text: str, tail: int = 200) -> str | None:
    """The last error line of text (with the indented detail line after it), None when it has none.
    A traceback's frame and code lines (indented) are not it, nor vLLM's "See root cause above" wrapper:
    the root cause is the exception line above (compat/vllm_errors.py)."""
    lines = [line.rstrip() for line in text.splitlines()[-tail:] if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        own = vllm_errors.without_prefix(lines[i])
        line = own.strip()
        if own[:1].isspace() or _LOG_LEVEL.search(line) or vllm_errors.is_wrapper(line):
            continue  # a frame or code line; an INFO/WARNING line that mentions an error; a pointer
        if any(w in line for w in ("Error:", "Error(", "Exception:", "error:")):
            after = vllm_errors.without_prefix(lines[i + 1]) if i + 1 < len(lines) else ""
            if after[:1].isspace() and not after.strip().startswith(("File ", "raise ", "^")):
                line = f"{line}: {after.strip()}"
            # vLLM's process prefix kept in front: which process failed is worth saying
            prefix = vllm_errors.PROCESS_PREFIX.match(lines[i].strip())
            return ((prefix.group(0) if prefix else "") + line)[:400]
    return None


def last_error_text(text: str, tail: int = 200) -> str:
    """last_error_line of text already in hand (a child's captured stderr)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return error_line(text, tail) or (lines[-1][-400:] if lines else "empty log")


SECRET_FLAG_WORDS = ("key", "token", "secret", "password", "passwd", "credential")


def redact_argv(argv: list[str]) -> list[str]:
    """argv as it may be stored or shown: the value of any flag naming a secret (`--api-key X`,
    `--hf-token=X`) replaced by ***. Every argv written to a file or a message goes through here."""
    out, hide_next = [], False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        secret = flag.startswith("-") and any(w in flag.lower() for w in SECRET_FLAG_WORDS)
        out.append("***" if hide_next else f"{flag}=***" if secret and eq else arg)
        hide_next = secret and not eq and not hide_next  # the flag's value is the next arg
    return out


def shown_cmdline(proc, width: int = 120) -> str:
    """A process's command line for a message: redacted, cut to `width`."""
    try:
        return " ".join(redact_argv(proc.cmdline()))[:width]
    except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours to read
        return "?"


def user_of(pid: int) -> str:
    """The user a process runs as, for a message ("?" when it is gone)."""
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):  # KeyError: a uid without a passwd entry
        try:
            return f"uid {psutil.Process(pid).uids().real}"
        except psutil.Error:
            return "?"


def repo_on_path(pythonpath: str | None) -> str:
    """A PYTHONPATH with this repository first: children import pipeline.training from it."""
    return str(Path(__file__).resolve().parents[2]) + (os.pathsep + pythonpath if pythonpath else "")


def child_env(cache_root: Path) -> dict:
    """Environment for the speculators subprocesses of a run: offline, unbuffered, uncoloured,
    caches inside the run, and this repository importable (the trainer's launcher lives here)."""
    return {"HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
            "TRITON_CACHE_DIR": str(cache_root / "triton"), **os.environ,  # defaults the environment may change
            "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "PYTHONPATH": repo_on_path(os.environ.get("PYTHONPATH"))}
