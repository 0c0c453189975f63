"""The serving port is the host's (issue 43 item 1): its lock and its servers' records live in one host-wide
place (portlock.runtime_dir), seen from every folder and every user. Two folders, two runs, one port; a
server another run owns is refused by name unless forced, and its run is told who stopped it; a vLLM that
no record names is shown and never stopped unnamed; the per-folder records of older versions move here;
two users where the machine allows. The servers are stand-ins (an HTTP server answering /health and
/v1/models in its own process group, whose argv reads as vLLM's): the ownership logic needs no model."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.host import portlock, procs
from pipeline.host.httpio import get as http_get
from pipeline.profile import load_profile
from pipeline.serving import ports
from pipeline.serving.server import ServerController, ServerRecord, death, is_live
from tests.helpers import ROOT, TINY, cli, free_port

STAND_IN = '''
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"id": "stand-in"}]}' if self.path == "/v1/models" else b"{}"
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch) -> Path:
    """An isolated host-wide registry for each test (the real one is every run's on this machine)."""
    where = tmp_path / "e3-runtime"
    monkeypatch.setenv(portlock.ENV, str(where))
    return where


def stand_in_argv(tmp_path: Path, port: int, python: str = sys.executable) -> list[str]:
    # the script's path makes its argv read as vLLM's API server (server.is_vllm), as an operator's vLLM would
    script = tmp_path / "vllm" / "entrypoints_openai_api_server.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(STAND_IN)
    os.chmod(script.parent, 0o755)
    os.chmod(script, 0o644)
    return [python, str(script), "--port", str(port)]


def start_stand_in(tmp_path: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(stand_in_argv(tmp_path, port), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while http_get(f"http://127.0.0.1:{port}/health", timeout=1)[0] != 200:
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not answer"
        time.sleep(0.1)
    return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def folder_profile(tmp_path: Path, name: str, port: int):
    """A profile whose runs live in its own working folder (`run.runs_dir`), all on the same port."""
    return load_profile(TINY, {"run.runs_dir": str(tmp_path / name / "runs"), "server.port": port,
                               "server.shutdown_grace": 5})


def profile_file(tmp_path: Path, name: str, port: int) -> Path:
    path = tmp_path / name / "profile.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'extends = "{TINY}"\n[run]\nruns_dir = "{tmp_path / name / "runs"}"\n'
                    f'[server]\nport = {port}\nshutdown_grace = 5\n')
    return path


def one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle3-console: error: ") and "Traceback" not in proc.stderr, \
        proc.stderr
    return lines[0]


HOLD = ("import sys, time; from pathlib import Path; from pipeline.host import portlock; "
        "from pipeline.profile import load_profile; "
        "p = load_profile(sys.argv[1]); h = portlock.hold(p, Path(sys.argv[2])); print('held', flush=True); "
        "time.sleep(300)")


def hold_port(profile_path: Path, run_root: Path) -> subprocess.Popen:
    """Another process's run holding the port, as a running job does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(profile_path), str(run_root)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_two_folders_two_runs_one_port_see_one_lock(tmp_path, registry):
    """Run B, started in folder B, holds port P: run A in folder A cannot take it, and folder A's preflight
    and server commands name run B — the bug was that each folder had its own lock of the same port."""
    port = free_port()
    a, b = profile_file(tmp_path, "A", port), profile_file(tmp_path, "B", port)
    holder = hold_port(b, tmp_path / "B" / "runs" / "runB")
    try:
        pa = folder_profile(tmp_path, "A", port)
        with pytest.raises(portlock.PortTaken, match=f"pid {holder.pid}, .*runB\\) of user "):
            portlock.hold(pa, tmp_path / "A" / "runs" / "runA")
        assert portlock.holder(pa)["run"] == str(tmp_path / "B" / "runs" / "runB")
        from pipeline.planning.preflight import port_findings
        [finding] = port_findings(pa)
        assert finding.severity == "block" and "runB" in finding.message
        line = one_line_error(cli("server", "stop", a), 1)
        assert f"pid {holder.pid}" in line and "runB" in line and "--force" in line
        status = cli("server", "status", a)
        assert status.returncode == 0 and "held by run" in status.stdout and "runB" in status.stdout
    finally:
        holder.kill()
        holder.wait()
    assert portlock.holder(folder_profile(tmp_path, "A", port)) is None  # the lock went with its process
    lock = portlock.hold(folder_profile(tmp_path, "A", port), tmp_path / "A" / "runs" / "runA")
    lock.close()
    mode = stat.S_IMODE(registry.stat().st_mode)
    assert mode == 0o1777, oct(mode)  # every user creates, none changes another's files


def test_the_wall_clock_moving_does_not_make_a_live_process_dead(tmp_path, registry, monkeypatch):
    """psutil adds /proc/stat's btime, recomputed from the wall clock at every read, to a process's start: a
    clock moved on CI (twice, the second time past a 2-s tolerance), and the run's own port lock read as held by
    a gone process ("its holder file is gone"), failing real runs in the middle of their matrix. Processes are
    known by their start in ticks since boot now: with the clock an hour off either way, this process's lock
    is its own, another run's lock names that run, a recorded server is still live and its owner alive; a
    process that is really gone, or another start, still is not the one recorded."""
    import psutil._pslinux as linux
    port = free_port()
    p = folder_profile(tmp_path, "A", port)
    mine = portlock.hold(p, tmp_path / "A" / "runs" / "runA")
    b = profile_file(tmp_path, "B", free_port())
    other = hold_port(b, tmp_path / "B" / "runs" / "runB")
    server = start_stand_in(tmp_path, free_port())
    try:
        recorded = procs.identity(other.pid)
        assert recorded["start"], "no start mark on Linux"
        rec = ServerRecord(pid=server.pid, pgid=server.pid, host="127.0.0.1", port=1, mode="baseline", argv=[],
                           log="", started=psutil.Process(server.pid).create_time(), owner_pid=other.pid,
                           owner_since=recorded["since"], owner_start=recorded["start"],
                           start=procs.start_mark(server.pid))
        real = linux.boot_time
        for shift in (3600.0, -3600.0):
            monkeypatch.setattr(linux, "boot_time", lambda s=shift: real() + s)
            assert portlock.holder(p) is None  # this process's own lock
            ports.guard(p)
            assert portlock.holder(load_profile(b))["pid"] == other.pid  # another run's: named
            assert procs.is_process(other.pid, recorded["since"], recorded["start"])
            assert rec.owner_alive() and is_live(rec)
        boot, _, ticks = recorded["start"].partition(":")
        assert not procs.is_process(other.pid, recorded["since"], f"{boot}:{int(ticks) + 1}")  # another start
        assert not procs.is_process(other.pid, recorded["since"], f"another-boot:{ticks}")
        assert not procs.is_process(other.pid, psutil.Process(other.pid).create_time() - 60)  # no mark: by time
        assert not procs.is_process(other.pid, "not a time") and not procs.is_process("x", 0)
    finally:
        mine.close()
        kill(server)
        other.kill()
        other.wait()
    assert not procs.is_process(other.pid, recorded["since"], recorded["start"])
    assert not procs.is_process(other.pid, time.time())


def test_a_server_another_run_owns_is_refused_by_name_and_its_run_told_who_stopped_it(tmp_path):
    """Run B owns the stand-in server on P (its process lives). `server stop` in folder A is refused naming
    run B; with --force it stops it, and run B's report of its server's death names the command, not
    "exited with 0"."""
    port = free_port()
    a = profile_file(tmp_path, "A", port)
    pb = folder_profile(tmp_path, "B", port)
    owner = subprocess.Popen(["sleep", "300"])  # run B's process
    server = start_stand_in(tmp_path, port)
    try:
        rec = ServerRecord(pid=server.pid, pgid=server.pid, host="127.0.0.1", port=port, mode="baseline",
                           argv=stand_in_argv(tmp_path, port), log="", started=psutil.Process(server.pid).create_time(),
                           run=str(tmp_path / "B" / "runs" / "runB"), owner_pid=owner.pid,
                           owner_since=psutil.Process(owner.pid).create_time())
        ports.controller(pb)._save(rec)
        line = one_line_error(cli("server", "stop", a), 1)
        assert "runB" in line and f"pid {owner.pid}" in line and "--force" in line
        assert server.poll() is None  # refused: nothing stopped
        status = json.loads(cli("server", "status", a, "--json").stdout)  # folder A sees run B's server
        assert status["state"] == "running" and status["pid"] == server.pid and status["run"].endswith("runB")
        forced = cli("server", "stop", a, "--force")
        assert forced.returncode == 0 and "stopped" in forced.stdout, forced.stderr
        assert server.wait(10) is not None
        said = death(rec, wait=1)
        assert said is not None and said.startswith("was stopped by `eagle3-console server stop` (pid ")
        assert f"user {procs.user_of(os.getpid())}" in said and "exited with" not in said
    finally:
        kill(server)
        owner.kill()
        owner.wait()


def test_a_vllm_no_record_names_is_shown_and_stopped_only_when_named(tmp_path):
    port = free_port()
    a, b = profile_file(tmp_path, "A", port), profile_file(tmp_path, "B", port)
    server = start_stand_in(tmp_path, port)
    try:
        shown = cli("server", "status", b)
        assert shown.returncode == 0 and "state=unrecorded" in shown.stdout and f"pid={server.pid}" in shown.stdout
        assert "entrypoints_openai_api_server.py" in shown.stdout and "user=" in shown.stdout
        line = one_line_error(cli("server", "stop", a), 1)
        assert f"pid {server.pid}" in line and "no record names" in line and "api_server" in line
        assert server.poll() is None
        with pytest.raises(ports.Unrecorded, match=f"pid {server.pid} .*not stopped"):
            # the consent named another pid
            ports.stop_server_on_port(folder_profile(tmp_path, "A", port), print, expect=1)
        assert server.poll() is None
        stopped = ports.stop_server_on_port(folder_profile(tmp_path, "A", port), lambda m: None, expect=server.pid)
        assert stopped["stopped"] and server.wait(10) is not None
    finally:
        kill(server)


def test_a_folders_old_record_of_a_live_server_moves_host_wide(tmp_path, registry):
    """A record an older version left in runs/.servers/ is moved when that folder's command reads it (said),
    so another folder sees the server; a dead one is dropped."""
    port, gone = free_port(), free_port()
    a, b = profile_file(tmp_path, "A", port), profile_file(tmp_path, "B", port)
    server = start_stand_in(tmp_path, port)
    try:
        old = tmp_path / "A" / "runs" / ".servers"
        old.mkdir(parents=True)
        live = ServerRecord(pid=server.pid, pgid=server.pid, host="127.0.0.1", port=port, mode="production",
                            argv=["vllm"], log="", started=psutil.Process(server.pid).create_time())
        ServerController(old / f"port-{port}.json")._save(live)
        dead = ServerRecord(pid=999999, pgid=999999, host="127.0.0.1", port=gone, mode="baseline", argv=["vllm"],
                            log="", started=1.0)
        ServerController(old / f"port-{gone}.json")._save(dead)
        moved = cli("server", "status", a)
        assert moved.returncode == 0 and "state=running" in moved.stdout, moved.stdout + moved.stderr
        assert "its record moved from" in moved.stderr and "dropped the record" in moved.stderr
        assert not list(old.glob("port-*.json"))
        record = registry / f"port-{port}.u{os.getuid()}.json"
        assert json.loads(record.read_text())["pid"] == server.pid
        assert stat.S_IMODE(record.stat().st_mode) == 0o644
        elsewhere = json.loads(cli("server", "status", b, "--json").stdout)
        assert elsewhere["state"] == "running" and elsewhere["pid"] == server.pid and elsewhere["mode"] == "production"
    finally:
        kill(server)


def test_a_registry_that_is_a_link_is_refused_in_one_line(tmp_path, registry, monkeypatch):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "linked"
    link.symlink_to(target)
    monkeypatch.setenv(portlock.ENV, str(link))
    line = one_line_error(cli("server", "stop", profile_file(tmp_path, "A", free_port())), 1)
    assert str(link) in line and "is a link" in line


# ---- two users: the records of one are seen, not changed, by the other

def _make_user(name: str) -> int:
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   capture_output=True, check=False)
    import pwd
    return pwd.getpwnam(name).pw_uid


def as_user(uid: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv], cwd=ROOT,
                          text=True, capture_output=True, timeout=120, **kw)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv")
                    or not os.access("/usr/bin/python3", os.X_OK), reason="two users need root, useradd, setpriv "
                                                                          "and /usr/bin/python3")
def test_two_users_see_each_others_port_and_cannot_change_or_stop_it(tmp_path, monkeypatch):
    shared = Path(f"/tmp/e3-two-users-{os.getpid()}")  # noqa: S108 - every user must reach it
    shared.mkdir()
    os.chmod(shared, 0o777)  # the registry inside is created by the first user's command
    try:
        alice, bob = _make_user("e3test-alice"), _make_user("e3test-bob")
        registry = shared / "registry"  # created by the first user's command, sticky
        monkeypatch.setenv(portlock.ENV, str(registry))
        port = free_port()
        prof = {}
        for name in ("A", "B"):
            folder = shared / name
            folder.mkdir()
            os.chmod(folder, 0o777)
            prof[name] = profile_file(shared, name, port)
            os.chmod(prof[name], 0o644)
        # the stand-in on the system's interpreter: another user may not reach this venv's (under /root)
        argv = stand_in_argv(shared, port, "/usr/bin/python3")
        env = {**os.environ, "HOME": str(shared)}
        start = ("import sys; from pathlib import Path; from pipeline.serving import ports; "
                 "from pipeline.profile import load_profile; p = load_profile(sys.argv[1]); "
                 f"rec = ports.controller(p).start({argv!r}, host='127.0.0.1', port={port}, mode='production', "
                 f"log=Path({str(shared / 'A' / 'server.log')!r}), health_timeout=30); print(rec.pid)")
        started = as_user(alice, [sys.executable, "-c", start, str(prof["A"])], env=env)
        assert started.returncode == 0, started.stderr
        pid = int(started.stdout.split()[-1])
        try:
            assert stat.S_IMODE(registry.stat().st_mode) == 0o1777
            record = registry / f"port-{port}.u{alice}.json"
            assert record.stat().st_uid == alice and stat.S_IMODE(record.stat().st_mode) == 0o644
            seen = as_user(bob, [sys.executable, "-m", "pipeline", "server", "status", str(prof["B"]), "--json"],
                           env=env)
            assert seen.returncode == 0, seen.stderr
            status = json.loads(seen.stdout)
            assert status["state"] == "running" and status["pid"] == pid and status["user"] == "e3test-alice"
            stop = as_user(bob, [sys.executable, "-m", "pipeline", "server", "stop", str(prof["B"])], env=env)
            assert stop.returncode == 1 and len(stop.stderr.strip().splitlines()) == 1, stop.stderr
            assert "runs as user e3test-alice" in stop.stderr and "e3test-bob may not signal" in stop.stderr
            assert psutil.pid_exists(pid)
            change = as_user(bob, [sys.executable, "-c", f"open({str(record)!r}, 'w')"], env=env)
            unlink = as_user(bob, [sys.executable, "-c", f"import os; os.unlink({str(record)!r})"], env=env)
            assert change.returncode != 0 and unlink.returncode != 0 and record.exists()  # seen, not changed
            # bob's run on the port is refused naming alice's run holding it
            held = subprocess.Popen(["setpriv", f"--reuid={alice}", f"--regid={alice}", "--clear-groups",
                                     sys.executable, "-c", HOLD, str(prof["A"]), "/runs/alices"], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert held.stdout.readline().strip() == "held"
                taken = as_user(bob, [sys.executable, "-c", HOLD, str(prof["B"]), "/runs/bobs"], env=env)
                assert taken.returncode != 0 and "/runs/alices) of user e3test-alice" in taken.stderr, taken.stderr
            finally:
                held.kill()
                held.wait()
        finally:
            procs.stop_group(pid, grace=2) if procs.group_members(pid) else None
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_server_writing_into_a_runs_logs_is_that_runs_own(tmp_path):
    """A run's server whose record was lost (a kill between two of its steps) is still known as the run's: its
    output goes into the run's logs/ (ports.stop_server_on_port stops it for that run instead of calling it a
    stranger)."""
    import subprocess
    import sys

    from pipeline.serving import ports
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    with open(run / "logs" / "server-x.log", "wb") as out:
        mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=out)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.DEVNULL)
    try:
        assert ports.writes_into(mine.pid, str(run))
        assert not ports.writes_into(other.pid, str(run))
        assert not ports.writes_into(mine.pid, str(tmp_path / "another-run"))
        assert not ports.writes_into(mine.pid, "") and not ports.writes_into(None, str(run))
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_a_server_whose_port_another_answers_for_is_not_healthy(tmp_path):
    """A server left on the port (its run killed between starting it and recording it) answers /health while
    the one just started fails to bind: the start must fail naming the other, not measure through it."""
    from pipeline.serving.server import ServerError
    port = free_port()
    orphan = start_stand_in(tmp_path, port)
    second = subprocess.Popen(stand_in_argv(tmp_path, port), start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        rec = ServerRecord(pid=second.pid, pgid=second.pid, host="127.0.0.1", port=port, mode="speculative",
                           argv=[], log="", started=time.time())
        with pytest.raises(ServerError, match=rf"held by pid {orphan.pid} .*answered in its place"):
            ServerController(tmp_path / "second.json").wait_healthy(rec, second, 30)
    finally:
        kill(second)
        kill(orphan)
