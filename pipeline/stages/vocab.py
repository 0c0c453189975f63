"""vocab: the draft vocabulary (d2t offsets / t2d mask) for the profile's draft vocab size, built by
speculators' own mapping function from the token frequencies that prepare counted."""
from __future__ import annotations

from pathlib import Path

from pipeline import atomicio
from pipeline.results import VocabResult
from pipeline.stages.base import Stage, StageContext, StageError
from pipeline.targetinfo import from_config


class Vocab(Stage):
    name = "vocab"

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.token_freq]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return list(ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size))

    def run(self, ctx: StageContext) -> VocabResult:
        import torch
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        freq = torch.load(ctx.run.token_freq, weights_only=True)
        target_vocab = from_config(ctx.target_dir() / "config.json").vocab  # multimodal wrappers: text_config
        size = ctx.profile.vocab.draft_vocab_size
        if size > target_vocab:
            raise StageError(f"vocab.draft_vocab_size {size} > target vocab size {target_vocab}", resumable=False)
        d2t, t2d = build_vocab_mappings_from_distribution(freq, size, target_vocab)
        d2t_path, t2d_path = ctx.run.vocab_mappings(ctx.profile.vocab.draft_vocab_size)
        atomicio.atomic_write_with(d2t_path, lambda p: _save_npy(p, d2t.numpy()))
        atomicio.atomic_write_with(t2d_path, lambda p: _save_npy(p, t2d.numpy()))
        total = sum(freq.values())
        covered = sum(c for tid, c in freq.items() if t2d[tid])
        return VocabResult.of({"draft_vocab_size": size, "target_vocab_size": target_vocab, "seen_tokens": len(freq),
                               "coverage": round(covered / total, 4) if total else 0.0})


def _save_npy(path: Path, array) -> None:
    import numpy as np

    with open(path, "wb") as fh:  # a file handle: np.save would append ".npy" to a temp path
        np.save(fh, array)
