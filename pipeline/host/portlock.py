"""One run at a time per serving port, host-wide. A port is the host's, not a folder's: the lock of port N
and the records of the servers on it live in one place for every folder and every user of the tool
(runtime_dir), so that two runs started from two folders cannot both believe they own port 8765.

A run holds an exclusive flock on `port-N.lock` there while its stages run; the kernel drops it when the
holder dies (a SIGKILLed run resumes freely). Who holds it is written beside it, in a file of the holder's
own user (`port-N.run.u<UID>.json`): in a sticky shared directory a user can create files but not change or
remove another user's, so no file is ever written by two users — each user writes its own and readers
merge them."""
from __future__ import annotations

import fcntl
import json
import os
import pwd
import stat
from pathlib import Path

from pipeline.host import procs
from pipeline.profile import Profile

ENV = "EAGLE3_CONSOLE_RUNTIME_DIR"  # an isolated registry (tests; a user who wants their own)
# Where an administrator may provide it (systemd-tmpfiles: `d /run/eagle3-console 1777 root root -`):
# /run is never aged by the tmp cleaner, so a record of a production server running for weeks survives.
SYSTEM_DIR = Path("/run/eagle3-console")
# Else the one place every user can create: a fixed path (not $TMPDIR, which differs per user) under /tmp.
SHARED_DIR = Path("/tmp/eagle3-console")  # noqa: S108 - shared on purpose, made sticky below
# Like /tmp itself: everyone creates files, only a file's owner (or root) changes or removes it.
SHARED_MODE = 0o1777
FILE_MODE = 0o644  # others read (see who holds a port, which server runs), cannot change


class PortTaken(RuntimeError):
    pass


class RegistryUnusable(PortTaken):
    """The host-wide directory cannot hold this user's records (not a directory, a link, not writable):
    no port can be taken safely, so it is a PortTaken for every caller."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid {uid}"


def runtime_dir(writable: bool = True) -> Path:
    """The host-wide directory of port locks and server records, created sticky and world-writable (like
    /tmp) when missing. `writable` = False: reading only (a status), so a directory this user cannot
    write in is still read."""
    path = Path(os.environ.get(ENV) or (SYSTEM_DIR if SYSTEM_DIR.is_dir() else SHARED_DIR))
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RegistryUnusable(f"{path}: cannot create the host-wide server registry: {exc.strerror} "
                               f"(set {ENV} to a directory this user can write)") from None
    else:
        os.chmod(path, SHARED_MODE)  # mkdir's mode is cut by the umask; a shared directory must not be
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        # a link could send every user's records (and the locks they trust) wherever its maker chose
        what = "a link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise RegistryUnusable(f"{path}: the host-wide server registry is {what}; remove it or set {ENV}")
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise RegistryUnusable(f"{path}: the host-wide server registry is not writable by user "
                               f"{user_name(os.getuid())} (owner {user_name(info.st_uid)}, mode "
                               f"{stat.S_IMODE(info.st_mode):o}): its owner can `chmod 1777 {path}`, or set {ENV}")
    return path


def write_shared(path: Path, obj) -> None:
    """Write JSON crash-safely (temp file, fsync, rename) and readable by every user: atomicio's mkstemp
    makes 0600 files, which would hide a record from the other users it is for. The temp name carries
    uid and pid, and O_EXCL | O_NOFOLLOW refuses a file or link someone else put there."""
    tmp = path.with_name(f".{path.name}.{os.getuid()}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # past the umask
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(obj, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def lock_path(profile: Profile) -> Path:
    return runtime_dir() / f"port-{profile.server.port}.lock"


def legacy_lock_path(profile: Profile) -> Path:
    """Where versions before the host-wide registry kept the lock: the working folder's runs/."""
    return Path(profile.run.runs_dir).resolve() / ".servers" / f"port-{profile.server.port}.lock"


def _holder_files(port: int) -> list[Path]:
    return sorted(runtime_dir(writable=False).glob(f"port-{port}.run.u*.json"))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _named_holder(port: int) -> dict:
    """Who holds the port's lock, from the holders' own files: the newest whose process lives (a holder
    that died leaves its file behind; its lock went with it)."""
    live = [h for h in map(_read_json, _holder_files(port))
            if procs.is_process(h.get("pid"), h.get("since"), h.get("start", ""))]
    return max(live, key=lambda h: h.get("since", 0)) if live else {}


def _open_lock(path: Path) -> int:
    """The lock file, created 0644 by the first user; another user's opens read-only (flock does not
    need write access, and that user has no business changing it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    if os.fstat(fd).st_uid == os.getuid():
        os.fchmod(fd, FILE_MODE)  # past the umask: others must open it to see it held
    return fd


class Held:
    """A held port lock: close() releases it and takes this holder's name down."""

    def __init__(self, fd: int, named: Path, port: int):
        self.fd, self.named, self.port = fd, named, port
        _HELD[port] = self

    def close(self) -> None:
        if self.fd < 0:
            return
        _HELD.pop(self.port, None)
        if _read_json(self.named).get("pid") == os.getpid():
            self.named.unlink(missing_ok=True)
        os.close(self.fd)  # the lock goes with the descriptor
        self.fd = -1

    def fileno(self) -> int:
        return self.fd


# The ports this process holds: it knows its own lock without asking the files (a holder file another
# process removed, or a process start misread, must never turn a run against its own lock).
_HELD: dict[int, Held] = {}


def _taken(port: int, other: dict) -> PortTaken:
    who = f" of user {other['user']}" if other.get("user") else ""
    return PortTaken(f"port {port} belongs to another run in progress (pid {other.get('pid', '?')}, "
                     f"{other.get('run', '?')}){who}: one run at a time per serving port")


def hold(profile: Profile, run_root: Path) -> Held:
    """Take the port's host-wide lock for this process (kept until the returned Held is closed or the
    process ends); PortTaken names the run that holds it, from whichever folder or user it runs."""
    port = profile.server.port
    if (old := _legacy_holder(profile)) is not None:  # a run of an older version of the tool in this folder
        raise _taken(port, old)
    path = lock_path(profile)
    try:
        fd = _open_lock(path)
    except OSError as exc:
        raise RegistryUnusable(f"{path}: cannot open the port's lock: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _taken(port, _named_holder(port)) from None
    named = path.with_name(f"port-{port}.run.u{os.getuid()}.json")
    try:
        write_shared(named, {**procs.identity(), "run": str(run_root), "user": user_name(os.getuid())})
    except OSError as exc:
        os.close(fd)
        raise RegistryUnusable(f"{named}: cannot name this run as the port's holder: {exc.strerror}") from None
    return Held(fd, named, port)


def _try_lock(path: Path) -> bool | None:
    """Whether another open file holds the flock of `path` (True), it is free (False), or no file (None)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it too, when it was taken here
    return False


def _legacy_holder(profile: Profile) -> dict | None:
    """A run of an older version holding the lock in the folder's runs/.servers/ (its file names it)."""
    path = legacy_lock_path(profile)
    if not _try_lock(path):
        return None
    other = _read_json(path)
    return None if other.get("pid") == os.getpid() else other


def holder(profile: Profile) -> dict | None:
    """The run holding the port's lock, if another process holds it; None when free or held by us."""
    if profile.server.port in _HELD:
        return None
    path = runtime_dir(writable=False) / f"port-{profile.server.port}.lock"
    if _try_lock(path):
        other = _named_holder(profile.server.port)
        if other.get("pid") != os.getpid():
            return other or {"pid": "?", "run": "? (its holder file is gone)"}
        return None
    return _legacy_holder(profile)
