"""What the console reads from a run's files: stage progress and an ETA that counts down."""
import json
import os

import pytest

from pipeline.layout.rundir import RunDir
from pipeline.layout.tail import LogTailer
from pipeline.profile import load_profile
from pipeline.run.runview import RunWatcher
from pipeline.stages import stage_names
from tests.conftest import TINY


def test_eta_counts_down_between_progress_reports(tmp_path):
    run = RunDir.create(load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs")}), tmp_path / "run")
    run.update_stage("train", status="running")
    events = [{"ts": "", "t": 1000.0, "stage": "train", "kind": "start"},
              {"ts": "", "t": 1100.0, "stage": "train", "kind": "progress", "done": 1, "total": 4, "unit": "epochs"}]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    now = [1100.0]
    watcher = RunWatcher(run, stage_names(), clock=lambda: now[0])

    def train():
        return next(s for s in watcher.poll().stages if s.name == "train")

    assert train().eta_s == 300.0  # 100 s per epoch, 3 epochs left
    now[0] = 1250.0
    assert train().eta_s == 150.0  # no report since: the estimate falls with the clock
    assert train().elapsed_s == 250.0
    now[0] = 1500.0
    assert train().eta_s == 0.0  # late, never negative


def test_the_snapshots_statuses_show_and_the_recorded_one_keeps_the_clocks(tmp_path):
    """The watcher shows a stage as the run's snapshot says it stands; its time and figures follow what was
    recorded: a stale stage keeps its seconds, an interrupted one stops at its last event and keeps its
    figures when no error was recorded."""
    run = RunDir.create(load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs")}), tmp_path / "run")
    run.update_stage("vocab", status="done", seconds=3.0, figures={"tau": 1.5})
    run.update_stage("train", status="running", error=None, earlier_seconds=10.0)
    events = [{"ts": "", "t": 1000.0, "stage": "train", "kind": "start"},
              {"ts": "", "t": 1100.0, "stage": "train", "kind": "progress", "done": 1, "total": 4, "unit": "epochs",
               "loss": 0.5}]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    now = [2000.0]
    watcher = RunWatcher(run, stage_names(), clock=lambda: now[0])
    for _ in range(2):
        rows = {s.name: s for s in watcher.poll({"vocab": "stale", "train": "interrupted"}).stages}
        assert (rows["vocab"].status, rows["vocab"].elapsed_s, rows["vocab"].fraction) == ("stale", 3.0, 1.0)
        assert rows["train"].status == "interrupted" and rows["train"].elapsed_s == 110.0
        assert rows["train"].eta_s is None and dict(rows["train"].figures) == {"loss": 0.5}
        now[0] += 500


# --- LogTailer: the console's view of a stage log ------------------------------------------------

def append(path, data: bytes):
    with open(path, "ab") as fh:
        fh.write(data)


def test_tailer_of_a_log_not_written_yet(tmp_path):
    log = tmp_path / "train.log"
    tail = LogTailer(log)
    assert tail.new_lines() == []
    log.write_bytes(b"first\n")
    assert tail.new_lines() == ["first"]


def test_tailer_returns_only_what_was_appended(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"a\nb\n")
    tail = LogTailer(log)
    assert tail.new_lines() == ["a", "b"]
    assert tail.new_lines() == []
    append(log, b"c\nd\n")
    assert tail.new_lines() == ["c", "d"]


def test_tailer_holds_a_partial_last_line_until_it_ends(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"done\nepoch 1: loss=0.")
    tail = LogTailer(log)
    assert tail.new_lines() == ["done"]
    assert tail.new_lines() == []
    append(log, b"25\n")
    assert tail.new_lines() == ["epoch 1: loss=0.25"]


def test_tailer_starts_over_when_the_log_is_truncated(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"old line one\nold line two\n")
    tail = LogTailer(log)
    assert len(tail.new_lines()) == 2
    log.write_bytes(b"new\n")  # truncated and rewritten, shorter than what was read
    assert tail.new_lines() == ["new"]


def test_tailer_starts_over_when_the_log_is_replaced(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"short\n")
    tail = LogTailer(log)
    assert tail.new_lines() == ["short"]
    fresh = tmp_path / "train.log.new"
    fresh.write_bytes(b"a new file, longer than the old one\nsecond\n")  # a size check alone would miss it
    os.replace(fresh, log)
    assert tail.new_lines() == ["a new file, longer than the old one", "second"]


def test_tailer_first_read_of_a_long_log_is_its_tail(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(b"line %03d\n" % i for i in range(100)))
    tail = LogTailer(log)
    lines = tail.new_lines(limit_bytes=90)  # the last 90 bytes: ten lines of 9
    assert lines == [f"line {i:03d}" for i in range(90, 100)]
    append(log, b"line 100\n")
    assert tail.new_lines(limit_bytes=90) == ["line 100"]


@pytest.mark.parametrize("raw,shown", [
    (b"\x1b[31mred\x1b[0m", "red"),
    (b"\x1b[1;32mINFO\x1b[0m loaded", "INFO loaded"),
    (b"\x1b[2K\x1b[1Gcleared", "cleared"),
    (b"\x1b[?25lcursor hidden\x1b[?25h", "cursor hidden"),
    (b"windows line end\r", "windows line end"),
    (b"plain, [brackets] and 100%", "plain, [brackets] and 100%"),
    ("unicode \u03c4 = 2.1 \u2714".encode(), "unicode \u03c4 = 2.1 \u2714"),
])
def test_tailer_strips_terminal_codes(tmp_path, raw, shown):
    log = tmp_path / "train.log"
    log.write_bytes(raw + b"\n")
    assert LogTailer(log).new_lines() == [shown]


def test_tailer_gets_past_a_line_longer_than_its_read_limit(tmp_path):
    log = tmp_path / "server.log"
    log.write_bytes(b"start\n")
    tail = LogTailer(log)
    assert tail.new_lines(limit_bytes=64) == ["start"]
    append(log, b"\r".join(b"progress %3d%%" % i for i in range(0, 101, 10)) + b"\nafter\n")  # ~150 bytes, one line
    seen = [line for _ in range(5) for line in tail.new_lines(limit_bytes=64)]
    assert "after" in seen, seen


def test_tailer_first_read_shows_no_fragment_of_a_line(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(b"line %03d\n" % i for i in range(100)))
    lines = LogTailer(log).new_lines(limit_bytes=95)  # 95 bytes: ten whole lines and the end of another
    assert lines == [f"line {i:03d}" for i in range(90, 100)], lines
