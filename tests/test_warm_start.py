"""Warm start (issue 44 item 2, train.from_pretrained): the head speculators' --from-pretrained trains on from,
checked against the target and the profile before anything runs (each contradiction names its key), its own
d2t/t2d kept as the draft vocabulary, and measured by pick-checkpoint as checkpoint "start" beside the new ones."""
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.compat import speculators_heads
from pipeline.layout import atomicio, results
from pipeline.layout.checkpoints import START, Checkpoint, measures_checkpoints, with_start
from pipeline.layout.rundir import RunDir
from pipeline.planning.preflight import blocking, warm_start_findings
from pipeline.planning.steps import warm_start_text
from pipeline.profile import ProfileError, load_profile
from tests.helpers import TINY, cli, free_port, spawn_cli, wait_for
from tests.test_speculators_heads import built  # noqa: F401 - the module's fixture: a tiny target and heads

# what the tiny head of tests/test_speculators_heads.py is: 2 layers, 32 of 64 tokens, aux [0, 2], fc_norm, full
# attention (its layer config has no window)
FITS = {"train.num_layers": 2, "vocab.draft_vocab_size": 32, "extract.layer_ids": [0, 2, 3],
        "train.norm_before_fc": False, "train.fc_norm": True, "train.norm_output": False, "train.sliding_window": 0}


def profile_on(built, head, **over):  # noqa: F811
    return load_profile(TINY, overrides={"target.source": "path", "target.model_path": str(built.target),
                                         "train.from_pretrained": str(head), **over})


# keys the profile moves off their defaults against the head (2 layers, norm_before_residual true)
AGAINST = {"train.num_layers": 3, "train.norm_before_residual": False}


def test_preflight_names_each_key_the_head_contradicts(built):  # noqa: F811
    found = warm_start_findings(profile_on(built, built.head, **AGAINST))
    said = " | ".join(f.message for f in blocking(found))
    for key in ("train.num_layers", "vocab.draft_vocab_size", "extract.layer_ids", "train.norm_before_residual"):
        assert key in said, said
    assert "the head has 2 decoder layer(s), the profile asks 3" in said
    # the shape's defaults (a new head's: 1 layer, the norms, the window) leave the head its own: only the
    # draft vocabulary and the aux layers, which size the run's files and states, are held to the profile
    own = " | ".join(f.message for f in blocking(warm_start_findings(profile_on(built, built.head))))
    assert "vocab.draft_vocab_size" in own and "extract.layer_ids" in own
    for key in ("train.num_layers", "train.norm_", "train.fc_norm", "train.sliding_window"):
        assert key not in own, own
    asked = " | ".join(f.message for f in blocking(warm_start_findings(
        profile_on(built, built.head, **{**FITS, "train.sliding_window": 1024}))))
    assert ("train.sliding_window: the head's layers have full attention, the profile asks a window of 1024: a "
            "warm start keeps the head's (set 0 or leave the key out)") in asked, asked
    fits = warm_start_findings(profile_on(built, built.head, **FITS))
    assert not blocking(fits) and [f.severity for f in fits] == ["ok"]
    assert "training goes on from" in fits[0].message and "draft vocab 32 of 64" in fits[0].message
    dropped = warm_start_findings(profile_on(built, built.head, **FITS, **{"vocab.from_head": False}))
    assert [f.severity for f in dropped] == ["ok", "warn"] and "vocabulary mapping is dropped" in dropped[1].message


def test_the_stage_says_every_contradiction_at_once(built):  # noqa: F811
    """A head converted into the run is checked again by the stage (preflight could not read it before):
    every key it contradicts in one line, so one edit of the profile fixes the run."""
    from pipeline.stages.base import StageError
    from pipeline.stages.heads import check_start

    ctx = SimpleNamespace(profile=profile_on(built, built.head, **AGAINST), target_dir=lambda: built.target)
    with pytest.raises(StageError) as err:
        check_start(ctx, built.head)
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"train.from_pretrained = {str(built.head)!r}: ")
    for key in ("train.num_layers", "vocab.draft_vocab_size", "extract.layer_ids", "train.norm_before_residual"):
        assert f"{key}: " in said, said
    check_start(SimpleNamespace(profile=profile_on(built, built.head, **FITS), target_dir=lambda: built.target),
                built.head)  # a head that fits passes


def test_a_head_that_is_not_one_and_a_research_head(built, tmp_path):  # noqa: F811
    (tmp_path / "empty").mkdir()
    found = warm_start_findings(profile_on(built, tmp_path / "empty"))
    assert [f.severity for f in found] == ["block"] and "train.from_pretrained" in found[0].message
    # a research head's shape is checked before any conversion (which waits for vocab, after extract's states)
    research = " | ".join(f.message for f in blocking(warm_start_findings(profile_on(built, built.research,
                                                                                      **FITS))))
    assert "train.num_layers: the head has 1 decoder layer(s), the profile asks 2" in research, research
    assert "train.fc_norm" in research and "train.norm_before_residual" not in research, research
    fits = warm_start_findings(profile_on(built, built.research, **{**FITS, "train.num_layers": 1,
                                                                    "extract.layer_ids": [0, 1, 2, 3],
                                                                    "train.fc_norm": False}))
    assert [f.severity for f in fits] == ["ok", "warn"] and "speculators convert makes the run's copy" in \
        fits[0].message
    # its config names no aux layers: the profile's, off the default, are said (its fc may read other states)
    assert "names no aux layers" in fits[1].message and "[0, 1, 2]" in fits[1].message, fits[1].message


def test_a_research_head_missing_a_weight_or_with_a_torn_mapping_is_blocked_before_extract(built, tmp_path):  # noqa: F811
    """speculators' converter only warns about a missing weight (and leaves it random): preflight names the
    keys from the weights' index; a d2t and t2d that disagree are caught before the vocab stage writes them."""
    import torch

    from tests.test_speculators_heads import _research_head

    fits = {**FITS, "train.num_layers": 1, "extract.layer_ids": [0, 1, 2, 3], "train.fc_norm": False}
    gap = _research_head(tmp_path / "gap", edit=lambda w: {k: v for k, v in w.items() if k != "norm.weight"})
    (found,) = blocking(warm_start_findings(profile_on(built, gap, **fits)))
    assert "not in the weights: norm.weight" in found.message and "train.from_pretrained" in found.message
    torn = _research_head(tmp_path / "torn", edit=lambda w: {**w, "d2t": w["d2t"] + torch.ones_like(w["d2t"])})
    (found,) = blocking(warm_start_findings(profile_on(built, torn, **fits)))
    assert "disagree" in found.message, found.message
    assert not blocking(warm_start_findings(profile_on(built, torn, **fits, **{"vocab.from_head": False})))


def test_a_runs_copy_of_another_head_is_refused_not_trained(built, tmp_path):  # noqa: F811
    """The run's profile.toml edited to name another head after start-head/ was made: preflight and the
    stages refuse the old copy, naming the key and both heads, instead of training it as the new one."""
    from pipeline.layout.rundir import record_head_copy
    from pipeline.planning.preflight import warm_start_findings as findings
    from pipeline.stages.base import StageError
    from pipeline.stages.heads import held_copy

    run = RunDir(tmp_path / "run")
    copy = run.start_head_dir
    copy.mkdir(parents=True)
    (copy / "config.json").write_text((built.head / "config.json").read_text())
    record_head_copy(copy, "/old/head")
    p = profile_on(built, built.head, **FITS)
    (found,) = blocking(findings(p, run.root))
    assert "was made from '/old/head'" in found.message and "train.from_pretrained" in found.message
    ctx = SimpleNamespace(profile=p, run=run)
    with pytest.raises(StageError, match="this run's copy .* was made from '/old/head'") as err:
        held_copy(ctx, copy, str(built.head), "train.from_pretrained")
    assert not err.value.resumable
    record_head_copy(copy, str(built.head))  # the copy of the head named: held as before
    assert held_copy(ctx, copy, str(built.head), "train.from_pretrained") == copy


def test_the_profile_keys(tmp_path):
    with pytest.raises(ProfileError, match=r"train.from_pretrained.*no head at"):
        load_profile(TINY, overrides={"train.from_pretrained": "no-such-head"})
    with pytest.raises(ProfileError, match=r"evaluate.existing_head"):
        load_profile(TINY, overrides={"train.from_pretrained": "existing"})
    (tmp_path / "head").mkdir()
    p = load_profile(TINY, overrides={"train.from_pretrained": str(tmp_path / "head"), "train.epochs": 1})
    assert measures_checkpoints(p) and not measures_checkpoints(load_profile(TINY))
    text = warm_start_text(p)
    assert "1 epoch(s) on from" in text and "checkpoint 'start' beside the last epoch" in text
    assert "not readable now" in text and "preflight blocks the run" in text  # an empty folder: said, not guessed
    assert warm_start_text(load_profile(TINY)) == ""


def test_a_relative_head_on_the_command_line_is_the_working_directorys(tmp_path, monkeypatch):
    """--set paths are typed where the operator stands: relative to the working directory, not to the profile's
    folder — for `run --copy-of` that folder is another run's, which may hold a head of the same name."""
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    p = load_profile(TINY, overrides={"train.from_pretrained": "checkpoints/1", "evaluate.existing_head": "h"})
    assert p.train.from_pretrained == str(tmp_path / "checkpoints" / "1")
    assert p.evaluate.existing_head == str(tmp_path / "h")
    assert load_profile(TINY, overrides={"train.from_pretrained": "existing", "evaluate.existing_head": "h"}) \
        .train.from_pretrained == "existing"
    # written into a profile file, a path stays the profile's folder's (a profile works from any cwd)
    written = tmp_path / "profiles" / "p.toml"
    written.parent.mkdir()
    written.write_text(f'extends = "{TINY}"\n[train]\nfrom_pretrained = "../checkpoints/1"\n')
    assert load_profile(written).train.from_pretrained == str(tmp_path / "checkpoints" / "1")


def test_the_command_loads_the_head_and_leaves_the_shaping_to_it(tmp_path):
    from pipeline.stages import train

    (tmp_path / "head").mkdir()
    p = load_profile(TINY, overrides={"train.from_pretrained": str(tmp_path / "head")})
    ctx = SimpleNamespace(profile=p, run=RunDir(tmp_path / "run"), target_dir=lambda: Path(TINY).parent,
                          extract_mode=lambda: "offline")
    # the target's config for the layer ids: the tiny demo target's, written here
    (tmp_path / "t").mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 4, "vocab_size": 512, "num_attention_heads": 4}
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    ctx.target_dir = lambda: tmp_path / "t"
    argv = train.build_command(ctx, python="PY", start=tmp_path / "head")
    assert argv[argv.index("--from-pretrained") + 1] == str(tmp_path / "head") and "--num-layers" not in argv
    cold = train.build_command(ctx, python="PY")
    assert "--from-pretrained" not in cold and cold[cold.index("--num-layers") + 1] == "1"


def test_a_warm_started_head_trains_in_float32_as_a_cold_one(monkeypatch):
    """speculators 0.9.0 loads the head in its saved bf16 and would train bf16 weights (compat/speculators_compat)."""
    import torch
    from speculators.train import cli as spec_cli

    from pipeline.compat import speculators_compat

    def saved(args, *rest):  # a head as speculators loads one: bf16 weights, a boolean t2d
        head = torch.nn.Linear(4, 4).to(torch.bfloat16)
        head.register_buffer("t2d", torch.ones(4, dtype=torch.bool))
        return head

    monkeypatch.setattr(spec_cli, "build_draft_model", saved)
    speculators_compat.warm_start_in_float32()
    warm = spec_cli.build_draft_model(SimpleNamespace(from_pretrained="/head"), None, None, 32)
    assert warm.weight.dtype == torch.float32 and warm.t2d.dtype == torch.bool
    cold = spec_cli.build_draft_model(SimpleNamespace(from_pretrained=None), None, None, 32)
    assert cold.weight.dtype == torch.bfloat16  # anything else is left as speculators built it


def test_the_start_is_measured_first_beside_the_last_or_every_checkpoint(tmp_path):
    found = [Checkpoint(str(i), i, 0, tmp_path / str(i)) for i in range(3)]
    assert [c.label for c in with_start(found, tmp_path / "h", every=False)] == [START, "2"]
    assert [c.label for c in with_start(found, tmp_path / "h", every=True)] == [START, "0", "1", "2"]
    assert with_start(found, None, every=True) == found and with_start(found, None, every=False) == found[-1:]


@pytest.mark.integration  # a training through speculators and the offline evaluator
def test_a_warm_start_trains_on_from_the_head_keeps_its_vocabulary_and_measures_it(finished_run, tmp_path):
    """A copy of the shared finished run from vocab on, training two epochs on from its last epoch's head,
    SIGKILLed once the first is saved and resumed: the trainer is given --from-pretrained and the head's own
    d2t/t2d both times, starts where the head left off (its first loss below the cold start's), resumes from
    its epoch 0, and pick-checkpoint measures the starting head as "start" beside the last epoch."""
    source = RunDir.open(finished_run)
    head = Path(source.result(results.TrainResult).checkpoint or "")
    run_dir = tmp_path / "warm"
    proc = spawn_cli("run", "--copy-of", finished_run, "--from", "vocab", "--no-tui", "--run-dir", run_dir,
                     "--set", f'train.from_pretrained="{head}"', "--set", "train.epochs=2",
                     "--set", f"server.port={free_port()}", new_session=True)
    wait_for(lambda: (run_dir / "checkpoints" / "0" / "training_state.json").is_file(), 600,
             "the warm start's first epoch saved", poll=0.05, alive=proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner; its trainer runs on in a group of its own
    proc.wait()
    done = cli("run", "--resume", run_dir, "--no-tui", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # from epoch 0, or 1 where the trainer (a group of its own, stopped by the resume) saved it before
    assert RunDir.open(run_dir).stage_state("train")["figures"]["resumed_from_epoch"] in (0, 1)
    run = RunDir.open(run_dir)
    draft = run.profile().vocab.draft_vocab_size
    d2t, t2d = speculators_heads.vocab_mapping(head)
    mine = run.vocab_mappings(draft)
    assert np.array_equal(np.load(mine[0]), d2t.numpy()) and np.array_equal(np.load(mine[1]), t2d.numpy())
    start = run.start_head_dir  # the head published into the run, its verifier this run's target
    assert run.stage_state("vocab")["figures"]["from_head"] == str(start)
    commands = [e["argv"] for e in run.events() if e["stage"] == "train" and e["kind"] == "command"]
    assert len(commands) == 2  # the killed attempt's and the resumed one's: the head both times
    for command in commands:
        assert command[command.index("--from-pretrained") + 1] == str(start) and "--num-layers" not in command
    assert (start / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()

    def first_loss(r: RunDir) -> float:
        return next(e["train/loss"] for e in r.events() if e["stage"] == "train" and "train/loss" in e)
    assert first_loss(run) < first_loss(source), (first_loss(run), first_loss(source))
    picked = atomicio.read_json(run.checkpoints_result)
    assert [e["label"] for e in picked["checkpoints"]] == [START, "1"]
    assert all(e["tau"] >= 1.0 for e in picked["checkpoints"])
    assert picked["checkpoints"][0]["path"] == str(start)
    chosen = next(e for e in picked["checkpoints"] if e["label"] == picked["chosen"]["label"])
    assert chosen["tau"] == max(e["tau"] for e in picked["checkpoints"])
    assert run.result(results.PickCheckpointResult).checkpoint == chosen["path"]


def existing_on(built, head, **over):  # noqa: F811
    return load_profile(TINY, overrides={"target.source": "path", "target.model_path": str(built.target),
                                         "evaluate.existing_head": str(head), **over})


def test_preflight_checks_the_existing_head_it_will_serve_before_any_server(built, tmp_path, monkeypatch):  # noqa: F811
    """evaluate.existing_head as a run directory (its published head), a head this target cannot serve, a
    path that is no head: said by preflight, not by measure-existing after the baseline's server."""
    import shutil

    from pipeline.planning import preflight, vllm_probe
    run = RunDir.create(existing_on(built, built.head), tmp_path / "run")
    shutil.copytree(built.head, run.draft_dir)
    [found] = preflight.existing_head_findings(existing_on(built, run.root))
    assert found.severity == "ok" and str(run.draft_dir) in found.message and "(run)" in found.message
    asked = {}
    monkeypatch.setattr(vllm_probe, "ask", lambda python, cache, probe, question: asked.update(question) or
                        {"error": "not asked in this test"})
    fields = preflight.head_field_findings(existing_on(built, run.root, **{"evaluate.online": False}))
    assert asked["drafts"] and not blocking(fields)  # the run's head read for vLLM's fields, not refused
    wider = tmp_path / "wider"
    shutil.copytree(built.head, wider)
    config = json.loads((wider / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] *= 2
    (wider / "config.json").write_text(json.dumps(config))
    [found] = preflight.existing_head_findings(existing_on(built, wider))
    assert found.severity == "block" and found.message.startswith(f"evaluate.existing_head {str(wider)!r}: "
                                                                  "vocab_size: the head maps to a vocabulary of")
    (tmp_path / "empty").mkdir()
    [found] = preflight.existing_head_findings(existing_on(built, tmp_path / "empty"))
    assert found.severity == "block" and "neither a head nor a run directory" in found.message
    [found] = preflight.existing_head_findings(existing_on(built, built.research))
    assert found.severity == "ok" and "speculators convert makes the run's copy" in found.message
    assert preflight.existing_head_findings(existing_on(built, built.head, **{"evaluate.existing_policy": "off",
                                                                             "evaluate.online": False})) == []


def test_a_resume_trains_from_the_runs_copy_when_the_source_head_is_gone(built, tmp_path):  # noqa: F811
    """The source head deleted or moved after the run copied it (start-head/): the resume loads the run's
    profile and preflight checks the copy, which is what vocab, train and pick-checkpoint use."""
    import shutil

    from pipeline.layout.rundir import RunDirError
    from pipeline.planning import preflight
    source = tmp_path / "source"
    shutil.copytree(built.head, source)
    run = RunDir.create(profile_on(built, source, **FITS), tmp_path / "run")
    shutil.rmtree(source)
    with pytest.raises(RunDirError, match="train.from_pretrained': no head at"):
        run.profile()  # no copy yet: the source is what it would train from
    shutil.copytree(built.head, run.start_head_dir)
    profile = run.profile()
    assert profile.train.from_pretrained == str(source)
    [found] = preflight.warm_start_findings(profile, run.root)
    assert found.severity == "ok" and f"training goes on from the run's copy of {source}" in found.message
    [found] = preflight.warm_start_findings(profile)  # a new run from the same profile: the source is gone
    assert found.severity == "block" and "not a directory" in found.message


def test_a_warm_starts_fields_for_vllm_are_the_heads_not_the_profiles_defaults(built, monkeypatch):  # noqa: F811
    """The trained head keeps the starting head's norms (speculators builds it from the head's config): the
    serving vLLM is asked about those, named as the head's."""
    from pipeline.planning import preflight
    from tests.test_eagle31 import fake_vllm, reads
    fake_vllm(monkeypatch, reads(fc_norm={"read": False}))  # the head has fc_norm = true; the profile's is false
    profile = profile_on(built, built.head, **{"evaluate.online": True, "evaluate.methods": ["baseline", "eagle3"]})
    assert profile.train.fc_norm is False
    [found] = preflight.head_field_findings(profile)
    assert found.severity == "block" and found.message.startswith(
        f"train.from_pretrained {str(built.head)!r} (the norms it keeps): fc_norm = true"), found.message


def test_a_research_start_without_a_norm_is_checked_as_speculators_will_write_it(built, tmp_path, monkeypatch):  # noqa: F811
    """yuhuili's configs leave norm_before_residual out; the head speculators writes after training has it
    explicit (false), which vLLM serves as such: no block for a field that will not be absent."""
    from pipeline.planning import preflight
    from tests.test_eagle31 import fake_vllm, reads
    from tests.test_speculators_heads import _research_head
    bare = _research_head(tmp_path / "bare", config={"norm_before_residual": None})
    fake_vllm(monkeypatch, reads())  # vLLM's adapter serves an absent norm_before_residual as true
    profile = profile_on(built, bare, **{"evaluate.online": True, "evaluate.methods": ["baseline", "eagle3"]})
    assert not blocking(preflight.head_field_findings(profile))


def test_the_plan_counts_the_layers_the_head_keeps(built):  # noqa: F811
    from pipeline.planning.steps import draft_layers
    from pipeline.stages.deploy_measure import DeployMeasure
    assert draft_layers(profile_on(built, built.head)) == 2  # the key at its default: the head's own
    assert draft_layers(profile_on(built, built.head, **{"train.num_layers": 3})) is None  # the profile's (blocked)
    assert draft_layers(load_profile(TINY)) is None  # no warm start
    # a copy from deploy-measure on keeps vocab's copy of the "existing" head the carried mapping came from
    existing = profile_on(built, "existing", **{"evaluate.existing_head": str(built.head)})
    ctx = SimpleNamespace(profile=existing, run=SimpleNamespace(online_result=Path("o"), draft_dir=Path("d"),
                                                                existing_head_dir=Path("e")))
    assert Path("e") not in DeployMeasure().fresh_paths(ctx)
    ctx.profile = load_profile(TINY)
    assert Path("e") in DeployMeasure().fresh_paths(ctx)
