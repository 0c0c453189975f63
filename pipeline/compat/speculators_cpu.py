"""Run `speculators train` on a machine without an accelerator, without editing installed files.

speculators 0.9.0's trainer assumes an accelerator in three places that are fatal on a CPU
(REFERENCE.md §3.3). Only when
`torch.accelerator.is_available()` is false, this launcher adapts them in this process, then hands
over to speculators' own CLI app. On a GPU machine it adapts nothing.

Usage: python -m pipeline.compat.speculators_cpu train <speculators train flags>

Every adapted name is listed in ADAPTED; tests/test_compat.py fails loudly if a speculators release
renames or removes one of them.
"""
from __future__ import annotations

import sys

import torch

# (module, attribute) pairs this module replaces or wraps; checked by the tests.
ADAPTED = [
    ("speculators.train.trainer", "get_local_rank"),   # .to(local_rank) -> "cpu" instead of an accelerator index
    ("speculators.train.trainer", "_StepTimer"),        # calls torch.accelerator.synchronize() per logged step
    ("speculators.train.checkpointer", "get_current_device"),  # resume loads onto "cuda:0" without accelerator
]


def needs_adapting() -> bool:
    return not torch.accelerator.is_available()


def adapt() -> list[str]:
    """Patch speculators' trainer for CPU; return what was adapted (empty on an accelerator)."""
    if not needs_adapting():
        return []
    import importlib

    trainer = importlib.import_module("speculators.train.trainer")
    checkpointer = importlib.import_module("speculators.train.checkpointer")
    for module, attr in ADAPTED:
        if not hasattr(importlib.import_module(module), attr):
            raise RuntimeError(f"speculators changed: {module}.{attr} no longer exists; "
                               f"pipeline/compat/speculators_cpu.py must be updated")

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"

    timer = trainer._StepTimer
    original_mark, original_now = timer.mark, timer.now

    def mark(self, name):  # the same bookkeeping; nothing to synchronize on a CPU
        with _no_accelerator_sync():
            return original_mark(self, name)

    def now(self):
        with _no_accelerator_sync():
            return original_now(self)

    timer.mark, timer.now = mark, now
    # Trainer.device_type stays "cuda", which leaves autocast off (fp32 compute). Deliberately: CPU bf16
    # autocast measured 1,550 ms/step against 215 ms/step in fp32 on the 2-core CI machine (NOTES.md).
    return [f"{m}.{a}" for m, a in ADAPTED]


class _no_accelerator_sync:
    def __enter__(self):
        self._saved = torch.accelerator.synchronize
        torch.accelerator.synchronize = lambda *a, **k: None

    def __exit__(self, *exc):
        torch.accelerator.synchronize = self._saved
        return False


def main(argv: list[str] | None = None) -> None:
    adapted = adapt()
    if adapted:
        print(f"[eagle3-console] no accelerator: adapted {', '.join(adapted)} for CPU", file=sys.stderr,
              flush=True)
    from speculators.cli import app

    app(args=list(sys.argv[1:] if argv is None else argv), prog_name="speculators")


if __name__ == "__main__":
    main()
