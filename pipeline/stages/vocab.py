"""vocab: the draft vocabulary (d2t offsets / t2d mask) for the profile's draft vocab size, built by
speculators' own mapping function from the token frequencies that prepare counted — or, on a warm start
(train.from_pretrained, vocab.from_head), the starting head's own: speculators' --from-pretrained replaces
the head's mapping by the files the trainer is given, so they must be the head's for its lm_head rows to
keep their meaning."""
from __future__ import annotations

from pathlib import Path

from pipeline.compat import speculators_heads
from pipeline.data.targetinfo import from_config
from pipeline.layout import atomicio
from pipeline.layout.results import VocabResult
from pipeline.stages import heads
from pipeline.stages.base import Stage, StageContext, StageError


class Vocab(Stage):
    name = "vocab"
    # the mapping it wrote is the starting head's or this run's own: a copy that carries it over cannot change
    # the head trained from (the trainer would re-label the new head's lm_head rows with the old mapping)
    decided_by = ("train.from_pretrained", "vocab.from_head")

    def decided(self, profile) -> tuple[str, ...]:
        return self.decided_by + (("evaluate.existing_head",) if profile.train.from_pretrained == "existing" else ())

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        # the starting head's copy in the run is made by the first stage that asks (heads.start_head): this one
        heads_here = [ctx.run.start_head_dir] + ([ctx.run.existing_head_dir]
                                                 if ctx.profile.train.from_pretrained == "existing" else [])
        return self.outputs(ctx) + heads_here

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.token_freq]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return list(ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size))

    def run(self, ctx: StageContext) -> VocabResult:
        import numpy as np
        import torch
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        freq = torch.load(ctx.run.token_freq, weights_only=True)
        target_vocab = from_config(ctx.target_dir() / "config.json").vocab  # multimodal wrappers: text_config
        size = ctx.profile.vocab.draft_vocab_size
        if size > target_vocab:
            raise StageError(f"vocab.draft_vocab_size {size} > target vocab size {target_vocab}", resumable=False)
        d2t_path, t2d_path = ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size)
        head = heads.start_head(ctx)
        if head is not None and ctx.profile.vocab.from_head and speculators_heads.shape(head).has_t2d:
            try:  # its size is the profile's (checked); its own two halves may still disagree
                speculators_heads.write_vocab_files(head, ctx.run.prepared_dir)
            except speculators_heads.HeadError as exc:
                key, named = ctx.profile.warm_start() or ("train.from_pretrained", str(head))
                raise StageError(f"{key} = {named!r}: {exc}", resumable=False) from None
            t2d = torch.from_numpy(np.load(t2d_path))
            ctx.note(f"the draft vocabulary is the starting head's ({head}): its d2t/t2d kept", ctx.log.info)
        else:
            if head is not None:
                ctx.note(f"the starting head's vocabulary mapping is dropped (vocab.from_head = "
                         f"{str(ctx.profile.vocab.from_head).lower()}, or it has none): built from this run's "
                         f"tokens", ctx.log.warning)
            d2t, t2d = build_vocab_mappings_from_distribution(freq, size, target_vocab)
            atomicio.atomic_write_with(d2t_path, lambda p: _save_npy(p, d2t.numpy()))
            atomicio.atomic_write_with(t2d_path, lambda p: _save_npy(p, t2d.numpy()))
        total = sum(freq.values())
        covered = sum(c for tid, c in freq.items() if t2d[tid])
        return VocabResult.of({"draft_vocab_size": size, "target_vocab_size": target_vocab, "seen_tokens": len(freq),
                               "coverage": round(covered / total, 4) if total else 0.0,
                               "from_head": str(head) if head is not None and ctx.profile.vocab.from_head else None})


def _save_npy(path: Path, array) -> None:
    import numpy as np

    with open(path, "wb") as fh:  # a file handle: np.save would append ".npy" to a temp path
        np.save(fh, array)
