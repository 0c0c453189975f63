"""The trainer's process: speculators' version adaptations (pipeline/compat/speculators_compat.py), what the
nodes of one job agree on (node_sync), then speculators' own CLI.

Usage: python -m pipeline.training.launch train <speculators train flags>
       python -m torch.distributed.run … -m pipeline.training.launch train <flags>
"""
from __future__ import annotations

import os
import sys

from pipeline.compat import speculators_compat as sc
from pipeline.training import node_sync

# Online, when the train stage sets it (train.requests_per_worker): each data-loader worker fetches its batch's
# samples through this many requests at once (pipeline/compat/speculators_online.py).
REQUESTS_ENV = "EAGLE3_CONSOLE_REQUESTS_PER_WORKER"


def main(argv: list[str] | None = None) -> None:
    sc.tokenizer_when_no_processor()
    sc.warm_start_in_float32()
    sc.forward_metric_records()
    sc.keep_sub_epoch_checkpoints()
    adapted = sc.adapt()
    node_sync.share_checkpoint_across_nodes()
    requests = int(os.environ.get(REQUESTS_ENV) or 1)
    if requests > 1:
        from pipeline.compat import speculators_online
        print(f"[eagle3-console] online: {speculators_online.install(requests)}", file=sys.stderr, flush=True)
    said = (f"no accelerator: adapted {', '.join(adapted)} for CPU" if adapted
            else f"fused loss: split shared autotuner state {sc.split_fused_autotuner_lists() or 'none found'}")
    print(f"[eagle3-console] {said}", file=sys.stderr, flush=True)
    from speculators.cli import app

    app(args=list(sys.argv[1:] if argv is None else argv), prog_name="speculators")


if __name__ == "__main__":
    main()
