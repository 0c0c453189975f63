"""handover: leave the serving port as the profile says: the production server restarted (with or
without the new head) or nothing running."""
from __future__ import annotations

from pathlib import Path

from pipeline import atomicio, box
from pipeline.rundir import now_iso
from pipeline.stages.base import Stage, StageContext


def record_path(ctx: StageContext) -> Path:
    return ctx.run.root / "server-handover.json"


class Handover(Stage):
    name = "handover"

    def applies(self, profile) -> bool:
        return profile.evaluate.online or profile.extract.backend == "vllm" or profile.server.after_run != "stop"

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [record_path(ctx)]

    def run(self, ctx: StageContext) -> dict:
        after = ctx.profile.server.after_run
        if after == "stop":
            stopped = box.free_port(ctx.profile, ctx.log.info)
            figures = {"after_run": after, "server": "stopped" if stopped else "none running"}
        else:
            draft = None
            if after == "production-with-draft":
                from pipeline.stages.deploy_measure import draft_dir
                from pipeline.deploy import publish_draft
                draft = publish_draft(ctx.draft_checkpoint(), draft_dir(ctx), ctx.target_dir())
            rec = box.start_mode(ctx.profile, "production", ctx.target_dir(), ctx.run.log_path("server-production"),
                                 ctx.run.root / ".cache", ctx.log.info, draft_dir=draft)
            figures = {"after_run": after, "server": "production" + (" with draft" if draft else ""),
                       "pid": rec.pid, "port": rec.port}
        atomicio.atomic_write_json(record_path(ctx), {**figures, "at": now_iso()})
        return figures
