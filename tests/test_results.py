"""Stage results as declared types (pipeline/layout/results.py): stored through their models by the runner, read
typed by later stages, the CLI, the report and the plots."""
import pytest

from pipeline.layout import results
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from tests.conftest import TINY


def test_declared_figures_are_typed_and_the_others_kept_as_written():
    stored = results.stored("deploy-measure", {"decision": "deploy: speedup x1.300", "deploy": True, "speedup": 1,
                                               "ngram_draft_share": 0.03, "acceptance_per_position": [0.8, 0.7]})
    assert stored == {"decision": "deploy: speedup x1.300", "deploy": True, "speedup": 1.0,
                      "ngram_draft_share": 0.03, "acceptance_per_position": [0.8, 0.7]}
    assert results.stored("vocab", {"coverage": 1, "seen_tokens": 3}) == {"coverage": 1.0, "seen_tokens": 3}


def test_a_stage_returns_its_own_model():
    """The runner stores what a stage returned through the stage's model; another stage's is refused."""
    assert results.stored("vocab", results.VocabResult.of({"coverage": 0.5})) == {"coverage": 0.5}
    with pytest.raises(ValueError, match="vocab returned a TrainResult, not its VocabResult"):
        results.stored("vocab", results.TrainResult.of({"tokens_per_s": 1.0}))
    assert set(results.MODELS) == set(__import__("pipeline.stages", fromlist=["stage_names"]).stage_names())
    with pytest.raises(ValueError, match="train recorded a figure of the wrong type: tokens_per_s = 'fast'"):
        results.TrainResult.of({"tokens_per_s": "fast"})


def test_a_figure_of_the_wrong_type_is_named_in_one_line():
    with pytest.raises(ValueError) as err:
        results.stored("deploy-measure", {"deploy": "maybe", "speedup": 1.2})
    line = str(err.value)
    assert "\n" not in line and "deploy-measure" in line and "deploy = 'maybe'" in line
    with pytest.raises(ValueError, match="extract_mode = 'sideways'"):
        results.stored("preflight", {"extract_mode": "sideways"})


def test_a_run_reads_what_a_stage_recorded_typed_and_none_before_it_ran(tmp_path):
    run = RunDir.create(load_profile(TINY, overrides={"run.runs_dir": str(tmp_path / "runs")}), tmp_path / "run")
    before = run.result(results.DeployMeasureResult)
    assert before.verdict() is None and before.speedup is None and before.acceptance_per_position == []
    run.update_stage("deploy-measure", figures=results.stored("deploy-measure", {
        "decision": "do not deploy: speedup x1.013 < threshold x1.1 at concurrency 1", "deploy": False,
        "reason": "speedup x1.013 < threshold x1.1 at concurrency 1", "speedup": 1.013}))
    after = run.result(results.DeployMeasureResult)
    assert after.verdict() is not None and after.verdict().deploy is False and after.speedup == 1.013
    assert after.verdict().line == "do not deploy: speedup x1.013 < threshold x1.1 at concurrency 1"
    # the decision is the boolean and its reason, never read back from the line people read
    said = results.read(results.DeployMeasureResult, {"decision": "deploy: speedup x1.430 >= threshold x1.1"})
    assert said.verdict() is None
    assert results.decision_in({"deploy": True, "reason": "speedup x1.4", "matrix": {}}).line == "deploy: speedup x1.4"


def test_the_trainer_writes_its_metrics_to_tensorboard_inside_the_run(finished_run):
    """train.loggers = ["tensorboard"] reaches speculators' own --logger: the event file is under
    RUN/logs/trackers/RUN_NAME and holds the same training losses the train stage recorded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir.open(finished_run)
    files = list(run.trackers_dir.glob(f"{run.root.name}/events.out.tfevents.*"))
    assert files, list(run.trackers_dir.rglob("*"))
    events = EventAccumulator(str(files[0].parent))
    events.Reload()
    tags = events.Tags()["scalars"]
    loss = next(t for t in tags if t.endswith("train/loss") or t == "train/loss")
    losses = [e.value for e in events.Scalars(loss)]
    figures = run.stage_state("train")["figures"]
    assert len(losses) == figures["logged_steps"]
    assert losses[-1] == pytest.approx(figures["train_loss"], rel=1e-3, abs=1e-4)


def test_a_tracker_that_is_not_installed_blocks_preflight(monkeypatch):
    from importlib import metadata

    from pipeline.planning.preflight import tracker_findings
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: real("no-such-dist") if name == "wandb" else real(name))
    said = tracker_findings(load_profile(TINY, overrides={"train.loggers": ["tensorboard", "wandb"]}))
    assert [f.severity for f in said] == ["ok", "block"]
    assert "train.loggers = ['tensorboard', 'wandb']: the package wandb is not installed" in said[1].message


def test_the_snapshot_says_stale_only_where_it_checks_the_outputs(tmp_path):
    """A done stage whose outputs changed is "stale" in `status` (outputs checked) and "done" in the
    console's poll (not checked); what it recorded reads typed from the snapshot itself."""
    from pipeline.run import jobs
    from pipeline.run.runner import manifest
    run = RunDir.create(load_profile(TINY, overrides={"run.runs_dir": str(tmp_path / "runs")}), tmp_path / "run")
    d2t, t2d = run.vocab_mappings(run.profile().vocab.draft_vocab_size)
    for path in (d2t, t2d):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 8)
    run.update_stage("vocab", status="done", outputs=manifest(run, [d2t, t2d]),
                     figures=results.stored("vocab", {"coverage": 0.9}))

    def vocab(**kw):
        snap = jobs.snapshot(run, peers=False, **kw)
        return next(s.status for s in snap.stages if s.name == "vocab"), snap.result(results.VocabResult).coverage

    assert vocab() == vocab(check_outputs=False) == ("done", 0.9)
    d2t.write_bytes(b"x" * 9)
    assert vocab() == ("stale", 0.9) and vocab(check_outputs=False) == ("done", 0.9)
