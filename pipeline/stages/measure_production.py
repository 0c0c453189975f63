"""measure-production (evaluate.production_before_after): the operator's production server, up on the port
when the run starts (started or adopted through `eagle3-console server`), measured before the run stops it:
the held-out prompts (the same ones prepare will hold out: the last data.heldout conversations' first
turns) at each evaluate.concurrency, greedy, tok/s and time per token. The handover measures production
again on the same requests once it is back, with the new head when the run decided to deploy it; both go
to eval/production.json, the notes and the report (pipeline/stages/production.py)."""
from __future__ import annotations

from pathlib import Path

from pipeline.evaluation import schedule
from pipeline.layout import atomicio
from pipeline.layout.results import MeasureProductionResult
from pipeline.layout.rundir import now_iso
from pipeline.serving import client, ports
from pipeline.stages.base import Stage, StageContext, StageError
from pipeline.stages.production import heldout_prompt_ids, level_summary, measure


class MeasureProduction(Stage):
    name = "measure-production"

    def applies(self, profile) -> bool:
        return profile.train.first_node and profile.evaluate.production_before_after

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.production_before]

    def run(self, ctx: StageContext) -> MeasureProductionResult:
        ctl = ports.controller(ctx.profile)
        rec, status = ctl.record(), ctl.status()
        port = ctx.profile.server.port
        if rec is None or rec.mode != "production" or not status.get("healthy"):
            what = "nothing" if rec is None else f"{rec.describe()}{'' if status.get('healthy') else ', not healthy'}"
            raise StageError(f"evaluate.production_before_after: no healthy production server on port {port} "
                             f"({what}): start or adopt it first (eagle3-console server start --mode production | "
                             f"server adopt)")
        ctx.gather_sources()
        ids, prompts = heldout_prompt_ids(ctx)
        traffic = sample_traffic(ctx, rec)
        row = measure(ctx, rec, prompts)
        atomicio.atomic_write_json(ctx.run.production_before, {
            "at": now_iso(), "server": rec.describe(), "argv": rec.argv, "prompt_ids": ids, "prompts": prompts,
            "row": row, "traffic": traffic})
        return MeasureProductionResult.of({
            "prompts": len(prompts), "server": rec.describe(), "levels": level_summary(row),
            "tok_s": row["levels"][min(ctx.profile.evaluate.concurrency)]["output_tok_s"],
            "traffic": traffic.get("weights") or "idle"})


def sample_traffic(ctx: StageContext, rec) -> dict:
    """The load production carries before the run touches it: vllm:num_requests_running sampled over
    evaluate.traffic_window_s, each sample given to the nearest measured level (deploy-measure weighs the
    levels by it)."""
    ev = ctx.profile.evaluate
    if not ev.traffic_window_s:
        return {}
    ctx.log.info("sampling production's load (vllm:num_requests_running) for %d s", ev.traffic_window_s)
    samples = client.sample_running(rec.base_url, ev.traffic_window_s)
    weights = schedule.traffic_weights(samples, sorted(ev.concurrency))
    busy = [x for x in samples if x >= 0.5]
    above = schedule.share_above(samples, sorted(ev.concurrency))
    ctx.note(f"production's load over {ev.traffic_window_s} s: {len(busy)} of {len(samples)} samples busy"
             + (f", mean {sum(busy) / len(busy):.1f} running; weights " +
                ", ".join(f"c={c} {w:.0%}" for c, w in sorted(weights.items())) if busy else
                " (idle: the decision weighs the levels by evaluate.traffic)")
             + (f"; {schedule.above_text(above, max(samples), sorted(ev.concurrency))}" if above else ""),
             ctx.log.warning if above else ctx.log.info)
    return {"window_s": ev.traffic_window_s, "samples": len(samples), "busy": len(busy),
            "mean_running": round(sum(busy) / len(busy), 3) if busy else 0.0,
            "max_running": max(samples, default=0.0), "weights": {str(c): round(w, 4) for c, w in weights.items()},
            **({"above": round(above, 4)} if above else {})}
