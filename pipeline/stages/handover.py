"""handover: leave the serving port as the profile says: the production server restarted (with the new
head only when deploy-measure decided "deploy", else without it and the reason recorded; with the existing head
instead where evaluate.existing_policy = "deploy" skipped making a new one, on measure-existing's decision) or
nothing running."""
from __future__ import annotations

from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.decision import Decision
from pipeline.layout.results import DeployMeasureResult, HandoverResult
from pipeline.layout.rundir import now_iso
from pipeline.serving import ports
from pipeline.serving.server import ServerError
from pipeline.stages.base import Stage, StageContext, StageError, existing_clears


def draft_goes_to_production(decision: Decision | None) -> tuple[bool, str]:
    """Whether `after_run = "production-with-draft…"` may put the new head into production: only on the
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
            stopped = ports.stop_server_on_port(ctx.profile, ctx.log.info, own_run=str(ctx.run.root))
            figures: dict = {"after_run": after, "server": "stopped" if stopped else "none running"}
        else:
            draft, why, spec, decision = None, "", {}, None
            existing = existing_clears(ctx.run, ctx.profile)
            if after.startswith("production-with-draft"):
                # no new head was made (evaluate.existing_policy = deploy): the existing one, on its own decision
                decision = (existing.verdict() if existing is not None
                            else ctx.run.result(DeployMeasureResult).verdict())
                deploy, why = draft_goes_to_production(decision)
                rolled = ctx.run.stage_state(self.name).get("rolled_back") or {}
                if deploy and decision is not None and rolled.get("decision") == decision.line:
                    # an attempt killed after it rolled this head back: the head stays out on the same decision
                    deploy, why = False, f"not deployed: rolled back by an earlier attempt ({rolled.get('why')})"
                if deploy and existing is not None:
                    draft = existing_draft(ctx, Path(existing.head or ""))
                    spec = deployed_spec(atomicio.read_json(ctx.run.existing_result))
                    why = f"{why} (the existing head {existing.existing_head or existing.head}, measured first)"
                elif deploy:
                    from pipeline.serving.deploy import publish_draft
                    draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
                    spec = deployed_spec(atomicio.read_json(ctx.run.online_result))
                elif existing is None:
                    ctx.log.warning("production restarts without the new head: %s", why)
            rec = start_production(ctx, draft, spec)
            figures = {"after_run": after, "server": "production" + (" with draft" if draft else ""),
                       "pid": rec.pid, "port": rec.port, **({"draft": why} if why else {}),
                       **({"deployed_k": spec.get("k"), "schedule": spec.get("schedule"),
                           "head": "existing" if existing is not None else "new"} if draft else {})}
            if ctx.profile.evaluate.production_before_after:
                from pipeline.stages.production import after as measure_after
                figures |= measure_after(ctx, rec, with_draft=draft is not None)
                if draft is not None and figures.get("slower_levels"):
                    figures |= slower_after(ctx, after, figures["slower_levels"], decision)
        atomicio.atomic_write_json(ctx.run.handover_record, {**figures, "at": now_iso()})
        return HandoverResult.of(figures)


def existing_draft(ctx: StageContext, head: Path) -> Path:
    """The existing head measure-existing measured, at the run's published head's place (RunDir.draft_dir) as a
    new head would be; where it was served from outside the run (weights publishing does not copy), from there."""
    from pipeline.serving.deploy import FILES, publish_draft

    if not all((head / name).is_file() for name in FILES):
        if not (head / "config.json").is_file():
            raise StageError(f"{head}: the existing head measure-existing measured is gone (run --resume "
                             f"{ctx.run.root} --from measure-existing measures it again)")
        return head
    return publish_draft(head, ctx.run.draft_dir, ctx.target_dir())


def deployed_spec(online: dict | None) -> dict:
    """The k (and the k per batch size) deploy-measure (or measure-existing, for the existing head) decided to
    deploy: {} = evaluate.k everywhere."""
    deployed = (online or {}).get("deployed") or {}
    return {key: deployed[key] for key in ("k", "schedule") if deployed.get(key)}


def start_production(ctx: StageContext, draft: Path | None, spec: dict):
    """Production on the port, the operator's server once handed over (owner "": a later cleanup of this run
    never stops it). With a head that does not come up, production is started again without it before the
    stage fails, so that the port is never left empty by the handover."""
    def start(head: Path | None, spec: dict):
        rec = ports.start_production(ctx.profile, ctx.run, ctx.target_dir(), ctx.log.info, draft_dir=head, **spec)
        ctx.run.update_state(production_stopped=None)  # production serves again (run/runner.py production_back)
        return rec
    try:
        return start(draft, spec)
    except ServerError as exc:
        if draft is None:
            raise StageError(f"production did not come back: {exc}") from None
        ctx.note(f"production with the new head did not come up ({exc}); starting it again without the head",
                 ctx.log.warning)
        try:
            rec = start(None, {})
        except ServerError as again:
            raise StageError(f"production did not come up with the new head ({exc}) nor without it: {again}") \
                from None
        raise StageError(f"production did not come up with the new head: {exc}; it serves without the head again "
                         f"(pid {rec.pid}, port {rec.port})") from None


def slower_after(ctx: StageContext, after: str, slower: list[str], decision: Decision | None) -> dict:
    """Production measured slower with the head than before at some level, beyond the noise: said; with
    after_run = "production-with-draft-or-rollback", production put back as it was before the run (the
    operator's argv, no head), checked against the argv measure-production recorded."""
    ctx.note(f"production with the new head is slower than before at {', '.join(slower)} (beyond "
             f"evaluate.instance_spread = {ctx.profile.evaluate.instance_spread:g})", ctx.log.warning)
    if after != "production-with-draft-or-rollback":
        return {"rolled_back": False}
    # before production is touched: a resume of an attempt killed from here on keeps the head out
    ctx.run.update_stage(ctx.stage, rolled_back={"decision": decision.line if decision else "",
                                                 "why": f"slower at {', '.join(slower)}"})
    rec = start_production(ctx, None, {})
    before = (atomicio.read_json(ctx.run.production_before) or {}).get("argv")
    same = before is None or before == rec.argv
    ctx.note(f"rolled back: production serves without the head again (pid {rec.pid}, port {rec.port}"
             + ("" if same else "; its argv differs from the one measured before the run: "
                f"{' '.join(rec.argv)}") + ")", ctx.log.warning)
    return {"rolled_back": True, "server": "production (rolled back)", "pid": rec.pid, "same_argv": same}
