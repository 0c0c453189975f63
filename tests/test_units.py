"""Fast unit tests, no servers and no pipeline run: stage selection, the output manifest that decides
what a resume skips, the process-group stop that cleans up after a killed run, and the quarantine of
half-written checkpoints."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from pipeline.host import procs
from pipeline.layout.checkpoints import epoch_complete, epoch_dirs, final_checkpoint, quarantine_incomplete
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.run.runner import RunnerError, manifest, outputs_intact, select
from pipeline.stages import stage_names
from pipeline.stages.base import StageError, stop_orphan_child
from tests.helpers import TINY, wait_for

ALL_STAGES = ["preflight", "build-target", "measure-production", "measure-existing", "regenerate", "prepare", "extract",
              "vocab", "train", "pick-checkpoint", "evaluate-offline", "deploy-measure", "handover"]


class Log:
    """The logger a stage gets, recording what it was told."""

    def __init__(self):
        self.lines = []

    def _add(self, level, msg, *args):
        self.lines.append((level, msg % args if args else msg))

    def info(self, msg, *args):
        self._add("info", msg, *args)

    def warning(self, msg, *args):
        self._add("warning", msg, *args)


# --- pipeline.run.runner.select ---------------------------------------------------------------

def test_every_stage_is_named_in_run_order():
    assert stage_names() == ALL_STAGES


@pytest.mark.parametrize("start,until,expected", [
    (None, None, ALL_STAGES),
    (None, "prepare", ["preflight", "build-target", "measure-production", "measure-existing", "regenerate", "prepare"]),
    ("extract", "train", ["preflight", "extract", "vocab", "train"]),  # preflight runs whatever --from says
    ("train", "train", ["preflight", "train"]),
    ("preflight", "preflight", ["preflight"]),
    ("preflight", "build-target", ["preflight", "build-target"]),
    ("handover", None, ["preflight", "handover"]),
    ("evaluate-offline", "deploy-measure", ["preflight", "evaluate-offline", "deploy-measure"]),
])
def test_select_ranges_keep_preflight(start, until, expected):
    profile = load_profile(TINY, {"evaluate.online": True, "evaluate.checkpoints": "each",  # every stage applies
                                  "evaluate.production_before_after": True, "server.after_run": "production",
                                  "evaluate.existing_head": "head"})
    assert [s.name for s in select(profile, start, until)] == expected


@pytest.mark.parametrize("overrides,start,expected", [
    ({}, None, ["preflight", "build-target", "regenerate", "prepare", "extract", "vocab", "train",
                "evaluate-offline"]),  # tiny: no online evaluation, nothing to hand over
    ({}, "deploy-measure", ["preflight"]),
    ({"data.regenerate": False}, "build-target", ["preflight", "build-target", "prepare", "extract", "vocab", "train",
                                                  "evaluate-offline"]),
])
def test_select_drops_stages_the_profile_skips(overrides, start, expected):
    assert [s.name for s in select(load_profile(TINY, overrides), start, None)] == expected


@pytest.mark.parametrize("start,until,message", [
    ("extrct", None, "--from 'extrct': unknown stage (stages: preflight, build-target,"),
    (None, "trian", "--until 'trian': unknown stage (stages: preflight, build-target,"),
    ("Train", None, "--from 'Train': unknown stage"),
    ("", "train", "--from '': unknown stage"),
    ("train", "extract", "--from train comes after --until extract"),
    ("handover", "preflight", "--from handover comes after --until preflight"),
])
def test_select_refuses_unknown_stages_and_reversed_ranges(start, until, message):
    with pytest.raises(RunnerError) as err:
        select(load_profile(TINY), start, until)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# --- pipeline.run.runner.manifest / outputs_intact --------------------------------------------

@pytest.fixture
def outputs(tmp_path):
    """A run directory with a stage's outputs: a directory tree, a file, and a file outside the run."""
    run = RunDir((tmp_path / "run").resolve())
    (run.root / "out" / "sub").mkdir(parents=True)
    (run.root / "out" / "a.bin").write_bytes(b"abc")
    (run.root / "out" / "sub" / "b.bin").write_bytes(b"12345")
    (run.root / "result.json").write_text('{"ok": true}')
    outside = tmp_path / "elsewhere" / "c.bin"
    outside.parent.mkdir()
    outside.write_bytes(b"x" * 7)
    # The directories' times set in the past: whatever the clock's granularity, a change made by a
    # test moves them to "now", with no sleep needed for them to differ.
    past = 1_000_000_000 * 10**9
    for d in (run.root / "out", run.root / "out" / "sub"):
        os.utime(d, ns=(past, past))
    return run, [run.root / "out", run.root / "result.json", outside]


def test_manifest_records_files_by_size_and_directories_by_digest(outputs):
    import hashlib
    run, paths = outputs
    listing = "out/a.bin\t3\nout/sub/b.bin\t5".replace("out/", "")
    recorded = manifest(run, paths)
    assert recorded["out"].pop("dirs_mtime_ns") == max(os.stat(d).st_mtime_ns for d in (paths[0], paths[0] / "sub"))
    assert recorded == {"out": {"files": 2, "bytes": 8, "sha256": hashlib.sha256(listing.encode()).hexdigest()},
                        "result.json": 12, str(paths[2]): 7}


@pytest.mark.parametrize("missing", ["no-such-file", "empty-dir"])
def test_manifest_refuses_a_missing_or_empty_output(outputs, missing):
    run, paths = outputs
    gone = run.root / missing
    if missing == "empty-dir":
        gone.mkdir()
    with pytest.raises(StageError, match=re.escape(f"expected output missing: {gone}")):
        manifest(run, [*paths, gone])


def _grow(p):
    with open(p, "ab") as fh:
        fh.write(b"more")


@pytest.mark.parametrize("change,intact", [
    (lambda run, outside: None, True),
    (lambda run, outside: _grow(run.root / "out" / "a.bin"), False),
    (lambda run, outside: (run.root / "out" / "sub" / "b.bin").write_bytes(b"1"), False),  # truncated
    (lambda run, outside: (run.root / "out" / "sub" / "b.bin").write_bytes(b""), False),  # emptied
    (lambda run, outside: (run.root / "result.json").unlink(), False),
    (lambda run, outside: outside.unlink(), False),
    (lambda run, outside: os.rename(run.root / "out", run.root / "out.old"), False),
    (lambda run, outside: (run.root / "out" / "extra.bin").write_bytes(b""), False),  # a file more
    (lambda run, outside: os.rename(run.root / "out" / "a.bin", run.root / "out" / "z.bin"), False),  # renamed
], ids=["untouched", "grown", "truncated", "emptied", "deleted", "deleted-outside-the-run", "directory-moved",
        "file-added", "file-renamed"])
def test_outputs_intact_notices_size_changes_and_deletions(outputs, change, intact):
    run, paths = outputs
    recorded = manifest(run, paths)
    change(run, paths[2])
    assert outputs_intact(run, recorded) is intact


@pytest.mark.parametrize("change", ["add", "remove", "rename"])
def test_the_quick_check_sees_files_come_and_go_without_a_stat_per_file(outputs, change):
    run, paths = outputs
    recorded = manifest(run, paths)
    assert outputs_intact(run, recorded, quick=True)
    sub = run.root / "out" / "sub"
    {"add": lambda: (sub / "new.bin").write_bytes(b""), "remove": lambda: (sub / "b.bin").unlink(),
     "rename": lambda: os.rename(sub / "b.bin", sub / "c.bin")}[change]()
    assert outputs_intact(run, recorded, quick=True) is False


def test_an_empty_record_is_never_intact(outputs):
    run, _ = outputs
    assert outputs_intact(run, {}) is False  # a stage that recorded nothing is redone, not skipped


# --- pipeline.host.procs: stopping a process group --------------------------------------------

# A group leader that starts one child (ignoring SIGTERM or not), reports the child's pid once the
# child's handler is in place, then sleeps: the shape of a trainer or a vLLM server and its workers.
LEADER = r"""
import subprocess, sys, time
ignore = sys.argv[1] == "ignore-term"
code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore else "")
        + "print('ready', flush=True)\ntime.sleep(600)\n")
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def process_group(child_mode="die-on-term"):
    leader = subprocess.Popen([sys.executable, "-c", LEADER, child_mode], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    started = [psutil.Process(leader.pid)]
    try:
        line = leader.stdout.readline().strip()
        assert line.isdigit(), f"the group's leader did not start its child: {line!r}"
        started.append(psutil.Process(int(line)))
        yield leader, started[1]
    finally:
        for p in started:  # whatever a failed test left: only the processes started here, by pid
            with contextlib.suppress(psutil.Error):
                p.kill()
        leader.wait(timeout=30)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_group_members_are_the_live_processes_of_the_group():
    with process_group() as (leader, child):
        pids = {p.pid for p in procs.group_members(leader.pid)}
        assert pids == {leader.pid, child.pid} and os.getpid() not in pids
        os.kill(leader.pid, signal.SIGKILL)  # not reaped yet: a zombie, which holds nothing
        wait_for(lambda: psutil.Process(leader.pid).status() == psutil.STATUS_ZOMBIE, what="leader a zombie")
        assert [p.pid for p in procs.group_members(leader.pid)] == [child.pid]


@pytest.mark.parametrize("child_mode,needs_kill", [("die-on-term", False), ("ignore-term", True)])
def test_stop_group_terms_then_kills_what_is_left(child_mode, needs_kill):
    with process_group(child_mode) as (leader, child):
        t0 = time.monotonic()
        assert procs.stop_group(leader.pid, grace=1.0 if needs_kill else 60.0) is needs_kill
        if needs_kill:
            assert time.monotonic() - t0 >= 1.0  # the grace was given before SIGKILL
        assert procs.group_members(leader.pid) == []
        assert not alive(child)
        assert leader.wait(timeout=10) == -signal.SIGTERM  # the leader itself went at SIGTERM either way


def test_stop_group_of_a_gone_group_is_a_no_op():
    with process_group() as (leader, _):
        procs.stop_group(leader.pid)
        assert procs.stop_group(leader.pid, grace=0.1) is False


def _stage(entry):
    """What stop_orphan_child reads: the train stage's recorded state, a log."""
    return SimpleNamespace(run=SimpleNamespace(stage_state=lambda name: entry if name == "train" else {}), log=Log())


def _stop_orphan(ctx) -> None:
    stop_orphan_child(ctx.run, "train", ctx.log)


def test_orphan_trainer_left_by_a_killed_attempt_is_stopped():
    with process_group() as (leader, child):
        ctx = _stage({"child_pgid": leader.pid, "child_cmd": psutil.Process(leader.pid).cmdline()[:4]})
        _stop_orphan(ctx)
        assert procs.group_members(leader.pid) == [] and not alive(child)
        (line,) = ctx.log.lines
        assert line[0] == "warning" and f"train's child process group {leader.pid}" in line[1]
        assert "left by an earlier attempt" in line[1]


@pytest.mark.parametrize("entry", [
    lambda pid: {"child_pgid": pid, "child_cmd": ["/usr/bin/python3", "-m", "something.else"]},  # pid reused
    lambda pid: {},  # no trainer was ever started
], ids=["pid-reused-by-another-program", "never-started"])
def test_orphan_stop_leaves_other_processes_alone(entry):
    with process_group() as (leader, child):
        ctx = _stage(entry(leader.pid))
        _stop_orphan(ctx)
        assert {p.pid for p in procs.group_members(leader.pid)} == {leader.pid, child.pid}
        assert ctx.log.lines == []


# --- pipeline.stages.train: checkpoints a kill left half-written ---------------------------------

def epoch(save: Path, name: str, broken: str = "") -> Path:
    """An epoch directory as speculators writes it (weights, optimizer, then training_state.json), with
    one piece `broken` as a kill at that point of the save would leave it."""
    import torch
    from safetensors.torch import save_file

    d = save / name
    d.mkdir(parents=True)
    if broken != "no-weights":
        if broken == "torn-weights":
            (d / "model.safetensors").write_bytes(b"\x00" * 10)
        else:
            save_file({"fc.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    if broken != "no-optimizer":
        (d / "optimizer_state_dict.pt").write_bytes(b"optimizer")
    state = {"no-state": None, "torn-state": '{"epoch": ', "state-without-epoch": '{"step": 3}'}.get(
        broken, json.dumps({"epoch": int(name) if name.isdigit() else 0}))
    if state is not None:
        (d / "training_state.json").write_text(state)
    return d


@pytest.mark.parametrize("broken", ["", "no-weights", "torn-weights", "no-optimizer", "no-state", "torn-state",
                                    "state-without-epoch"])
def test_epoch_complete_needs_every_piece(tmp_path, broken):
    assert epoch_complete(epoch(tmp_path, "0", broken)) is (broken == "")


def test_quarantine_moves_only_incomplete_epoch_directories_aside(tmp_path):
    save = tmp_path / "checkpoints"
    for name, broken in (("0", ""), ("1", "no-state"), ("2", ""), ("9", "torn-weights"), ("10", ""),
                         ("interrupted", "no-state")):
        epoch(save, name, broken)
    (save / "epoch0_step5").symlink_to(save / "0")  # speculators' descriptive links are not epochs
    (save / "11").write_text("a file, not an epoch directory")
    log = Log()

    moved = quarantine_incomplete(save, log)
    assert moved == ["1", "9"]  # numeric order
    aside = sorted((save / "incomplete").iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["1", "9"]
    assert (aside[1] / "model.safetensors").read_bytes() == b"\x00" * 10  # moved, not deleted
    assert [p.name for p in epoch_dirs(save)] == ["0", "2", "10"]
    assert (save / "interrupted").is_dir() and (save / "epoch0_step5").is_symlink() and (save / "11").is_file()
    assert final_checkpoint(save) == save / "10"  # 10 after 9: numbers, not strings
    assert [level for level, _ in log.lines] == ["warning", "warning"]
    assert quarantine_incomplete(save, log) == []  # the quarantine itself is not an epoch


def test_quarantine_of_a_save_path_that_does_not_exist_yet(tmp_path):
    assert quarantine_incomplete(tmp_path / "checkpoints", Log()) == []
    assert final_checkpoint(tmp_path / "checkpoints") is None


# --- deploy-measure: servers side by side ----------------------------------------------------------------------

def _measure_context(tmp_path, port: int, start_together: int):
    import logging

    from pipeline.stages.base import StageContext
    profile = load_profile(TINY, overrides={"server.port": port, "evaluate.start_together": start_together,
                                            "run.runs_dir": str(tmp_path / "runs")})
    run = RunDir.create(profile, tmp_path / "run")
    return StageContext(run=run, profile=profile, log=logging.getLogger("test"))


def _held_elsewhere(tmp_path, port: int) -> bool:
    """Whether another process sees the port's run lock held (portlock.holder from a child)."""
    code = ("from pipeline.host import portlock; from pipeline.profile import load_profile; "
            f"p = load_profile({str(TINY)!r}, overrides={{'server.port': {port}, "
            f"'run.runs_dir': {str(tmp_path / 'runs')!r}}}); print(portlock.holder(p) is not None)")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1])
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip() == "True"


def test_side_by_side_servers_take_the_next_ports_and_their_locks(tmp_path):
    import contextlib

    from pipeline.stages.deploy_measure import side_by_side_ports
    from tests.conftest import free_port
    ctx = _measure_context(tmp_path, free_port(), 3)
    with contextlib.ExitStack() as stack:
        ports = [p.server.port for p in side_by_side_ports(ctx, 3, stack)]
        assert ports == [ctx.profile.server.port + i for i in range(3)]
        # another run of the box cannot take the extra ports while the measured servers live
        assert _held_elsewhere(tmp_path, ports[1]) and _held_elsewhere(tmp_path, ports[2])
    assert not _held_elsewhere(tmp_path, ports[2])  # released with the stage


def test_side_by_side_falls_back_to_one_at_a_time_when_a_port_is_taken(tmp_path):
    import contextlib
    import socket

    from pipeline.stages.deploy_measure import side_by_side_ports
    from tests.conftest import free_port
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ctx = _measure_context(tmp_path, taken - 1, 3)  # the second port is someone else's
        with contextlib.ExitStack() as stack:
            assert [p.server.port for p in side_by_side_ports(ctx, 3, stack)] == [taken - 1]
    ctx = _measure_context(tmp_path / "again", free_port(), 1)
    with contextlib.ExitStack() as stack:
        assert len(side_by_side_ports(ctx, 1, stack)) == 1


def test_a_side_by_side_start_lost_to_vllms_memory_profiling_is_started_again_alone(tmp_path, monkeypatch):
    """The race needs servers sharing a GPU (one H200: the n-gram server of three started together failed
    with "No available memory for the cache blocks"); here the starter stands in for the GPU, and what is
    asserted is the stage's handling: only those failures start again, once, and the notes say so."""
    from pipeline.report import notes
    from pipeline.stages import benchmark
    from tests.conftest import free_port
    ctx = _measure_context(tmp_path, free_port(), 3)
    calls = []
    monkeypatch.setattr(benchmark, "start_method",
                        lambda ctx, profile, method, **kw: calls.append(method) or ("lease", None))
    race = ("vLLM (ngram) exited with 1 before becoming healthy: (EngineCore pid=7) ValueError: No available "
            "memory for the cache blocks. Try increasing `gpu_memory_utilization`")
    assert benchmark.again_alone(ctx, "ngram", ctx.profile, {}, None, race) == ("lease", None)
    other = "vLLM (eagle3) exited with 1 before becoming healthy: (EngineCore pid=8) KeyError: 'draft_vocab_size'"
    assert benchmark.again_alone(ctx, "eagle3", ctx.profile, {}, None, other) == (None, other)
    assert benchmark.again_alone(ctx, "baseline", ctx.profile, {}, "up", None) == ("up", None)
    assert calls == ["ngram"]
    said = [n["text"] for n in notes.read(ctx.run)]
    assert any("ngram: its side-by-side start failed on vLLM's memory profiling" in t and "started again alone: up"
               in t for t in said), said


def test_tokens_per_step_counts_every_decode_step():
    from pipeline.stages.served import tokens_per_step
    # 2 requests × 11 tokens: 20 decoded after the prefills; 8 accepted drafts → 12 steps
    assert tokens_per_step({"output_tokens": 22}, 2, 8) == round(20 / 12, 4)
    assert tokens_per_step({"output_tokens": 22}, 2, 0) == 1.0


def test_only_near_ties_of_the_target_excuse_a_mismatch():
    from pipeline.stages.deploy_measure import numeric_ties
    found = [{"prompt": 0, "gap": 0.03}, {"prompt": 3, "gap": 1.7}, {"prompt": 5, "gap": None, "why": "refused"},
             {"prompt": 7, "gap": 0.1}]
    assert numeric_ties(found, 0.1) == [0, 7]  # a clear margin or an unanswered question stays a failure
    assert numeric_ties(found, 0.0) == []


def _build_tiny_target(cache: str) -> str:
    from pipeline.stages.build_target import build_target
    return str(build_target(load_profile(TINY).demo_target, Path(cache)))


@pytest.mark.integration  # two spawned processes build a demo target
def test_two_processes_building_the_same_target_share_one_result(tmp_path):
    """Two runs of one spec (two ports of a box) build side by side: one directory results, both use it,
    and a dead process's half-built leftover is removed."""
    import multiprocessing

    from pipeline.stages.build_target import cache_key
    key = cache_key(load_profile(TINY).demo_target)
    stale = tmp_path / f"demo-target-{key}.building-999999"  # no such process
    stale.mkdir()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        built = pool.map(_build_tiny_target, [str(tmp_path)] * 2)
    assert built[0] == built[1] == str(tmp_path / f"demo-target-{key}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"demo-target-{key}"]
    assert (tmp_path / f"demo-target-{key}" / "model.safetensors").is_file()


def test_the_data_wait_share_leaves_the_compile_step_out():
    from pipeline.stages.train import data_wait_share

    # the first logged step compiles (long, no wait); the others waited a quarter of their time for states
    assert data_wait_share([9000.0, 100.0, 300.0], [0.0, 25.0, 75.0]) == 0.25
    assert data_wait_share([80.0], [20.0]) == 0.25  # one step: it is all there is
    assert data_wait_share([], []) is None


def test_every_subcommand_dispatches_to_its_command():
    """main() runs the Command the subcommand NAME's parser names: a subcommand without one would fail only when
    typed, one named twice would run the wrong code."""
    import argparse

    from pipeline import cli
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) >= 10
    assert {n: p.get_default("command").name for n, p in sub.choices.items()} == {n: n for n in sub.choices}
    assert all(type(c).cmd is not cli.Command.cmd for c in cli.COMMANDS)


def test_wait_until_returns_the_first_truthy_answer_or_the_last_at_the_deadline():
    import time

    from pipeline.host.waiting import wait_until
    answers = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(answers), 5, 0.01) == 7  # asked until truthy, no longer
    asked = []
    t0 = time.monotonic()
    assert wait_until(lambda: asked.append(1) or {}, 0.3, 0.05) == {}  # the last falsy answer
    assert 0.25 <= time.monotonic() - t0 < 2 and len(asked) >= 3
    assert wait_until(lambda: asked.append(1) or None, 0, 1) is None and asked  # asked once with no time at all

    def exited():
        raise RuntimeError("it exited")
    with pytest.raises(RuntimeError, match="it exited"):
        wait_until(exited, 5)


def test_the_plain_progress_eta_is_the_counts_own_rate_not_the_stages_elapsed(monkeypatch):
    """deploy-measure's first prompt comes after a server's start: 1/16 at 44 s once read "ETA 11:03" for a
    row that ended 2 s later. The ETA is the count's own rate from its first report; the same count again (a
    round after the first) starts its rate anew."""
    import io

    from pipeline.run import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    show = progress.ProgressPrinter(out, tty=False)
    show({"stage": "deploy-measure", "kind": "start"})

    def report(t: float, done: int) -> str:
        now[0] = t
        show({"stage": "deploy-measure", "kind": "progress", "done": done, "total": 16, "unit": "prompts"})
        return out.getvalue().splitlines()[-1]

    assert report(44.0, 1).endswith("elapsed 0:44 ETA ? ")
    assert "ETA 0:05" in report(50.0, 9) and "ETA 0:00" in report(51.0, 16)  # 8 in 6 s, 7 to go; then done
    assert "ETA ?" in report(60.0, 1)  # the next round's count
