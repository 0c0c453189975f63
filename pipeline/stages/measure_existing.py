"""measure-existing (evaluate.existing_head, evaluate.existing_policy = "measure" or "deploy"): the head an
operator already has, measured before the run spends anything on a new one. The head is resolved with
speculators' own signals (compat/speculators_heads: a run directory's published head, a speculators head, or a
research-format EAGLE-3 head converted into the run by speculators' converter), checked against the target's
shape, then served through vLLM beside the target alone on the held-out prompts prepare will hold out, at each
evaluate.concurrency with evaluate.k (and the other k of the sweep, and the schedule it leads to, as
deploy-measure serves a new head): τ, acceptance per position, tok/s per level with its spread, the
lossless check at the lowest level, and the deploy decision deploy-measure makes for a new head (the same
functions: stages/benchmark.py). eval/existing.json holds it all; under policy "deploy" a head that clears it
lets the run skip the stages that make a new head (the runner) and the handover deploys it."""
from __future__ import annotations

from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.decision import Decision
from pipeline.layout.results import MeasureExistingResult
from pipeline.layout.rundir import now_iso
from pipeline.stages import heads
from pipeline.stages.base import DECISION_KEYS, Stage, StageContext, StageError, argv_for
from pipeline.stages.benchmark import measure_head, row_levels, sweep_rows
from pipeline.stages.production import heldout_prompt_ids, heldout_sources

ROW = "existing"  # its row in the matrix (deploy-measure's name for the same head), its server's log name


def level_figures(row: dict, base: dict, intervals: dict[int, tuple[float, float, float]]) -> dict:
    """tok/s of the head and of the target alone per level, the rounds' spread, the speedup's interval."""
    out = {}
    for c, level in sorted((row.get("levels") or {}).items(), key=lambda kv: int(kv[0])):
        b = base["levels"].get(c, {})
        entry = {"tok_s": level["output_tok_s"], "baseline_tok_s": b.get("output_tok_s"),
                 "speedup": level.get("speedup")}
        if level.get("rounds_tok_s"):
            entry["rounds_tok_s"] = level["rounds_tok_s"]
        if (iv := intervals.get(int(c))) is not None:
            entry["speedup_lo"], entry["speedup_hi"] = round(iv[1], 4), round(iv[2], 4)
        out[str(c)] = entry
    return out


def policy_line(policy: str, decision: Decision, after_run: str) -> str:
    """What the run does next with the decision, for the notes."""
    if policy == "measure":
        return "the run trains a new head all the same (evaluate.existing_policy = measure)"
    if not decision.deploy:
        return "the run trains a new head (evaluate.existing_policy = deploy: the existing one did not clear)"
    hand = ("the handover puts it into production" if after_run.startswith("production-with-draft") else
            f"server.after_run = {after_run}: the handover puts no head into production")
    return f"the stages that make a new head are skipped (evaluate.existing_policy = deploy); {hand}"


class MeasureExisting(Stage):
    name = "measure-existing"
    # the head it measured and what its decision does (skip training, or not) are carried over with it
    decided_by = (*DECISION_KEYS, "evaluate.existing_head", "evaluate.existing_policy")

    def applies(self, profile) -> bool:
        ev = profile.evaluate
        return profile.train.first_node and bool(ev.existing_head) and ev.existing_policy != "off"

    def outputs(self, ctx: StageContext) -> list[Path]:
        # the head as served, where it was published or converted into the run: the handover deploys it
        head = ctx.run.existing_head_dir
        return [ctx.run.existing_result, *([head] if (head / "config.json").is_file() else [])]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.existing_result, ctx.run.existing_head_dir]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "baseline")  # its matrix starts with the baseline on the serving port

    def run(self, ctx: StageContext) -> MeasureExistingResult:
        ev = ctx.profile.evaluate
        source, head = heads.existing_head(ctx)
        heads.check_served(ctx, head)
        ctx.gather_sources()
        ids, prompts = heldout_prompt_ids(ctx)  # the ones prepare will hold out: the new head's, later
        if not prompts:
            raise StageError("no held-out prompts to measure the existing head on (data.heldout = 0?)",
                             resumable=False)
        k_rows, args = sweep_rows(ctx.profile, ROW, head)
        args[ROW] = {"draft_dir": head}
        methods = ["baseline", *(f"baseline-{i}" for i in range(2, ev.baseline_instances + 1)), ROW, *k_rows]
        sources = heldout_sources(ctx)
        w = measure_head(ctx, ROW, head, "the existing head", methods, args, prompts, ids, ctx.run.existing_result,
                         sources=sources, schedule_sources=sources)
        row, decision, deployed = w.matrix[ROW], w.decision, w.deployed
        skips = decision.deploy and ev.existing_policy == "deploy"
        k = (deployed or {}).get("k") or ev.k  # the largest k of a schedule, as deploy-measure records it
        levels = {} if row.get("error") else level_figures(row, w.base, row_levels(row, w.base))
        atomicio.atomic_write_json(ctx.run.existing_result, {
            "at": now_iso(), "existing_head": ev.existing_head, "kind": source.kind, "source": str(source.head),
            "head": str(head), "k": k, "prompt_ids": ids, **w.written(ctx, len(prompts)), "levels": levels,
            "policy": ev.existing_policy, "skips_training": skips})
        ctx.note(f"the existing head ({ev.existing_head}, {source.kind}): {decision.line}; "
                 f"{policy_line(ev.existing_policy, decision, ctx.profile.server.after_run)}", ctx.log.info)
        figures: dict = {**w.figures(), "existing_head": ev.existing_head, "head": str(head), "kind": source.kind,
                         "k": k, "policy": ev.existing_policy, "skips_training": skips, "prompts": len(prompts),
                         "levels": levels}
        if not row.get("error"):
            lv = row["levels"][w.low]
            figures.update(existing_tok_s=lv["output_tok_s"], speedup=lv.get("speedup"),
                           identical_outputs=row.get("identical_outputs"))
            if lv.get("mean_acceptance_length") is not None:
                figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                               acceptance_per_position=lv["acceptance_per_position"],
                               tokens_per_step=lv.get("tokens_per_step"))
        return MeasureExistingResult.of(figures)
