"""One training job across nodes: once the process group is up, every node must hold the same prepared rows
(speculators' sampler packs batches from every row's length) and resume from the epoch rank 0 resumes from.
speculators 0.9.0 saves checkpoints on rank 0 only (checkpointer.py) and every rank resumes from the newest
numbered directory of its own --save-path; a node without node 0's disk would start at epoch 0 while node 0
resumes, and the job would fall apart: rank 0 sends the checkpoint it resumes from to every node whose save
path lacks it (NOTES.md "Several nodes")."""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.layout.checkpoints import epoch_dirs

# Where it hooks in: speculators' distributed setup, whichever runs (gloo on a CPU, its own on an accelerator).
NODE_SYNC = ("speculators.train.cli", "maybe_setup_distributed")
NODES_DISAGREE = "[eagle3-console] the nodes disagree: "


def share_checkpoint_across_nodes() -> list[str]:
    """Wrap speculators' distributed setup so that, once the process group is up, every node holds the same
    rows and resumes from the epoch rank 0 resumes from."""
    module, name = NODE_SYNC
    cli: Any = importlib.import_module(module)
    original = getattr(cli, name, None)
    if original is None:
        raise RuntimeError(f"speculators changed: {module}.{name} no longer exists; "
                           f"pipeline/training/node_sync.py must be updated")

    def setup(*args, **kwargs):  # after speculators_compat.adapt(): on a CPU, original is the gloo setup
        import torch.distributed as dist

        result = original(*args, **kwargs)
        if not dist.is_initialized() or dist.get_world_size() < 2:  # one process: nothing to agree on
            return result
        data, save = _flag_value("--data-path"), _flag_value("--save-path")
        if data:
            _same_rows_everywhere(Path(data))
        if save:
            _sync_resume_point(Path(save))
        return result

    cli.maybe_setup_distributed = setup
    return [f"{module}.{name}"]


def _flag_value(flag: str) -> str | None:
    argv = sys.argv
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def rows_digest(data: Path) -> str:
    """sha256 of the prepared rows' files."""
    h = hashlib.sha256()
    for f in sorted(data.glob("data-*.arrow")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def _same_rows_everywhere(data: Path) -> None:
    import torch.distributed as dist

    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (int(os.environ.get("GROUP_RANK", "0")), rows_digest(data)))
    if len({digest for _, digest in seen}) > 1:  # every rank sees the same list and stops alike
        by_node = sorted({(node, digest) for node, digest in seen})
        print(NODES_DISAGREE + "their prepared rows differ (" + ", ".join(f"node {n}: {d}" for n, d in by_node)
              + "); every node must prepare the same rows: the same profile and data, or node 0's "
              "data/prepared copied to the others", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _sync_resume_point(save: Path) -> None:
    import torch.distributed as dist

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    points: list = [None] * dist.get_world_size()
    own = epoch_dirs(save)  # speculators resumes from the newest
    dist.all_gather_object(points, int(own[-1].name) if own else None)
    want = points[0]
    if all(p == want for p in points):
        return
    needs = points[rank] != want and local == 0  # one writer per node (its ranks share the path)
    if needs:  # a checkpoint of this node's own that node 0 does not resume from: kept aside, not used
        for d in own:
            d.rename(save / f"not-node-0-{d.name}-{time.time_ns()}")
    if want is None:
        dist.barrier()
        return
    src, part = save / str(want), save / f".from-node-0-{want}"
    listing = [sorted(str(f.relative_to(src)) for f in src.rglob("*") if f.is_file()) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    files: list[str] = listing[0] or []
    if needs:
        shutil.rmtree(part, ignore_errors=True)
    size = 0
    for rel in files:
        blob: list = [(src / rel).read_bytes() if rank == 0 else None]
        dist.broadcast_object_list(blob, src=0)
        if needs:
            (part / rel).parent.mkdir(parents=True, exist_ok=True)
            (part / rel).write_bytes(blob[0])
            size += len(blob[0])
    if needs:
        part.rename(src)
        print(f"[eagle3-console] resuming from node 0's epoch {want}: received {len(files)} files "
              f"({size / 2**20:.1f} MiB) into {src}", file=sys.stderr, flush=True)
    dist.barrier()
