"""What the console reads from a run's files: stage progress and an ETA that counts down."""
import json

from pipeline.profile import load_profile
from pipeline.rundir import RunDir
from pipeline.runview import RunWatcher
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
