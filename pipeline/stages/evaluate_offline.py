"""evaluate-offline: greedy chain speculative decoding with the target (transformers) and the trained
head on the held-out prompts: mean acceptance length τ, per-position acceptance, and the lossless
check — every output must equal the target's own greedy output, or the stage fails."""
from __future__ import annotations

import time
from pathlib import Path

from pipeline import atomicio, conversations, diagnose, target
from pipeline.stages.base import Stage, StageContext, StageError, first_difference


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()


class EvaluateOffline(Stage):
    name = "evaluate-offline"

    def applies(self, profile) -> bool:
        """evaluate.offline: off never, on always, auto where the target fits one process (the planner's
        call; a target too large is measured through vLLM only, in deploy-measure)."""
        from pipeline.plan import offline_evaluation
        from pipeline.targetinfo import TargetInfoError, target_info

        if not profile.train.first_node:  # the head is node 0's
            return False
        try:
            return offline_evaluation(profile, target_info(profile))[0]
        except TargetInfoError:
            return profile.evaluate.offline != "off"  # preflight reports the missing config

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.offline_result]

    def run(self, ctx: StageContext) -> dict:
        from pipeline import prompt_lookup, speculative

        ev = ctx.profile.evaluate
        prompts = ctx.heldout_rows()
        bench = OfflineTarget(ctx)
        head = bench.head(ctx.draft_checkpoint())
        total = speculative.SpecStats(k=ev.k)
        ngram = prompt_lookup.Acceptance(per_position=[0] * ev.k)
        per_prompt, mismatches, outputs = [], [], []
        t_spec = t_ref = 0.0
        done = 0
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
                ngram.add(prompt_lookup.acceptance(prompt_ids, ref_on, ev.k, ev.ngram_min, ev.ngram_max,
                                                   ctx.profile.server.max_model_len, emitted=len(ref)))
                same = out == ref
                if not same:
                    mismatches.append({"id": p["id"], "first_difference": first_difference(out, ref)})
                per_prompt.append({"id": p["id"], "tau": round(stats.tau, 4), "tokens": len(out), "lossless": same})
            done += len(batch)
            ctx.progress(self.name, done, len(prompts), "prompts", tau=round(total.tau, 3))
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
        }
        atomicio.atomic_write_json(ctx.run.offline_result, result)
        if mismatches:
            raise StageError(f"lossless check failed: {len(mismatches)}/{len(prompts)} outputs differ from the "
                             f"target's greedy output (first: {mismatches[0]}); see {ctx.run.offline_result}")
        figures = {**{k: result[k] for k in ("tau", "acceptance_per_position", "prompts", "generated_tokens",
                                             "tokens_per_target_forward", "lossless")},
                   "ngram_tau": round(ngram.tau, 4), "ngram_tokens_per_step": round(ngram.tokens_per_step, 4)}
        return figures | diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), acceptance, "offline", outputs)


class OfflineTarget:
    """The target in transformers with its tokenizer, loaded once, and any trained head beside it."""

    def __init__(self, ctx: StageContext):
        self.ev = ctx.profile.evaluate
        self.tok = target.load_tokenizer(ctx.target_dir())
        self.model = target.load_model(ctx.target_dir(), ctx.profile.target.dtype)
        self.eos = eos_ids(self.model)
        self._reader: target.HiddenStateReader | None = None

    def prompt_ids(self, rows: list[dict]) -> list[list[int]]:
        return conversations.prompt_ids(self.tok, rows)

    def head(self, checkpoint: Path):
        from pipeline import speculative

        draft = speculative.load_draft(checkpoint).to(self.model.get_input_embeddings().weight.device)
        proposer = speculative.DraftProposer(draft)
        if self._reader is None:
            self._reader = target.HiddenStateReader(self.model, proposer.aux_ids)
        self._reader.layer_ids = list(proposer.aux_ids)  # the reader's hook stays one per target
        return proposer

    def speculate(self, proposer, ids: list[list[int]]) -> list:
        from pipeline import speculative

        if self._reader is None:
            raise RuntimeError("OfflineTarget.speculate before head(): no reader for the head's layers")
        return speculative.speculative_generate_batch(self._reader, proposer, ids, self.ev.k,
                                                      self.ev.max_new_tokens, self.eos)

    def reference(self, ids: list[list[int]], extra: int = 0) -> list[list[int]]:
        from pipeline import speculative

        return speculative.greedy_reference_batch(self.model, ids, self.ev.max_new_tokens + extra, self.eos)


def ngram_figures(ngram, min_n: int, max_n: int) -> dict:
    """Prompt lookup replayed on the same greedy outputs, counted as vLLM counts it (drafting steps)."""
    return {"tau": round(ngram.tau, 4), "tokens_per_step": round(ngram.tokens_per_step, 4), "drafts": ngram.drafts,
            "accepted": ngram.accepted, "steps": ngram.steps, "min_n": min_n, "max_n": max_n,
            "acceptance_per_position": [round(a / ngram.drafts, 4) if ngram.drafts else 0.0
                                        for a in ngram.per_position]}
