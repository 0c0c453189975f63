"""handover: leave the serving port as the profile says: the production server restarted (with the new
head only when deploy-measure decided "deploy", else without it and the reason recorded) or nothing
running."""
from __future__ import annotations

from pathlib import Path

from pipeline import atomicio, box
from pipeline.decision import Decision
from pipeline.results import DeployMeasureResult, HandoverResult
from pipeline.rundir import now_iso
from pipeline.stages.base import Stage, StageContext


def draft_goes_to_production(decision: Decision | None) -> tuple[bool, str]:
    """Whether `after_run = "production-with-draft"` may put the new head into production: only on the
    benchmark's own decision to deploy; otherwise the reason production keeps running without it."""
    if decision is None:
        return False, "not deployed: no measured decision (deploy-measure did not run; evaluate.online = false?)"
    return decision.deploy, f"{'deployed' if decision.deploy else 'not deployed'}: {decision.line}"


class Handover(Stage):
    name = "handover"

    def applies(self, profile) -> bool:
        return profile.train.first_node and (profile.evaluate.online or profile.extract.backend == "vllm"
                                             or profile.server.after_run != "stop")

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.handover_record]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.handover_record, ctx.run.production_result]  # production before and after it

    def run(self, ctx: StageContext) -> HandoverResult:
        after = ctx.profile.server.after_run
        if after == "stop":
            stopped = box.free_port(ctx.profile, ctx.log.info)
            figures: dict = {"after_run": after, "server": "stopped" if stopped else "none running"}
        else:
            draft, why = None, ""
            if after == "production-with-draft":
                deploy, why = draft_goes_to_production(ctx.run.result(DeployMeasureResult).verdict())
                if deploy:
                    from pipeline.deploy import publish_draft
                    draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
                else:
                    ctx.log.warning("production restarts without the new head: %s", why)
            # owner "": production is the operator's server once handed over (a later cleanup of this
            # run never stops it)
            rec = box.start_mode(ctx.profile, "production", ctx.target_dir(),
                                 log_path=ctx.run.log_path("server-production"), cache_root=ctx.run.cache_root,
                                 say=ctx.log.info, owner="", draft_dir=draft)
            figures = {"after_run": after, "server": "production" + (" with draft" if draft else ""),
                       "pid": rec.pid, "port": rec.port, **({"draft": why} if why else {})}
            if ctx.profile.evaluate.production_before_after:
                from pipeline.stages.production import after as measure_after
                figures |= measure_after(ctx, rec, with_draft=draft is not None)
        atomicio.atomic_write_json(ctx.run.handover_record, {**figures, "at": now_iso()})
        return HandoverResult.of(figures)
