"""evaluate-offline: greedy chain speculative decoding with the target (transformers) and the trained
head on the held-out prompts: mean acceptance length τ, per-position acceptance, and the lossless
check — every output must equal the target's own greedy output, or the stage fails."""
from __future__ import annotations

import time
from pathlib import Path

from pipeline.evaluation import diagnose
from pipeline.evaluation.offline_policy import evaluates_offline
from pipeline.layout import atomicio
from pipeline.layout.results import EvaluateOfflineResult
from pipeline.stages.base import Stage, StageContext, StageError, first_difference


class EvaluateOffline(Stage):
    name = "evaluate-offline"

    def applies(self, profile) -> bool:
        return evaluates_offline(profile)

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.offline_result]

    def run(self, ctx: StageContext) -> EvaluateOfflineResult:
        from pipeline.evaluation import offline_decoding, prompt_lookup

        ev = ctx.profile.evaluate
        prompts = ctx.heldout_rows()
        bench = offline_decoding.OfflineTarget(ctx.profile, ctx.target_dir())
        head = bench.head(ctx.draft_checkpoint())
        total = offline_decoding.SpecStats(k=ev.k)
        ngram = prompt_lookup.Acceptance(per_position=[0] * ev.k)
        per_prompt, mismatches, outputs = [], [], []
        by_source: dict[str, offline_decoding.SpecStats] = {}  # a mix's held-out prompts: τ per source
        t_spec = t_ref = 0.0
        for start in range(0, len(prompts), ev.batch_size):
            batch = prompts[start: start + ev.batch_size]
            ids = bench.prompt_ids(batch)
            t0 = time.perf_counter()
            results = bench.speculate(head, ids)
            t1 = time.perf_counter()
            # k tokens past max_new_tokens: what vLLM's last step verifies n-gram's drafts against
            longer = bench.reference(ids, extra=ev.k)
            refs = [r[: ev.max_new_tokens] for r in longer]
            outputs += refs
            t_ref += time.perf_counter() - t1
            t_spec += t1 - t0
            for p, prompt_ids, (out, stats), ref, ref_on in zip(batch, ids, results, refs, longer, strict=True):
                total.merge(stats)
                if "source" in p:
                    by_source.setdefault(p["source"], offline_decoding.SpecStats(k=ev.k)).merge(stats)
                ngram.add(prompt_lookup.acceptance(prompt_ids, ref_on, ev.k, ev.ngram_min, ev.ngram_max,
                                                   ctx.profile.server.max_model_len, emitted=len(ref)))
                same = out == ref
                if not same:
                    mismatches.append({"id": p["id"], "first_difference": first_difference(out, ref)})
                per_prompt.append({"id": p["id"], "tau": round(stats.tau, 4), "tokens": len(out), "lossless": same,
                                   **({"source": p["source"]} if "source" in p else {})})
            ctx.progress(start + len(batch), len(prompts), "prompts", tau=round(total.tau, 3))
        acceptance = [round(a, 4) for a in total.acceptance()]
        result = {
            "k": ev.k, "prompts": len(prompts), "tau": round(total.tau, 4),
            "acceptance_per_position": acceptance,
            "rounds": total.rounds, "accepted": total.accepted, "generated_tokens": total.generated,
            "target_forwards": total.target_forwards,
            "tokens_per_target_forward": round(total.generated / total.target_forwards, 4),
            "lossless": not mismatches, "mismatches": mismatches, "per_prompt": per_prompt,
            "batch_size": ev.batch_size, "seconds_speculative": round(t_spec, 3),
            "seconds_greedy_reference": round(t_ref, 3),
            "ngram": ngram_figures(ngram, ev.ngram_min, ev.ngram_max),
            "per_source": {src: {"prompts": sum(1 for e in per_prompt if e.get("source") == src),
                                 "tau": round(st.tau, 4),
                                 "acceptance_per_position": [round(a, 4) for a in st.acceptance()]}
                           for src, st in sorted(by_source.items())},
        }
        atomicio.atomic_write_json(ctx.run.offline_result, result)
        if mismatches:
            raise StageError(f"lossless check failed: {len(mismatches)}/{len(prompts)} outputs differ from the "
                             f"target's greedy output (first: {mismatches[0]}); see {ctx.run.offline_result}")
        figures = {**{k: result[k] for k in ("tau", "acceptance_per_position", "prompts", "generated_tokens",
                                             "tokens_per_target_forward", "lossless")},
                   "ngram_tau": round(ngram.tau, 4), "ngram_tokens_per_step": round(ngram.tokens_per_step, 4)}
        gap = diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), acceptance, "offline", outputs)
        return EvaluateOfflineResult.of(figures | gap)


def ngram_figures(ngram, min_n: int, max_n: int) -> dict:
    """Prompt lookup replayed on the same greedy outputs, counted as vLLM counts it (drafting steps)."""
    return {"tau": round(ngram.tau, 4), "tokens_per_step": round(ngram.tokens_per_step, 4), "drafts": ngram.drafts,
            "accepted": ngram.accepted, "steps": ngram.steps, "min_n": min_n, "max_n": max_n,
            "acceptance_per_position": [round(a / ngram.drafts, 4) if ngram.drafts else 0.0
                                        for a in ngram.per_position]}
