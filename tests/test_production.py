"""The operator's story around production (evaluate.production_before_after): production is up on the port
first and measured on the held-out prompts, the run stops it, trains, hands production back with the new head
when it decided so, and measures it again on the same requests."""
import json

import pytest

from pipeline.cli.base import overrides
from pipeline.compat import vllm_kv_groups
from pipeline.layout.rundir import RunDir
from pipeline.planning import preflight
from pipeline.profile import ProfileError, load_profile
from tests.conftest import TINY, cli, free_port

STORY = ("evaluate.production_before_after=true", 'server.after_run="production-with-draft"')


def test_production_measured_after_needs_a_handover_back():
    with pytest.raises(ProfileError, match="evaluate.production_before_after"):
        load_profile(TINY, overrides(["evaluate.production_before_after=true"]))


def test_preflight_asks_for_production_first(tmp_path):
    port = free_port()
    demo = load_profile(TINY, overrides([*STORY, f"server.port={port}", f'run.runs_dir="{tmp_path}"']))
    found = [f for f in preflight.port_findings(demo) if f.check == "production"]
    assert len(found) == 1 and found[0].severity == "info" and "after build-target" in found[0].message
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    served = load_profile(TINY, overrides([*STORY, f"server.port={port}", f'run.runs_dir="{tmp_path}"',
                                            'target.source="path"', f'target.model_path="{tmp_path}"']))
    found = [f for f in preflight.port_findings(served) if f.check == "production"]
    assert len(found) == 1 and found[0].severity == "block" and f"port {port}" in found[0].message


def test_a_resume_after_production_was_measured_needs_no_production_up(tmp_path):
    port = free_port()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    served = load_profile(TINY, overrides([*STORY, f"server.port={port}", f'run.runs_dir="{tmp_path}"',
                                            'target.source="path"', f'target.model_path="{tmp_path}"']))
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    assert [f for f in preflight.port_findings(served, run_dir) if f.check == "production"]  # not measured yet
    (run_dir / "eval" / "production-before.json").write_text("{}")
    assert not [f for f in preflight.port_findings(served, run_dir) if f.check == "production"]


@pytest.mark.integration  # a run through build-target and measure-production
def test_measure_production_without_production_fails_in_one_line(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    sets = [*STORY, f'run.cache_dir="{cache_dir}"', f"server.port={free_port()}"]
    proc = cli("run", TINY, "--no-tui", "--run-dir", run_dir, "--until", "measure-production",
               *[a for s in sets for a in ("--set", s)])
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "no healthy production server on port" in proc.stderr and "server start --mode production" in proc.stderr


@pytest.mark.slow
def test_production_before_and_after_on_the_same_requests(tmp_path, cache_dir):
    """The whole story, with a head forced into production (one k everywhere, threshold 0) that then measures
    slower than production did before beyond the noise allowed (on a CPU a head's step costs more than it saves):
    production-with-draft-or-rollback puts production back as it was, the operator's argv unchanged."""
    run_dir = tmp_path / "run"
    sets = [*STORY[:1], 'server.after_run="production-with-draft-or-rollback"', "evaluate.online=true",
            f'run.cache_dir="{cache_dir}"', f"server.port={free_port()}", "evaluate.rounds=2",
            "evaluate.min_new_tokens=20", 'evaluate.schedule="off"', "evaluate.deploy_speedup=0.0",
            # a long chain the head was not trained for (3 TTT steps): on a CPU each step costs far more than
            # it saves (x0.48 of the baseline with k = 6 on a busy 2-core box), beyond the noise
            "evaluate.k=10", "evaluate.ks=[10]", "evaluate.traffic_window_s=2",
            # the noise bound loose enough that the forced head is deployed on a loaded box (CI once measured two
            # baseline instances more than 30 % apart: "the figures cannot decide"); slower after the handover
            # is then told by the rounds (every round after below every round before)
            "evaluate.instance_spread=0.9"]
    args = [a for s in sets for a in ("--set", s)]
    assert cli("run", TINY, "--no-tui", "--run-dir", run_dir, "--until", "build-target", *args).returncode == 0
    started = cli("server", "start", "--run-dir", run_dir, "--mode", "production")
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        done = cli("run", "--resume", run_dir, "--no-tui")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run = RunDir.open(run_dir)
        result = json.loads(run.production_result.read_text())
        before, after = result["before"], result["after"]
        heldout = [json.loads(line)["id"] for line in run.heldout_prompts.read_text().splitlines()]
        assert before["prompt_ids"] == heldout[: run.profile().evaluate.num_prompts]  # the same requests
        assert before["server"] != after["server"]  # production was stopped by the run and started again
        figures = run.stage_state("deploy-measure")["figures"]
        assert result["with_draft"] is figures["deploy"] and figures["decision"].startswith(
            "deploy:" if figures["deploy"] else "do not deploy:")
        assert ("--speculative-config" in after["argv"]) == result["with_draft"]
        # the demo's windowed head beside its plain Llama: one KV-cache group (compat/vllm_kv_groups.py),
        # in production as in the matrix, which vLLM's own line confirms
        assert (vllm_kv_groups.FLAG in after["argv"]) == result["with_draft"]
        logs = [f.read_text(errors="replace") for f in run.logs_dir.glob("server-*.log")]
        assert any(vllm_kv_groups.FLAG in log and "Hybrid KV cache manager is disabled" in log for log in logs)
        levels = [str(c) for c in sorted(run.profile().evaluate.concurrency)]
        assert sorted(result["speedup"]) == levels
        for c in levels:
            b, a = before["row"]["levels"][c], after["row"]["levels"][c]
            assert result["speedup"][c] == pytest.approx(a["output_tok_s"] / b["output_tok_s"], abs=1e-3)
            for lv in (b, a):  # two rounds, the median's figures; every answer held to 20 tokens at least
                assert len(lv["rounds_tok_s"]) == 2 and lv["output_tok_s"] == min(lv["rounds_tok_s"])
                assert lv["output_tokens"] >= 20 * run.profile().evaluate.num_prompts
        figs = run.stage_state("handover")["figures"]
        assert figs["production_speedup"] == result["speedup"][levels[0]]  # the lowest concurrency's
        assert result["with_draft"] and figures["deploy"], figures["decision"]  # forced in
        assert before["traffic"]["samples"] >= 2 and before["traffic"]["weights"] == {}  # idle production
        slower = [c for c in levels if result["speedup"][c] < 0.1 or (result["speedup_interval"][c][2] < 1
                                                                    and result["speedup"][c] < 0.97)]
        assert slower, f"the head did not lose on this CPU: {result['speedup']} {result['speedup_interval']}"
        assert figs["rolled_back"] is True and figs["slower_levels"] == result["slower_levels"]
        status = json.loads(cli("server", "status", "--run-dir", run_dir, "--json").stdout)
        assert status["mode"] == "production" and status["healthy"]
        assert status["argv"] == before["argv"] and "--speculative-config" not in status["argv"]
        assert figs["same_argv"] is True
        md = cli("notes", "export", run_dir).stdout
        assert "## Production before and after" in md and "production before → after" in md
    finally:
        cli("server", "stop", "--run-dir", run_dir)


def test_production_that_contradicts_the_matrix_is_said_with_what_to_do():
    from pipeline.stages.production import against_matrix
    matrix = {"matrix": {"baseline": {"levels": {"1": {"output_tok_s": 305.6}}},
                         "eagle3": {"levels": {"1": {"output_tok_s": 394.0, "speedup": 1.289}}}}}
    # the reference run: production with the head slower than before, the matrix's head faster
    lines = against_matrix(matrix, "1", 390.4, 0.777, True, "/runs/r")
    assert len(lines) == 2
    assert "x0.78" in lines[0] and "x1.29" in lines[0]
    assert "server start --run-dir /runs/r --mode production" in lines[0]
    assert "390.4" in lines[1] and "305.6" in lines[1] and "28% apart" in lines[1]
    # agreeing figures say nothing; no head deployed: no contradiction to name; integer keys read too
    assert against_matrix(matrix, "1", 310.0, 1.25, True, "/r") == []
    assert len(against_matrix(matrix, "1", 310.0, 0.9, False, "/r")) == 0
    assert against_matrix({"matrix": {"baseline": {"levels": {1: {"output_tok_s": 305.6}}}}}, "1", 390.4, 1.0,
                          False, "/r")[0].startswith("the target without a head")
    assert against_matrix(None, "1", 390.4, 0.5, True, "/r") == []  # no matrix (evaluate.online off)
    # what was deployed is the row compared: a schedule (k = 0 at c = 1, x1.0 there) is no contradiction
    scheduled = {"matrix": {**matrix["matrix"], "eagle3-schedule": {"levels": {"1": {"speedup": 0.99}}}},
                 "deployed": {"row": "eagle3-schedule", "k": 3}}
    assert against_matrix(scheduled, "1", 310.0, 0.95, True, "/r") == []
    assert against_matrix(matrix, "1", 310.0, 0.95, True, "/r")[0].startswith("production with the new head")
