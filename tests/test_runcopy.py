"""`run --copy-of RUN --from STAGE`: a new run from a finished one's earlier stages (issue 28 item 4)."""
import json
import os
from pathlib import Path

import pytest

from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.run.runcopy import RunCopyError, copy_of
from pipeline.run.runner import outputs_intact
from tests.conftest import cli, free_port


def _fingerprint(run_dir: Path) -> dict:
    """Every file of a run: size and modification time (what a copy must leave as it was)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and ".cache" not in p.parts}


def test_copy_reruns_from_its_stage_on_the_source_untouched(finished_run, tmp_path):
    before = _fingerprint(finished_run)
    src = RunDir.open(finished_run)
    dst = tmp_path / "fewer-epochs"
    proc = cli("run", "--copy-of", finished_run, "--from", "vocab", "--until", "train", "--no-tui",
               "--run-dir", dst, "--set", "vocab.draft_vocab_size=512", "--set", "train.epochs=1",
               "--set", f"server.port={free_port()}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"copied from {finished_run.resolve()}: build-target, regenerate, prepare, extract (" in proc.stdout
    assert "vocab.draft_vocab_size: 1024 -> 512" in proc.stdout and "train.epochs: 3 -> 1" in proc.stdout
    run = RunDir.open(dst)
    state, old = run.read_state(), src.read_state()
    for stage in ("build-target", "regenerate", "prepare", "extract"):  # carried over, recorded as the source did
        assert state["stages"][stage]["figures"] == old["stages"][stage]["figures"]
        assert outputs_intact(run, state["stages"][stage]["outputs"])
    assert state["stages"]["vocab"]["figures"]["draft_vocab_size"] == 512
    assert state["stages"]["train"]["figures"]["epochs"] == 1
    assert "evaluate-offline" not in state["stages"]  # --until train
    assert (run.checkpoints_dir / "0").is_dir() and (src.checkpoints_dir / "2").is_dir()
    assert not (run.checkpoints_dir / "2").exists()  # trained afresh: the source's epochs left behind
    assert state["copied_from"]["run"] == str(finished_run.resolve()) and state["copied_from"]["from"] == "vocab"
    # the states are the source's own files (hard links on one file system), the new run's own under its root
    a, b = sorted(src.hidden_states_dir.glob("hs_*")), sorted(run.hidden_states_dir.glob("hs_*"))
    assert [p.name for p in a] == [p.name for p in b] and a
    assert all(os.path.samefile(x, y) for x, y in zip(a, b, strict=True)) or state["copied_from"]["copied"]
    assert any("copied from" in json.loads(line)["text"] for line in (dst / "notes.jsonl").read_text().splitlines())
    assert _fingerprint(finished_run) == before
    named = [p for p in dst.rglob("*.json") if str(finished_run.resolve()) + "/" in p.read_text()
             and "logs" not in p.parts and p.name not in ("state.json",)]
    assert named == []  # results that named the source's files name the copy's (state.json: copied_from)
    status = json.loads(cli("status", dst, "--json").stdout)
    assert {s["stage"]: s["status"] for s in status["stages"]}["extract"] == "done"  # not stale: paths rewritten


def test_copy_refusals_write_nothing(finished_run, tmp_path):
    profile = load_profile(finished_run / "profile.toml", {"train.epochs": 1})
    half, _ = copy_of(finished_run, profile, "train", tmp_path / "half")  # nothing run: train not there
    assert not half.checkpoints_dir.exists() and "train" not in half.read_state()["stages"]
    try:
        copy_of(half.root, profile, "deploy-measure", tmp_path / "never")
    except RunCopyError as exc:
        assert "train is pending there, and --from deploy-measure starts from its outputs" in str(exc)
    else:
        raise AssertionError("a copy past a stage the source has not done was made")
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.copying").exists()
    for args, says in (
            (("--copy-of", finished_run), "say where the new run starts (--from STAGE)"),
            (("--copy-of", tmp_path, "--from", "train"), "not a run directory"),
            (("--copy-of", finished_run, "--from", "train", "--run-dir", finished_run / "inner"), "inside"),
            (("--copy-of", finished_run, "--from", "train", "--run-dir", half.root), "already holds a run"),
            (("--copy-of", finished_run, "--from", "train", "--run-dir", half.root / "data"), "not empty"),
            (("--resume", half.root, "--copy-of", finished_run), "keeps the profile and the files"),
            (("--copy-of", finished_run, "--from", "nowhere"), "unknown stage")):
        proc = cli("run", *args, "--no-tui")
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (finished_run / "inner").exists()


def test_an_interrupted_copy_is_replaced(finished_run, tmp_path):
    left = tmp_path / "again.copying"
    (left / "data").mkdir(parents=True)
    (left / "data" / "half-linked").write_text("x")
    profile = load_profile(finished_run / "profile.toml")
    run, copied = copy_of(finished_run, profile, "evaluate-offline", tmp_path / "again")
    assert not left.exists() and not (run.data_dir / "half-linked").exists()
    assert copied.changed == [] and "train" in copied.stages


def test_a_copy_cannot_change_the_head_its_carried_vocabulary_was_built_for(finished_run, tmp_path):
    """vocab wrote this run's own mapping (or a starting head's): a copy that carries it over and trains from
    another head would re-label that head's lm_head rows with it, silently. Copied from vocab on, the
    starting head's copy in the run is made again from the profile's head, not carried."""
    head = tmp_path / "head"
    head.mkdir()  # the loader asks only that it exists: the copy refuses before anything reads it
    warm = load_profile(finished_run / "profile.toml", {"train.from_pretrained": str(head)})
    with pytest.raises(RunCopyError) as err:
        copy_of(finished_run, warm, "train", tmp_path / "never")
    assert str(err.value).startswith("train.from_pretrained changed: vocab decided with \"\" in ")
    assert "copy --from vocab to decide again" in str(err.value)
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.copying").exists()
    cold = load_profile(finished_run / "profile.toml")
    before_vocab, _ = copy_of(finished_run, cold, "vocab", tmp_path / "a")
    (before_vocab.start_head_dir).mkdir()
    (before_vocab.start_head_dir / "config.json").write_text("{}")  # an earlier warm attempt's copy
    again, _ = copy_of(before_vocab.root, warm, "vocab", tmp_path / "b")
    assert not again.start_head_dir.exists() and again.token_freq.exists()
