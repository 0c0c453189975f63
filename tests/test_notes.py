import json

from pipeline.layout import atomicio
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.report import notes
from tests.conftest import TINY, cli
from tests.helpers import ROOT


def new_run(tmp_path):
    return RunDir.create(load_profile(TINY), tmp_path / "run")


def test_notes_are_append_only_and_ordered(tmp_path):
    run = new_run(tmp_path)
    notes.add(run, "first")
    before = run.notes_path.read_bytes()
    notes.add(run, "second", source="auto", stage="train", figures={"loss": 0.5})
    after = run.notes_path.read_bytes()
    assert after.startswith(before) and len(after) > len(before)  # earlier bytes never rewritten
    texts = [n["text"] for n in notes.read(run)]
    assert texts == ["first", "second"]


def test_torn_last_line_is_skipped_and_sealed(tmp_path):
    run = new_run(tmp_path)
    notes.add(run, "kept")
    with open(run.notes_path, "ab") as fh:
        fh.write(b'{"ts": "x", "text": "torn by a cra')  # what a SIGKILL mid-append leaves
    notes.add(run, "after crash")
    assert [n["text"] for n in notes.read(run)] == ["kept", "after crash"]


def test_secrets_from_environment_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cr3t-value-123")
    run = new_run(tmp_path)
    notes.add(run, "server started with key s3cr3t-value-123 and hf_abcdefghijklmnop")
    text = notes.read(run)[0]["text"]
    assert "s3cr3t" not in text and "hf_abcdefghijklmnop" not in text
    assert "<VLLM_API_KEY>" in text


def test_cli_notes_add_and_export(tmp_path):
    run = new_run(tmp_path)
    assert cli("notes", "add", run.root, "acceptance looks low on code prompts").returncode == 0
    out = tmp_path / "notes.md"
    proc = cli("notes", "export", run.root, "--format", "md", "-o", out)
    assert proc.returncode == 0, proc.stderr
    md = out.read_text()
    assert md.startswith("# Run report") and "acceptance looks low on code prompts" in md
    proc = cli("notes", "export", run.root, "--format", "json")
    data = json.loads(proc.stdout)
    assert data["notes"][0]["source"] == "operator"


def test_cli_notes_on_missing_run_is_one_line(tmp_path):
    proc = cli("notes", "add", tmp_path / "nope", "x")
    assert proc.returncode == 2 and "not a run directory" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_append_jsonl_fsyncs_each_record(tmp_path, monkeypatch):
    synced = []
    real = atomicio.os.fsync
    monkeypatch.setattr(atomicio.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    atomicio.append_jsonl(tmp_path / "x.jsonl", {"a": 1})
    atomicio.append_jsonl(tmp_path / "x.jsonl", {"a": 2})
    assert len(synced) == 2


def test_the_instance_lines_say_what_was_compared():
    """One baseline instance has no spread of its own: the line says production against it and the bound, not
    "0% apart" (the H100 run of 2026-12-06 read "(0% apart; production +5%)"); two instances say both."""
    res = json.loads((ROOT / "bench/results/h100/gpu-demo/2026-12-06/online.json").read_text())
    assert any(line.startswith("check: a served k predicted") for line in notes.sweep_lines(res))  # k=1's +18%
    lines = [line for line in notes.sweep_lines(res) if line.startswith("the target alone")]
    assert lines[0] == ("the target alone at c=1: baseline 426.6, production before the run 445.8 tok/s "
                        "(production +5% of the baseline; bound 10%)")
    level = res["instances"]["levels"]["8"]
    level["baseline_instances"]["baseline-2"], level["spread"] = 2400.0, 0.105
    two = [line for line in notes.sweep_lines(res) if line.startswith("the target alone at c=8")][0]
    assert two.endswith("(baseline instances 10% apart; production +7% of the baseline; bound 10%)"), two
