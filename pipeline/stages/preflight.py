"""preflight: the run's first stage. Every check of pipeline/planning/preflight.py, written to
RUN/preflight.json and the notes; a blocking finding fails the run before any GPU work. It runs
again on every resume: GPUs, the port and the disk change between attempts."""
from __future__ import annotations

from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.results import PreflightResult
from pipeline.planning import preflight as checks
from pipeline.stages.base import Stage, StageContext, StageError


class Preflight(Stage):
    name = "preflight"
    always_run = True

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.preflight_result]

    def run(self, ctx: StageContext) -> PreflightResult:
        findings = checks.preflight(ctx.profile, run_dir=ctx.run.root)
        atomicio.atomic_write_text(ctx.run.preflight_result, checks.to_json(findings))
        for f in findings:
            ctx.log.info("%s", f.line())
            if f.severity in ("warn", "block"):
                ctx.note(f"preflight {f.severity}: {f.check}: {f.message}")
        if blocked := checks.blocking(findings):
            raise StageError(f"preflight: {len(blocked)} blocking finding(s); first: {blocked[0].check}: "
                             f"{blocked[0].message}",
                             resumable=not any(f.check in checks.PROFILE_ONLY for f in blocked))
        counts = {s: sum(f.severity == s for f in findings) for s in checks.SEVERITIES}
        figures: dict[str, int | str] = {"ok": counts["ok"], "info": counts["info"], "warnings": counts["warn"]}
        if ctx.profile.extract.mode == "auto":  # decided once, at the first attempt, against this run's disk
            earlier = ctx.run.stage_state(self.name).get("figures") or {}
            if earlier.get("extract_mode"):
                figures.update(extract_mode=earlier["extract_mode"], extract_mode_why=earlier["extract_mode_why"])
            else:
                from pipeline.planning.plan import make_plan
                plan = make_plan(ctx.profile, ctx.run.root)
                figures.update(extract_mode=plan.mode, extract_mode_why=plan.mode_why)
        return PreflightResult.of(figures)
