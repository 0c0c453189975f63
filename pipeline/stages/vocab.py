"""vocab: the draft vocabulary (d2t offsets / t2d mask) for the profile's draft vocab size, built by
speculators' own mapping function from the token frequencies that prepare counted."""
from __future__ import annotations

from pathlib import Path

from pipeline import atomicio
from pipeline.stages.base import Stage, StageContext, StageError
from pipeline.stages.prepare import token_freq_path


def mapping_paths(ctx: StageContext) -> tuple[Path, Path]:
    d = ctx.profile.vocab.draft_vocab_size
    return ctx.run.prepared_dir / f"d2t-{d}.npy", ctx.run.prepared_dir / f"t2d-{d}.npy"


class Vocab(Stage):
    name = "vocab"

    def outputs(self, ctx: StageContext) -> list[Path]:
        return list(mapping_paths(ctx))

    def run(self, ctx: StageContext) -> dict:
        import torch
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        from pipeline.targetinfo import from_config

        freq = torch.load(token_freq_path(ctx), weights_only=True)
        target_vocab = from_config(ctx.target_dir() / "config.json").vocab  # multimodal wrappers: text_config
        size = ctx.profile.vocab.draft_vocab_size
        if size > target_vocab:
            raise StageError(f"vocab.draft_vocab_size {size} > target vocab size {target_vocab}", resumable=False)
        d2t, t2d = build_vocab_mappings_from_distribution(freq, size, target_vocab)
        d2t_path, t2d_path = mapping_paths(ctx)
        atomicio.atomic_write_with(d2t_path, lambda p: _save_npy(p, d2t.numpy()))
        atomicio.atomic_write_with(t2d_path, lambda p: _save_npy(p, t2d.numpy()))
        total = sum(freq.values())
        covered = sum(c for tid, c in freq.items() if t2d[tid])
        return {"draft_vocab_size": size, "target_vocab_size": target_vocab, "seen_tokens": len(freq),
                "coverage": round(covered / total, 4) if total else 0.0}


def _save_npy(path: Path, array) -> None:
    import numpy as np

    with open(path, "wb") as fh:  # a file handle: np.save would append ".npy" to a temp path
        np.save(fh, array)
