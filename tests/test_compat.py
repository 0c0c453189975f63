"""Fail loudly if a speculators release renames what the CPU compatibility layer adapts."""
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.compat import speculators_compat
from pipeline.training import node_sync


@pytest.mark.parametrize("module,attr", speculators_compat.ADAPTED + speculators_compat.ALWAYS_ADAPTED
                         + [node_sync.NODE_SYNC])
def test_adapted_names_still_exist(module, attr):
    assert hasattr(importlib.import_module(module), attr), f"{module}.{attr} is gone: update the compat layer"


def test_the_adapted_code_still_needs_adapting():
    trainer = importlib.import_module("speculators.train.trainer")
    # .to(self.local_rank) and the synchronising step timer are what break on a CPU.
    assert "self.local_rank" in inspect.getsource(trainer.Trainer.setup_model)
    assert "torch.accelerator.synchronize" in inspect.getsource(trainer._StepTimer)
    ckpt = importlib.import_module("speculators.train.checkpointer")
    assert "get_current_device()" in inspect.getsource(ckpt.SingleGPUCheckpointer.load_model_state_dict)


def test_adapt_on_cpu_and_not_on_gpu(monkeypatch):
    import torch
    trainer = importlib.import_module("speculators.train.trainer")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    original = trainer.get_local_rank
    assert speculators_compat.adapt() == []  # on an accelerator nothing is touched
    assert trainer.get_local_rank is original
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    ckpt = importlib.import_module("speculators.train.checkpointer")
    cli = importlib.import_module("speculators.train.cli")
    saved = (trainer.get_local_rank, ckpt.get_current_device, trainer._StepTimer.mark, trainer._StepTimer.now,
             cli.maybe_setup_distributed)
    try:
        assert len(speculators_compat.adapt()) == len(speculators_compat.ADAPTED)
        assert trainer.get_local_rank() == "cpu" and ckpt.get_current_device() == "cpu"
        timer = trainer._StepTimer(enabled=True)
        timer.mark("start")  # would raise "Cannot access accelerator device" unadapted
        assert timer.now() is not None
    finally:
        (trainer.get_local_rank, ckpt.get_current_device, trainer._StepTimer.mark, trainer._StepTimer.now,
         cli.maybe_setup_distributed) = saved


@pytest.mark.slow  # a fresh interpreter importing speculators' trainer (~9 s on 2 cores)
def test_trainer_metric_records_reach_the_stage_whole_at_full_precision(tmp_path):
    """speculators' metric logger as its CLI sets it up, in a trainer-like process of its own: the records
    the trainer logs come out as JSON lines (rank 0 only), the values unrounded, a non-mapping left out."""
    script = textwrap.dedent(f"""
        import logging, os, sys
        from pipeline.compat import speculators_compat as sc
        sc.forward_metric_records()
        from speculators.train import cli
        cli.setup_metric_logger(loggers=[], run_name="t", output_dir={str(tmp_path)!r})
        log = logging.getLogger(sc.METRICS_LOGGER)
        log.info({{"train": {{"loss_0": 0.123456789, "full_acc_1": 1e-07}}, "profile": {{"step_ms": 1740.25}},
                   "epoch": 2, "lr": 0.0003, "global_step": 40}}, extra={{"step": 40}})
        log.info("not a record")
        log.info({{"lr": 0.5, "epochs": 3}}, extra={{"hparams": True}})  # the configuration, not a metric
        os.environ["RANK"] = "1"
        log.info({{"val": {{"loss_epoch": 9.0}}, "epoch": 2}})
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    from pipeline.compat.speculators_compat import metrics_record
    records = [r for line in out.stdout.splitlines() if (r := metrics_record(line)) is not None]
    assert records == [{"train/loss_0": 0.123456789, "train/full_acc_1": 1e-07, "profile/step_ms": 1740.25,
                        "epoch": 2.0, "lr": 0.0003, "global_step": 40.0}]
    assert metrics_record("[19:36:54] INFO train/loss_0=0.062, epoch=2  trainer.py:587") is None  # rich's text
    assert metrics_record(sc_mark() + "{not json") is None


def sc_mark() -> str:
    from pipeline.compat.speculators_compat import METRICS_MARK
    return METRICS_MARK


def test_speculators_loguru_lines_go_to_the_stage_log_not_stderr(tmp_path, capfd):
    """speculators 0.9.0 logs through loguru (pipeline/compat/speculators_logs.py); if it stops, this fails."""
    import logging

    import loguru
    import speculators.utils.loading as loading

    from pipeline.compat import speculators_logs
    assert loading.logger is loguru.logger
    log = logging.getLogger("test-speculators-logs")
    log.propagate = False
    handler = logging.FileHandler(tmp_path / "stage.log")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with speculators_logs.into(log):
        loading.logger.warning("planted warning")
    handler.close()
    assert "planted warning" in (tmp_path / "stage.log").read_text()
    assert "planted warning" not in capfd.readouterr().err


def test_the_sub_epoch_keeper_wraps_what_speculators_still_has(monkeypatch):
    """The wrapped save keeps its signature (epoch, local_step) and its sub-epoch directory rule, and the
    wrapper is installed only when the run asks for it."""
    trainer = importlib.import_module(speculators_compat.SAVE[0])
    cls = getattr(trainer, speculators_compat.SAVE[1])
    assert list(inspect.signature(cls.maybe_save_checkpoint).parameters) == ["self", "epoch", "local_step"]
    source = inspect.getsource(cls.train_epoch)
    assert "self.maybe_save_checkpoint(epoch, local_step=local_step)" in source
    original = cls.maybe_save_checkpoint
    monkeypatch.delenv(speculators_compat.KEEP_ENV, raising=False)
    assert speculators_compat.keep_sub_epoch_checkpoints() == [] and cls.maybe_save_checkpoint is original
    monkeypatch.setenv(speculators_compat.KEEP_ENV, "1")
    monkeypatch.setattr(cls, "maybe_save_checkpoint", original)
    assert speculators_compat.keep_sub_epoch_checkpoints() == ["Trainer.maybe_save_checkpoint"]
    assert cls.maybe_save_checkpoint is not original


def test_a_kept_copy_is_the_step_just_saved(tmp_path):
    import json

    src = tmp_path / "3"
    src.mkdir()
    for name in speculators_compat.HEAD_FILES:
        (src / name).write_text(name)
    (src / "training_state.json").write_text(json.dumps({"epoch": 3, "local_step": 40, "global_step": 100}))
    assert speculators_compat.keep_copy(tmp_path, 3, 39) is None  # a save speculators skipped
    kept = speculators_compat.keep_copy(tmp_path, 3, 40)
    assert kept == tmp_path / "kept" / "3-step40"
    assert (kept / "model.safetensors").read_text() == "model.safetensors"
    assert json.loads((kept / "training_state.json").read_text())["local_step"] == 40
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["3-step40"]  # no temporary left
