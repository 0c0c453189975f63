"""The deploy decision and the line that explains it come from one measurement: the break-even τ the why
line names and the τ the head reached fall on the same side as the speedup falls of the threshold (issue 24:
a "deploy" at x1.253 was explained by "pays from tau 4.05 (it reached 2.18)")."""
import itertools

import pytest

from pipeline.layout.results import DeployMeasureResult
from pipeline.report.notes import economics
from pipeline.stages.deploy_measure import decide, step_economics

TAUS = [1.0, 1.05, 1.5, 2.18, 3.164, 4.4]
SPEEDUPS = [0.5, 0.737, 0.961, 1.0, 1.099, 1.1, 1.101, 1.253, 1.586, 2.5]


@pytest.mark.parametrize("tau,speedup,threshold", itertools.product(TAUS, SPEEDUPS, [1.0, 1.1, 1.3]))
def test_the_why_line_agrees_with_the_decision(tau, speedup, threshold):
    baseline = {"output_tok_s": 100.0, "tpot_ms": 3.71}
    eagle = {"output_tok_s": 100.0 * speedup, "tpot_ms": 46.2, "tokens_per_step": tau, "speedup": speedup}
    figures = step_economics(baseline, eagle, threshold)
    verdict = decide({1: (speedup, speedup, speedup)}, {1: 1.0}, threshold)
    deploy = verdict.deploy
    assert deploy == (speedup >= threshold) and verdict.line.startswith("deploy:" if deploy else "do not deploy:")
    assert (figures["break_even_tau"] <= tau + 1e-9) == deploy or abs(figures["break_even_tau"] - tau) < 2e-3
    # the step costs it names give back the measured speedup: tau × plain step / step with the head
    assert tau * figures["baseline_step_ms"] / figures["step_ms"] == pytest.approx(speedup, rel=2e-3)
    line = economics(DeployMeasureResult(**figures, tokens_per_step=tau))
    # like with like: the break-even and what the head reached are both tokens per decode step
    assert f"pays from {figures['break_even_tau']:.2f} tokens per step" in line and f"it reached {tau:.2f}" in line


def test_no_speedup_no_economics():
    assert step_economics({"tpot_ms": 3.0}, {"tokens_per_step": 2.0, "speedup": None}, 1.1) == {}
    assert step_economics({"tpot_ms": None}, {"tokens_per_step": 2.0, "speedup": 1.2}, 1.1) == {}


def test_a_level_is_its_median_round_with_the_spread_beside_it():
    from pipeline.stages.served import median_round
    rounds = [{"output_tok_s": t, "tpot_ms": 1000 / t} for t in (394.0, 303.3, 350.0, 401.0)]
    level = median_round(rounds)
    assert level["output_tok_s"] == 350.0 and level["tpot_ms"] == 1000 / 350.0  # one round's, consistent
    assert level["rounds_tok_s"] == [394.0, 303.3, 350.0, 401.0]
    assert median_round(rounds[:1]) is rounds[0] and "rounds_tok_s" not in rounds[0]


def test_min_new_tokens_cannot_exceed_max_new_tokens(tmp_path):
    from pipeline.profile import ProfileError, load_profile
    with pytest.raises(ProfileError, match="evaluate.min_new_tokens"):
        load_profile("tests/profiles/tiny.toml", overrides={"evaluate.min_new_tokens": 65,
                                                            "evaluate.max_new_tokens": 64})
    both = {"evaluate.min_new_tokens": 64, "evaluate.max_new_tokens": 64}
    assert load_profile("tests/profiles/tiny.toml", overrides=both).evaluate.min_new_tokens == 64


def test_tokens_per_step_counts_steps_from_below_twice():
    from pipeline.stages.served import tokens_per_step
    # the H200 run: 395 tokens over 32 answers, vLLM counted 276 accepted (some past the answers' end) and 133 drafts
    assert tokens_per_step({"output_tokens": 395}, 32, 276, 133) == round(363 / 133, 4)
    # n-gram drafts at few steps: decoded − accepted is the larger bound
    assert tokens_per_step({"output_tokens": 395}, 32, 9, 4) == round(363 / 354, 4)
    assert tokens_per_step({"output_tokens": 32}, 32, 0, 0) == 1.0  # nothing decoded after the prefill


def test_a_stream_that_ends_in_an_error_is_not_an_answer():
    """vLLM ends a stream it cannot finish with an error event, then [DONE]; the tokens before it are not an
    answer to time or compare (a local server plays vLLM's failure: it cannot be caused on demand)."""
    import http.server
    import json
    import threading

    from pipeline.serving import client

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in ({"choices": [{"text": "a", "token_ids": [5]}]}, {"error": {"message": "engine died"}}):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            client.stream_complete(f"http://127.0.0.1:{server.server_port}", "target", [1, 2], 8, {})
    finally:
        server.shutdown()


def test_a_level_reads_the_same_before_and_after_json():
    import json

    from pipeline.layout.matrix import level_of
    row = {"levels": {1: {"output_tok_s": 2.0}, 8: {"output_tok_s": 9.0}}}
    back = json.loads(json.dumps(row))  # keys are strings now
    for r in (row, back):
        assert level_of(r, 1) == {"output_tok_s": 2.0} and level_of(r, "8") == {"output_tok_s": 9.0}
        assert level_of(r, 32) == {} and level_of(r, "x") == {}
    assert level_of(None, 1) == {} and level_of({"error": "refused"}, 1) == {}
    from pipeline.stages.deploy_measure import row_levels
    base = {"levels": {"1": {"output_tok_s": 1.0, "baseline_rounds": [1.0]}}}
    for r in (row, back):  # a read-back row decides as the one measured
        assert row_levels(r, base) == {1: (2.0, 2.0, 2.0)}
        assert decide(row_levels(r, base), {1: 1.0}, 1.1).line.startswith("deploy: speedup x2.000")


def test_preflight_warns_that_min_new_tokens_measures_past_the_targets_own_answers():
    from pipeline.planning.preflight import evaluation_findings
    from pipeline.profile import load_profile
    held = load_profile("tests/profiles/tiny.toml", overrides={"evaluate.min_new_tokens": 16, "evaluate.online": True})
    said = [f for f in evaluation_findings(held) if f.severity == "warn"]
    assert len(said) == 1 and "evaluate.min_new_tokens = 16" in said[0].message, said
    own = load_profile("tests/profiles/tiny.toml", overrides={"evaluate.online": True})
    assert not any("min_new_tokens" in f.message for f in evaluation_findings(own))
