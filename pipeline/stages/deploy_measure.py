"""deploy-measure: serve the target without and then with the new EAGLE-3 head through real vLLM,
send the held-out prompts greedily to each, and read the spec-decode counters of /metrics before and
after: mean acceptance length 1 + Δaccepted/Δdrafts, per-position acceptance, output tokens/s. The
outputs with and without speculation must be identical; a mismatch fails the stage."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline import atomicio, box, conversations, online, target
from pipeline.deploy import publish_draft
from pipeline.stages.base import Stage, StageContext, StageError
from pipeline.stages.prepare import heldout_path


def result_path(ctx: StageContext) -> Path:
    return ctx.run.eval_dir / "online.json"


def draft_dir(ctx: StageContext) -> Path:
    return ctx.run.root / "deploy" / "draft"


def measure(ctx: StageContext, stage: str, mode: str, prompts: list[list[int]], **mode_args) -> dict:
    p = ctx.profile
    t0 = time.perf_counter()
    rec = box.start_mode(p, mode, ctx.target_dir(), ctx.run.log_path(f"server-{mode}"), ctx.run.root / ".cache",
                         ctx.log.info, **mode_args)
    start_s = time.perf_counter() - t0
    ctx.emit("server", stage, mode=mode, pid=rec.pid, port=rec.port, start_s=round(start_s, 1))
    headers = online.auth_headers("")
    try:
        online.complete(rec.base_url, p.server.served_model_name, prompts[0], 4, headers)  # warm-up
        before = online.scrape(rec.base_url)
        outputs, tokens = [], 0
        t1 = time.perf_counter()
        for i, ids in enumerate(prompts):
            out = online.complete(rec.base_url, p.server.served_model_name, ids, p.evaluate.max_new_tokens, headers)
            outputs.append(out["token_ids"])
            tokens += out["completion_tokens"]
            ctx.progress(stage, i + 1, len(prompts), f"prompts ({mode})")
        seconds = time.perf_counter() - t1
        delta = online.scrape(rec.base_url) - before
    finally:
        box.free_port(p, ctx.log.info)
    return {"mode": mode, "server_start_s": round(start_s, 1), "seconds": round(seconds, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "outputs": outputs, "spec": delta}


class DeployMeasure(Stage):
    name = "deploy-measure"

    def applies(self, profile) -> bool:
        return profile.evaluate.online

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [result_path(ctx), draft_dir(ctx) / "config.json"]

    def run(self, ctx: StageContext) -> dict:
        ev = ctx.profile.evaluate
        tok = target.load_tokenizer(ctx.target_dir())
        rows = [json.loads(l) for l in heldout_path(ctx).read_text().splitlines() if l.strip()][: ev.num_prompts]
        if not rows:
            raise StageError(f"{heldout_path(ctx)}: no held-out prompts")
        prompts = [conversations.render_ids(tok, r["messages"], add_generation_prompt=True) for r in rows]
        draft = publish_draft(ctx.draft_checkpoint(), draft_dir(ctx), ctx.target_dir())
        base = measure(ctx, self.name, "baseline", prompts)
        spec = measure(ctx, self.name, "speculative", prompts, draft_dir=draft)
        counters = spec["spec"]
        mismatches = [rows[i]["id"] for i, (a, b) in enumerate(zip(base["outputs"], spec["outputs"])) if a != b]
        offline = ctx.run.stage_state("evaluate-offline").get("figures", {})
        result = {
            "k": ev.k, "prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
            "baseline": {k: v for k, v in base.items() if k not in ("outputs", "spec")},
            "speculative": {k: v for k, v in spec.items() if k not in ("outputs", "spec")},
            "mean_acceptance_length": round(counters.mean_acceptance_length, 4),
            "acceptance_rate": round(counters.acceptance_rate, 4),
            "acceptance_per_position": [round(x, 4) for x in counters.per_position_rate()],
            "drafts": counters.drafts, "draft_tokens": counters.draft_tokens, "accepted": counters.accepted,
            "speedup": round(spec["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
            if base["output_tokens_per_s"] else None,
            "offline_tau": offline.get("tau"), "identical_outputs": not mismatches, "mismatches": mismatches,
        }
        atomicio.atomic_write_json(result_path(ctx), result)
        if counters.drafts <= 0:
            raise StageError("the speculative server reported no drafts: is the head loaded? "
                             f"see {ctx.run.log_path('server-speculative')}")
        if mismatches:
            raise StageError(f"outputs with and without speculation differ for {len(mismatches)}/{len(prompts)} "
                             f"prompts (first: {mismatches[0]}); see {result_path(ctx)}")
        return {k: result[k] for k in ("mean_acceptance_length", "acceptance_per_position", "speedup",
                                       "offline_tau", "identical_outputs")} | {
            "baseline_tok_s": base["output_tokens_per_s"], "speculative_tok_s": spec["output_tokens_per_s"]}
