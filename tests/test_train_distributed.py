"""The train stage through torchrun with two real processes on CPU (gloo): data parallel halves the
steps per epoch, both ranks join one process group, and the checkpoint is written once."""
import json
import re
import shutil

from pipeline.layout.rundir import RunDir
from pipeline.run.runner import run_stages
from tests.helpers import copy_run_dir


def test_two_process_ddp_train_on_cpu(finished_run, tmp_path):
    run_dir = tmp_path / "ddp"
    copy_run_dir(finished_run, run_dir, train={"nproc_per_node": 2, "epochs": 1})
    shutil.rmtree(run_dir / "checkpoints")
    run = RunDir.open(run_dir)
    single = RunDir.open(finished_run).stage_state("train")["figures"]
    run_stages(run, start="train", until="train")

    log = run.log_path("train").read_text()
    assert "--standalone --nproc-per-node=2" in log
    assert "rank 0 of 2" in log and "rank 1 of 2" in log  # one gloo group, two ranks
    figures = run.stage_state("train")["figures"]
    assert figures["checkpoint"].endswith("/0")
    # Each step takes one packed row per rank: two ranks cover an epoch in about half the steps.
    per_epoch_single = single["logged_steps"] / single["epochs"]
    assert abs(figures["logged_steps"] - per_epoch_single / 2) <= 1, (figures["logged_steps"], per_epoch_single)
    assert json.loads((run_dir / "checkpoints" / "0" / "training_state.json").read_text())["epoch"] == 0
    assert not re.search(r"Traceback", log)
