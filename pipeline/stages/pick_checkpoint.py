"""pick-checkpoint (evaluate.checkpoints = "each"): every checkpoint the trainer saved gets τ and per-position
acceptance on the held-out prompts — through the offline evaluator where it runs (the target loaded once,
every head beside it in turn), else through one speculative vLLM server per checkpoint — and the best τ is
the head the run deploys (ties to the earlier checkpoint). speculators picks by validation loss, which says
little about serving acceptance; this measures the acceptance itself.

Each checkpoint's result is written as soon as it is measured (eval/checkpoints.json): a resumed run keeps
every one whose weights are unchanged. It runs after training: with online training the trainer's
extraction server has been released by then (NOTES.md "Choosing the checkpoint")."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data import conversations, target
from pipeline.evaluation import diagnose
from pipeline.evaluation.offline_policy import evaluates_offline
from pipeline.layout import atomicio
from pipeline.layout.checkpoints import Checkpoint, candidates, measures_checkpoints, with_start
from pipeline.layout.results import PickCheckpointResult
from pipeline.layout.rundir import now_iso
from pipeline.serving import client
from pipeline.serving.deploy import publish_draft
from pipeline.stages import heads
from pipeline.stages.base import Stage, StageContext, StageError

if TYPE_CHECKING:
    from pipeline.evaluation.offline_decoding import OfflineTarget


def chosen_path(run) -> str | None:
    picked = atomicio.read_json(run.checkpoints_result)
    try:
        label = (picked.get("chosen") or {}).get("label")
        return next((e["path"] for e in picked["checkpoints"] if e["label"] == label), None)
    except (AttributeError, KeyError, TypeError):  # none yet, or not this stage's file
        return None


def choose(measured: list[dict]) -> dict:
    """The entry with the highest τ; on a tie the earlier one (entries in training order). A head whose offline
    outputs left the target's greedy ones is passed over while any other is lossless (evaluate-offline would
    fail on it)."""
    pool = [e for e in measured if e.get("lossless", True)] or measured
    return max(pool, key=lambda e: e["tau"])  # the first of equals


def why_text(chosen: dict, last: dict, count: int) -> str:
    if chosen["label"] == last["label"]:
        return f"checkpoint {chosen['label']} (the last) has the best τ {chosen['tau']:.3f} of {count}"
    return (f"checkpoint {chosen['label']} has the best τ {chosen['tau']:.3f} of {count}; the last "
            f"({last['label']}) reached {last['tau']:.3f}")


class PickCheckpoint(Stage):
    name = "pick-checkpoint"

    def applies(self, profile) -> bool:
        return measures_checkpoints(profile)

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        """The result file and the chosen head's directory (a changed head makes the stage run again); read
        from the file this attempt wrote, not from the state (whose figures are the last attempt's)."""
        return [ctx.run.checkpoints_result] + ([Path(chosen)] if (chosen := chosen_path(ctx.run)) else [])

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.checkpoints_result, ctx.run.checkpoint_drafts]

    def run(self, ctx: StageContext) -> PickCheckpointResult:
        found = candidates(ctx.run.checkpoints_dir)
        if not found:
            raise StageError(f"{ctx.run.checkpoints_dir}: no complete checkpoint to measure (train has not finished?)")
        start = heads.start_head(ctx)
        if start is not None and not (start / "model.safetensors").is_file():
            ctx.note(f"the starting head {start} is not measured beside the checkpoints (its weights are not one "
                     f"model.safetensors)", ctx.log.warning)
            start = None
        found = with_start(found, start, ctx.profile.evaluate.checkpoints == "each")
        backend = "offline" if evaluates_offline(ctx.profile) else "vllm"
        rows = ctx.heldout_rows()
        kept = self._kept(ctx, backend, len(rows))
        per_epoch = diagnose.epoch_metrics(atomicio.read_jsonl(ctx.run.events_path))
        measurer = OfflineMeasure(ctx, rows) if backend == "offline" else VllmMeasure(ctx, rows)
        measured: list[dict] = []
        reused = 0
        ctx.progress(0, len(found), "checkpoints", force=True)
        for ckpt in found:
            entry = kept.get(ckpt.label)
            if entry is not None and entry.get("fingerprint") == ckpt.fingerprint():
                reused += 1
                entry.update(path=str(ckpt.path), epoch=ckpt.epoch, step=ckpt.step)
            else:
                t0 = time.perf_counter()
                entry = {"label": ckpt.label, "epoch": ckpt.epoch, "step": ckpt.step, "path": str(ckpt.path),
                         "fingerprint": ckpt.fingerprint(), **measurer.measure(ckpt),
                         "seconds": 0.0, "at": now_iso()}
                entry["seconds"] = round(time.perf_counter() - t0, 2)
                ctx.log.info("checkpoint %s: τ %.3f in %.1f s (%s)", ckpt.label, entry["tau"], entry["seconds"],
                             backend)
            epoch = per_epoch.get(ckpt.epoch, {}) if ckpt.step == 0 else {}
            entry.update({k: epoch.get(k) for k in ("train_loss", "val_loss", "val_acc")})
            entry["disagrees"] = bool(epoch.get("val_acc") and entry["acceptance_per_position"]
                                      and diagnose.disagrees(epoch["val_acc"][0], entry["acceptance_per_position"][0]))
            measured.append(entry)
            self._write(ctx, backend, len(rows), measured, None)
            ctx.progress(len(measured), len(found), "checkpoints", tau=entry["tau"], force=True)
        if reused:
            ctx.log.info("kept %d checkpoint measurement(s) from an earlier attempt", reused)
        chosen, last = choose(measured), measured[-1]
        why = why_text(chosen, last, len(measured))
        self._write(ctx, backend, len(rows), measured, {"label": chosen["label"], "why": why})
        ctx.log.info("deploying %s", why)
        ctx.note(f"deploys {why}")
        fresh = [e["seconds"] for e in measured if e.get("seconds")]
        figures = {"checkpoint": chosen["path"], "chosen": chosen["label"], "tau": chosen["tau"],
                   "acceptance_per_position": chosen["acceptance_per_position"], "last": last["label"],
                   "last_tau": last["tau"], "chosen_is_last": chosen["label"] == last["label"],
                   "checkpoints": len(measured), "reused": reused, "backend": backend, "why": why,
                   "seconds_per_checkpoint": round(sum(fresh) / len(fresh), 2) if fresh else None,
                   "taus": " ".join(f"{e['tau']:.2f}" for e in measured)}
        # the deployed head's training-vs-serving check is evaluate-offline's or deploy-measure's (one note)
        return PickCheckpointResult.of(figures)

    @staticmethod
    def _kept(ctx: StageContext, backend: str, prompts: int) -> dict[str, dict]:
        """Entries an earlier attempt measured the same way (same backend, prompts, k, token budget)."""
        earlier = atomicio.read_json(ctx.run.checkpoints_result)
        if not isinstance(earlier, dict):
            return {}
        ev = ctx.profile.evaluate
        same = (earlier.get("backend"), earlier.get("prompts"), earlier.get("k"), earlier.get("max_new_tokens")) == (
            backend, prompts, ev.k, ev.max_new_tokens)
        return {e["label"]: e for e in earlier.get("checkpoints", [])} if same else {}

    @staticmethod
    def _write(ctx: StageContext, backend: str, prompts: int, measured: list[dict], chosen: dict | None) -> None:
        ev = ctx.profile.evaluate
        atomicio.atomic_write_json(ctx.run.checkpoints_result, {
            "backend": backend, "prompts": prompts, "k": ev.k, "max_new_tokens": ev.max_new_tokens,
            "checkpoints": measured, "chosen": chosen})


class OfflineMeasure:
    """The target in transformers once; each head speculates the held-out prompts beside it. The target's
    own greedy outputs are computed once, so that every checkpoint's lossless check is counted too."""

    def __init__(self, ctx: StageContext, rows: list[dict]):
        self.ctx, self.rows = ctx, rows
        self._bench: OfflineTarget | None = None
        self._refs: list[list[int]] | None = None

    def _ready(self) -> OfflineTarget:
        if self._bench is None:
            t0 = time.perf_counter()
            from pipeline.evaluation.offline_decoding import OfflineTarget  # torch: the console imports the stages

            self._bench = OfflineTarget(self.ctx.profile, self.ctx.target_dir())
            self._ids = self._bench.prompt_ids(self.rows)
            t1 = time.perf_counter()
            size = self.ctx.profile.evaluate.batch_size
            self._refs = [r for i in range(0, len(self._ids), size)
                          for r in self._bench.reference(self._ids[i: i + size])]
            self.ctx.log.info("target loaded in %.1f s; its greedy outputs for %d prompts in %.1f s",
                              t1 - t0, len(self._ids), time.perf_counter() - t1)
        return self._bench

    def measure(self, ckpt: Checkpoint) -> dict:
        from pipeline.evaluation import offline_decoding

        bench = self._ready()
        refs = self._refs or []
        head = bench.head(ckpt.path)
        total = offline_decoding.SpecStats(k=self.ctx.profile.evaluate.k)
        size = self.ctx.profile.evaluate.batch_size
        differ = 0
        for i in range(0, len(self._ids), size):
            for (out, stats), ref in zip(bench.speculate(head, self._ids[i: i + size]), refs[i: i + size],
                                         strict=True):
                total.merge(stats)
                differ += out != ref
        return {"tau": round(total.tau, 4), "acceptance_per_position": [round(a, 4) for a in total.acceptance()],
                "lossless": differ == 0, "outputs_differ": differ}


class VllmMeasure:
    """One speculative vLLM server per checkpoint (its head published under eval/checkpoint-drafts/LABEL,
    removed once measured): the held-out prompts at the profile's highest concurrency, τ and acceptance
    per position from /metrics."""

    def __init__(self, ctx: StageContext, rows: list[dict]):
        self.ctx = ctx
        tok = target.load_tokenizer(ctx.target_dir())
        self.prompts = conversations.prompt_ids(tok, rows)

    def measure(self, ckpt: Checkpoint) -> dict:
        ctx, p = self.ctx, self.ctx.profile
        draft = publish_draft(ckpt.path, ctx.run.checkpoint_drafts / ckpt.label, ctx.target_dir())
        concurrency = max(p.evaluate.concurrency)
        try:
            with ctx.server("speculative", name=f"checkpoint-{ckpt.label}", draft_dir=draft) as srv:
                model = p.server.served_model_name
                client.complete(srv.base_url, model, self.prompts[0], 4, {})  # warm-up
                before = client.scrape(srv.base_url)
                level = client.send_all(srv.base_url, model, self.prompts, p.evaluate.max_new_tokens, concurrency)
                spec = client.scrape(srv.base_url) - before
        finally:
            shutil.rmtree(draft, ignore_errors=True)
        if not spec.drafts:
            raise StageError(f"checkpoint {ckpt.label}: the speculative server reported no drafts; see "
                             f"{ctx.run.log_path(f'server-checkpoint-{ckpt.label}')}")
        return {"tau": round(spec.mean_acceptance_length, 4),
                "acceptance_per_position": [round(x, 4) for x in spec.per_position_rate()],
                "server_start_s": srv.start_s, "concurrency": concurrency, "output_tok_s": level["output_tok_s"]}
