"""deploy-measure: the benchmark matrix through real vLLM. For each method of the profile — baseline
(no speculation), ngram (prompt lookup), existing (a head named in the profile), eagle3 (the head this
run trained) — one server at a time serves the held-out prompts greedily at each concurrency level:
output tokens/s, time per output token, and from /metrics (two scrapes) the mean acceptance length
1 + Δaccepted/Δdrafts and the per-position acceptance; speedup against the baseline at the same
concurrency. Outputs with speculation must equal the baseline's (checked at the lowest concurrency); for
the new head a mismatch fails the stage. A method vLLM refuses becomes a row that says why."""
from __future__ import annotations

from pathlib import Path

from pipeline.data import conversations, target
from pipeline.evaluation import diagnose, schedule
from pipeline.layout import atomicio
from pipeline.layout.decision import Decision
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, MeasureExistingResult
from pipeline.serving import vllm_modes
from pipeline.serving.deploy import publish_draft
from pipeline.stages.base import Stage, StageContext, StageError, argv_for

# The matrix's machinery, shared with measure-existing (stages/benchmark.py); again_alone, numeric_ties and
# side_by_side_ports only for the tests that know them from here
from pipeline.stages.benchmark import (  # noqa: F401
    again_alone,
    cannot_decide,
    compare_rows,
    decide,
    head_failure,
    measure_all,
    numeric_ties,
    pooled_baseline,
    row_levels,
    schedule_row,
    settle,
    settled_noise,
    side_by_side_ports,
    sweep_rows,
    traffic_of,
    traffic_text,
    weigh,
)
from pipeline.stages.served import decode_steps


class DeployMeasure(Stage):
    name = "deploy-measure"

    def applies(self, profile) -> bool:
        return profile.train.first_node and profile.evaluate.online

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir / "config.json"]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "baseline")  # the matrix starts with the baseline on the serving port

    def run(self, ctx: StageContext) -> DeployMeasureResult:
        ev = ctx.profile.evaluate
        rows = ctx.heldout_rows()
        prompts = conversations.prompt_ids(target.load_tokenizer(ctx.target_dir()), rows)
        draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
        # the existing head as measure-existing served it (a run's published head, a converted one), where it ran
        existing = ctx.run.result(MeasureExistingResult).head or ev.existing_head
        args: dict = {"eagle3": {"draft_dir": draft}, "existing": {"draft_dir": Path(existing)}}
        ks = schedule.sweep_ks(ctx.profile)
        methods = list(ev.methods) + [f"baseline-{i}" for i in range(2, ev.baseline_instances + 1)]
        if "eagle3" in methods:
            k_rows, row_args = sweep_rows(ctx.profile, "eagle3", draft)
            methods += k_rows
            args |= row_args
        matrix = measure_all(ctx, methods, prompts, args, sources=[r.get("source", "") for r in rows])
        if matrix["baseline"].get("error"):
            raise StageError(f"baseline server failed: {matrix['baseline']['error']}")
        noise = settled_noise(ctx, matrix, prompts, args)
        base = pooled_baseline(matrix)
        weights, how = traffic_of(ctx, sorted(ev.concurrency))
        weighed = weigh(ctx, matrix, base, ks, weights, "eagle3")
        if weighed.get("schedule_row"):
            row = schedule_row("eagle3")
            measure_all(ctx, [row], prompts, {row: {"draft_dir": draft, **weighed["schedule_row"]}}, matrix)
            weighed = settle(ctx, matrix, base, weighed, weights, "eagle3")
        low = min(ev.concurrency)
        # failures: mismatches that are not near-ties of the target's own
        mismatches, failures = compare_rows(matrix, [r["id"] for r in rows], low, ev.tie_logprob_gap)
        base_low = matrix["baseline"]["levels"][low]
        baseline_outputs = base_low["outputs"]
        for row in matrix.values():
            for level in row.get("levels", {}).values():
                level.pop("outputs", None)
        eagle = matrix.get("eagle3")
        offline_tau = ctx.run.result(EvaluateOfflineResult).tau
        failure = head_failure(ctx, matrix, "eagle3", "the new head", low, failures, len(prompts),
                               ctx.run.online_result)
        deployed = weighed.get("deployed")
        if failure is not None:  # a head that failed its own checks is not deployed, whatever its speed
            decision = Decision(False, failure)
        elif not noise["decides"]:
            decision = cannot_decide(noise, ev.instance_spread)
        elif deployed is None:
            decision = Decision(False, weighed["why"])
        else:
            decision = decide(row_levels(matrix[deployed["row"]], base), weights, ev.deploy_speedup,
                              deployed["what"], traffic_text(weights, how))
        verdict = {"decision": decision.line, "deploy": decision.deploy, "reason": decision.reason}
        m = schedule.mix(row_levels(matrix[deployed["row"]], base), weights) if deployed else None
        atomicio.atomic_write_json(ctx.run.online_result, {
            "k": ev.k, "prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
            "min_new_tokens": ev.min_new_tokens, "rounds": ev.rounds,
            "concurrency": sorted(ev.concurrency), "matrix": matrix, "mismatches": mismatches,
            "mismatches_beyond_ties": failures, "tie_logprob_gap": ev.tie_logprob_gap,
            "offline_tau": offline_tau, "sweep": weighed.get("sweep", {}), "schedule": weighed.get("schedule"),
            "deployed": deployed if decision.deploy else None, "considered": deployed,
            "traffic": {"weights": {str(c): round(w, 4) for c, w in weights.items()}, "from": how},
            "expected_speedup": m and {"median": round(m.expected, 4), "lo": round(m.lo, 4), "hi": round(m.hi, 4)},
            "instances": noise, **verdict})
        if failure is not None:
            raise StageError(failure)
        figures = {**verdict, "offline_tau": offline_tau, "baseline_tok_s": base_low["output_tok_s"],
                   "instance_spread": noise["spread"], "traffic": traffic_text(weights, how)}
        if m is not None:
            figures.update(expected_speedup=round(m.expected, 4), expected_speedup_lo=round(m.lo, 4),
                           expected_speedup_hi=round(m.hi, 4))
        if deployed is not None:
            figures.update(deployed_k=deployed["k"], schedule=deployed.get("schedule"))
        errors: list[float] = [p.error for pts in weighed.get("points", {}).values() for p in pts.values()
                               if p.error is not None]
        if errors:
            worst: float = max(errors, key=abs)  # the largest either way
            figures["prediction_error"] = round(worst, 4)
        if eagle is not None and not eagle.get("error"):
            lv = eagle["levels"][low]
            figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                           acceptance_per_position=lv["acceptance_per_position"], speedup=lv["speedup"],
                           speculative_tok_s=lv["output_tok_s"], identical_outputs=eagle["identical_outputs"],
                           tokens_per_step=lv["tokens_per_step"],
                           **step_economics(base_low, lv, ev.deploy_speedup),
                           **streamed_split(base_low, lv))
            if offline_tau is None:  # the offline evaluator did not compare it with training already
                figures |= diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), lv["acceptance_per_position"],
                                                     "through vLLM", baseline_outputs)
        ngram = matrix.get("ngram", {}).get("levels", {}).get(low, {})
        if ngram.get("mean_acceptance_length") is not None:
            steps = decode_steps(ngram["output_tokens"] - ngram.get("requests", len(prompts)), ngram["accepted"],
                                 ngram["drafts"])
            figures.update(ngram_tau=ngram["mean_acceptance_length"], ngram_tokens_per_step=ngram["tokens_per_step"],
                           ngram_draft_share=round(ngram["drafts"] / steps, 4) if steps > 0 else 1.0)
        return DeployMeasureResult.of(figures)


def streamed_split(baseline: dict, eagle: dict) -> dict:
    """Where a request's time goes, streamed: the first token's wait and the decode after it, with the head
    and without. The decode alone is what a draft can speed up; the first token's wait (prefill, the
    request's own overheads) it cannot, so short answers dilute a decode speedup."""
    keys = ("ttft_ms", "decode_tpot_ms", "chunk_ms")
    if any(baseline.get(k) is None or eagle.get(k) is None for k in keys):
        return {}
    out = {k: eagle[k] for k in keys} | {f"baseline_{k}": baseline[k] for k in keys}
    if eagle["decode_tpot_ms"]:
        out["decode_speedup"] = round(baseline["decode_tpot_ms"] / eagle["decode_tpot_ms"], 3)
    return out


def step_economics(baseline: dict, eagle: dict, threshold: float) -> dict:
    """A decode step's cost with the head against a plain one, from the same measurement as the speedup it
    explains: the head's tokens/s over the baseline's is τ × plain step / head step (τ: tokens per step), so a
    step with the head costs τ / speedup plain steps, and the head reaches the deploy threshold from
    τ × threshold / speedup — on the side of τ that the speedup is of the threshold, by construction.
    The plain step is the baseline's time per output token."""
    speedup, tau, plain = eagle.get("speedup"), eagle.get("tokens_per_step"), baseline.get("tpot_ms")
    if not speedup or not tau or not plain:
        return {}
    return {"step_ms": round(plain * tau / speedup, 3), "baseline_step_ms": plain,
            "break_even_tau": round(threshold * tau / speedup, 3), "deploy_speedup": threshold,
            "gpu": vllm_modes.accelerator_available()}
