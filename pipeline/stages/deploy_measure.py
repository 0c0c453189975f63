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
from pipeline.evaluation import diagnose
from pipeline.layout import atomicio
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult
from pipeline.serving import vllm_modes
from pipeline.serving.deploy import publish_draft
from pipeline.stages import benchmark, heads  # the matrix's machinery, shared with measure-existing
from pipeline.stages.base import DECISION_KEYS, Stage, StageContext, StageError, argv_for
from pipeline.stages.benchmark import decide, numeric_ties, row_levels, side_by_side_ports  # noqa: F401 (tests)
from pipeline.stages.served import decode_steps


class DeployMeasure(Stage):
    name = "deploy-measure"
    decided_by = DECISION_KEYS

    def applies(self, profile) -> bool:
        return profile.train.first_node and profile.evaluate.online

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir / "config.json"]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        # the existing head's copy, where measure-existing did not make it (a carried measure-existing keeps it)
        # and vocab did not either (train.from_pretrained = "existing": the head the carried mapping is from)
        own = [] if ctx.profile.train.from_pretrained == "existing" else [ctx.run.existing_head_dir]
        return [ctx.run.online_result, ctx.run.draft_dir, *own]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "baseline")  # the matrix starts with the baseline on the serving port

    def run(self, ctx: StageContext) -> DeployMeasureResult:
        ev = ctx.profile.evaluate
        rows = ctx.heldout_rows()
        prompts = conversations.prompt_ids(target.load_tokenizer(ctx.target_dir()), rows)
        draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
        args: dict = {"eagle3": {"draft_dir": draft}}
        if "existing" in ev.methods:
            args["existing"] = {"draft_dir": heads.served_existing(ctx)}
        methods = list(ev.methods) + [f"baseline-{i}" for i in range(2, ev.baseline_instances + 1)]
        if "eagle3" in methods:
            k_rows, row_args = benchmark.sweep_rows(ctx.profile, "eagle3", draft)
            methods += k_rows
            args |= row_args
        w = benchmark.measure_head(ctx, "eagle3", draft, "the new head", methods, args, prompts,
                                   [r["id"] for r in rows], ctx.run.online_result,
                                   sources=[r.get("source", "") for r in rows])
        matrix, low, deployed = w.matrix, w.low, w.deployed
        base_low = matrix["baseline"]["levels"][low]
        eagle = matrix.get("eagle3")
        offline_tau = ctx.run.result(EvaluateOfflineResult).tau
        atomicio.atomic_write_json(ctx.run.online_result,
                                   {"k": ev.k, **w.written(ctx, len(prompts)), "offline_tau": offline_tau})
        if w.failure is not None:
            raise StageError(w.failure)
        figures = {**w.figures(), "offline_tau": offline_tau}
        if deployed is not None:
            figures.update(deployed_k=deployed["k"], schedule=deployed.get("schedule"))
        errors: list[float] = [p.error for pts in w.weighed.get("points", {}).values() for p in pts.values()
                               if p.error is not None]
        if errors:
            worst: float = max(errors, key=abs)  # the largest either way
            figures["prediction_error"] = round(worst, 4)
        if eagle is not None and not eagle.get("error"):
            lv = eagle["levels"][low]
            figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                           acceptance_per_position=lv["acceptance_per_position"], speedup=lv["speedup"],
                           speculative_tok_s=lv["output_tok_s"], identical_outputs=eagle["identical_outputs"],
                           numeric_ties=eagle.get("numeric_ties"), tokens_per_step=lv["tokens_per_step"],
                           **step_economics(base_low, lv, ev.deploy_speedup),
                           **streamed_split(base_low, lv))
            if offline_tau is None:  # the offline evaluator did not compare it with training already
                figures |= diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), lv["acceptance_per_position"],
                                                     "through vLLM", w.baseline_outputs)
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
