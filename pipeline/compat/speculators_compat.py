"""Run `speculators train` where speculators 0.9.0 does not run as released, without editing
installed files; this launcher adapts names in its own process, then hands over to speculators' CLI.

Without an accelerator (NOTES.md "speculators' trainer on CPU"): three places that are fatal on a CPU, plus, under
torchrun, the process-group setup, which derives NCCL from the accelerator: on a CPU it uses gloo.
With an accelerator: the fused Triton loss's two kernels share one autotuner `configs`/`keys` list,
which torch ≥ 2.11's compiler refuses ("ListVariable … is already tracked for mutation",
NOTES.md "On H200s"); the backward kernel gets its own copies. Everywhere: the verifier's processor, which
a multimodal verifier (Kimi-K2.5) cannot load without torchvision, falls back to its tokenizer; and the
trainer's metric records reach the train stage as JSON lines (METRICS_MARK), not as the console text rich
prints them as.

Usage: python -m pipeline.compat.speculators_compat train <speculators train flags>
       python -m torch.distributed.run … -m pipeline.compat.speculators_compat train <flags>

Every adapted name is listed in ADAPTED (CPU) or ALWAYS_ADAPTED; tests/test_compat.py fails loudly if a
speculators release renames or removes one of them.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

# (module, attribute) pairs this module replaces or wraps; checked by the tests.
ADAPTED = [
    ("speculators.train.trainer", "get_local_rank"),   # .to(local_rank) -> "cpu" instead of an accelerator index
    ("speculators.train.trainer", "_StepTimer"),        # calls torch.accelerator.synchronize() per logged step
    ("speculators.train.checkpointer", "get_current_device"),  # resume loads onto "cuda:0" without accelerator
    ("speculators.train.cli", "maybe_setup_distributed"),  # NCCL from the accelerator; gloo on a CPU
]
# Always (speculators 0.9.0): the verifier's processor, which speculators loads to pick the draft's mask
# token; a multimodal verifier's (Kimi-K2.5) needs torchvision, which is not installed.
PROCESSOR = ("speculators.train.utils", "load_processor")
# When the run asks for it (evaluate.checkpoints = "each" with train.checkpoint_freq < 1): speculators 0.9.0
# (trainer.py, Trainer.train_epoch → maybe_save_checkpoint(epoch, local_step)) writes a sub-epoch checkpoint
# into its epoch's directory, where the next one overwrites it; wrapped, each is copied
# (the head's config and weights) into KEPT_DIR as soon as it is saved (pipeline/checkpoints.py reads them).
SAVE = ("speculators.train.trainer", "Trainer")  # its maybe_save_checkpoint(epoch, local_step)
KEEP_ENV = "EAGLE3_CONSOLE_KEEP_SUB_EPOCH"
# Online, when the train stage sets it (train.requests_per_worker): each data-loader worker fetches its batch's
# samples through this many requests at once (pipeline/compat/speculators_online.py).
REQUESTS_ENV = "EAGLE3_CONSOLE_REQUESTS_PER_WORKER"
KEPT_DIR = "kept"
HEAD_FILES = ("config.json", "model.safetensors")
# Always: the trainer's metric records (dicts on the "speculators.metrics" logger, trainer.py) reach the train
# stage as they are, one JSON line each on stdout behind METRICS_MARK (rank 0), instead of the rich console
# line they are printed as. A handler added after speculators' CLI configures that logger (dictConfig
# removes a logger's handlers), by wrapping the CLI's setup_metric_logger.
METRICS_SETUP = ("speculators.train.cli", "setup_metric_logger")
METRICS_LOGGER = "speculators.metrics"
METRICS_FILTERS = ("speculators.train.logger", ("IsMappingFilter", "IsRank0Filter", "_flatten_dict"))
METRICS_MARK = "@eagle3-console:metrics "
# Always, under torchrun across nodes: speculators 0.9.0 saves checkpoints on rank 0 only (checkpointer.py)
# and every rank resumes from the newest numbered directory of its own --save-path; a node without node 0's
# disk would start at epoch 0 while node 0 resumes, and the job would fall apart. After the process group is
# up, rank 0 sends the checkpoint it resumes from to every node whose save path lacks it.
NODE_SYNC = ("speculators.train.cli", "maybe_setup_distributed")
ALWAYS_ADAPTED = [PROCESSOR, METRICS_SETUP, NODE_SYNC]
# With an accelerator: the fused loss kernels whose shared autotuner lists are split.
FUSED_KERNELS = ("speculators.losses.fused", ("loss_forward_kernel", "loss_backward_kernel"))
CHANGED = "speculators changed: {} no longer exists; pipeline/compat/speculators_compat.py must be updated"


def adapt() -> list[str]:
    """Patch speculators' trainer for CPU; return what was adapted (empty on an accelerator)."""
    import torch

    if torch.accelerator.is_available():
        return []
    # modules reached by name and patched: typed Any, their attributes are what ADAPTED checks
    trainer: Any = importlib.import_module("speculators.train.trainer")
    checkpointer: Any = importlib.import_module("speculators.train.checkpointer")
    for module, attr in ADAPTED:
        if not hasattr(importlib.import_module(module), attr):
            raise RuntimeError(CHANGED.format(f"{module}.{attr}"))

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"

    timer = trainer._StepTimer  # the same bookkeeping; nothing to synchronize on a CPU (each call, as a decorator)
    timer.mark, timer.now = _no_accelerator_sync()(timer.mark), _no_accelerator_sync()(timer.now)
    cli: Any = importlib.import_module("speculators.train.cli")
    cli.maybe_setup_distributed = _setup_distributed_on_cpu
    # Trainer.device_type stays "cuda", which leaves autocast off (fp32 compute). Deliberately: CPU bf16
    # autocast measured 1,550 ms/step against 215 ms/step in fp32 on the 2-core CI machine (NOTES.md).
    return [f"{m}.{a}" for m, a in ADAPTED]


def _setup_distributed_on_cpu(sp_size: int = 1) -> None:
    """speculators' maybe_setup_distributed with gloo and no device: the same module state, set the
    same way, so its getters (rank, world size, data-parallel groups) answer as under NCCL."""
    import torch.distributed as dist
    from speculators.train import distributed as sd

    sd._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    sd._is_distributed = "LOCAL_RANK" in os.environ
    if not sd._is_distributed:
        return
    dist.init_process_group("gloo")
    sd._rank, sd._world_size = dist.get_rank(), dist.get_world_size()
    sd._init_sp_process_groups(sd._rank, sd._world_size, sp_size)
    print(f"[eagle3-console] gloo process group: rank {sd._rank} of {sd._world_size}", file=sys.stderr, flush=True)


def tokenizer_when_no_processor() -> str:
    """speculators resolves the draft's mask token through `AutoProcessor` of the verifier. For a
    multimodal verifier such as Kimi-K2.5 (KimiK25ForConditionalGeneration) that loads the image
    processor, which needs torchvision (not installed: it pulls a CUDA torch, README); the mask token
    only needs the tokenizer, so that is used when the processor cannot load."""
    module, name = PROCESSOR
    utils = importlib.import_module(module)
    original = getattr(utils, name, None)
    if original is None:
        raise RuntimeError(CHANGED.format(f"{module}.{name}"))

    def load_processor(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - ImportError, ValueError, OSError from the image processor
            from transformers import AutoTokenizer
            print(f"[eagle3-console] {path}: processor unavailable ({type(exc).__name__}: {str(exc)[:120]}); "
                  f"using its tokenizer", file=sys.stderr, flush=True)
            return AutoTokenizer.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))

    setattr(utils, name, load_processor)
    return f"{module}.{name}"


def split_fused_autotuner_lists() -> list[str]:
    """Give each fused-loss kernel's autotuner its own list and dict objects (GPU only: Triton)."""
    import copy

    try:
        fused = importlib.import_module(FUSED_KERNELS[0])
    except ImportError:  # no Triton: the eager loss is used anyway
        return []
    first, *others = (getattr(fused, name) for name in FUSED_KERNELS[1])
    split = []
    for kernel in others:
        for attr, value in list(vars(kernel).items()):
            if isinstance(value, (list, dict)) and value is vars(first).get(attr):
                setattr(kernel, attr, copy.copy(value))
                split.append(f"{kernel.fn.__name__ if hasattr(kernel, 'fn') else kernel}.{attr}")
    return split


@contextlib.contextmanager
def _no_accelerator_sync():
    import torch

    saved = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.accelerator.synchronize = saved


def keep_copy(save_path: Path, epoch: int, local_step: int) -> Path | None:
    """Copy epoch `epoch`'s checkpoint, just saved at `local_step` of its epoch, to KEPT_DIR/EPOCH-stepSTEP
    (built aside, renamed into place: a kill leaves a hidden temporary, never a half copy)."""
    import shutil

    from pipeline.atomicio import read_json

    src = save_path / str(epoch)
    state = read_json(src / "training_state.json")
    if state is None or state.get("local_step") != local_step:
        return None  # unreadable, or speculators skipped this save (too close to the epoch's end)
    dest = save_path / KEPT_DIR / f"{epoch}-step{local_step}"
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in HEAD_FILES:
        shutil.copy2(src / name, tmp / name)
    (tmp / "training_state.json").write_text(json.dumps(state))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def keep_sub_epoch_checkpoints() -> list[str]:
    """Wrap Trainer.maybe_save_checkpoint so that rank 0 copies each sub-epoch checkpoint once it is saved."""
    if not os.environ.get(KEEP_ENV):
        return []
    trainer_cls: Any = getattr(importlib.import_module(SAVE[0]), SAVE[1], None)
    if trainer_cls is None or not hasattr(trainer_cls, "maybe_save_checkpoint"):
        raise RuntimeError(CHANGED.format(f"{SAVE[0]}.{SAVE[1]}.maybe_save_checkpoint"))
    original = trainer_cls.maybe_save_checkpoint

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        original(self, epoch, local_step=local_step)
        if isinstance(epoch, int) and local_step > 0 and getattr(self, "rank", 0) == 0:
            try:
                kept = keep_copy(Path(self.checkpointer.path), epoch, local_step)
            except OSError as exc:  # a full disk loses this copy, not the training
                print(f"[eagle3-console] could not keep sub-epoch checkpoint {epoch}-step{local_step}: {exc}",
                      file=sys.stderr, flush=True)
                return
            if kept is not None:
                print(f"[eagle3-console] kept sub-epoch checkpoint {kept}", file=sys.stderr, flush=True)

    trainer_cls.maybe_save_checkpoint = maybe_save_checkpoint
    return [f"{SAVE[1]}.maybe_save_checkpoint"]


def metrics_record(line: str) -> dict[str, float] | None:
    """A metric record of the trainer's from one line of its output (None for any other line): keys as
    speculators flattens them ("train/loss", "val/full_acc_0_epoch", "epoch", "global_step"), full
    precision."""
    _, mark, rest = line.partition(METRICS_MARK)
    try:
        record = json.loads(rest) if mark else None
    except ValueError:
        return None
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float))} if isinstance(record, dict) else None


def forward_metric_records() -> list[str]:
    """After speculators' CLI sets its metric logger up, add a handler that writes each record (rank 0)."""
    import logging

    cli: Any = importlib.import_module(METRICS_SETUP[0])
    module = importlib.import_module(METRICS_FILTERS[0])
    if not hasattr(cli, METRICS_SETUP[1]) or not all(hasattr(module, n) for n in METRICS_FILTERS[1]):
        raise RuntimeError(CHANGED.format(f"one of {(METRICS_SETUP[1], *METRICS_FILTERS[1])}"))
    is_mapping, is_rank0, flatten = (getattr(module, n) for n in METRICS_FILTERS[1])
    out = sys.stdout

    class Records(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "hparams", False):  # the run's configuration (log_run_config), not a metric
                return
            try:
                msg: Any = record.msg  # a mapping: the IsMappingFilter let it through
                out.write(METRICS_MARK + json.dumps(flatten(dict(msg)), default=_number) + "\n")
                out.flush()
            except Exception:  # noqa: BLE001 - a record the stage cannot read is left out, never the training
                pass

    original = cli.setup_metric_logger

    def setup_metric_logger(*args, **kwargs):
        original(*args, **kwargs)
        handler = Records()
        handler.addFilter(is_mapping())
        handler.addFilter(is_rank0())
        logging.getLogger(METRICS_LOGGER).addHandler(handler)

    cli.setup_metric_logger = setup_metric_logger
    return [f"{METRICS_SETUP[0]}.{METRICS_SETUP[1]}"]


def _number(value):
    """A tensor or numpy scalar as a float; anything else as its text (then not a metric)."""
    return float(value.item()) if hasattr(value, "item") else str(value)


def resume_point(save: Path) -> int | None:
    """The epoch speculators' checkpointer resumes from in `save` (its newest numbered directory), None
    for a fresh start."""
    if not save.is_dir():
        return None
    epochs = [int(d.name) for d in save.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
    return max(epochs, default=None)


def share_checkpoint_across_nodes() -> list[str]:
    """Wrap speculators' distributed setup (whichever runs: gloo on a CPU, its own on an accelerator) so that,
    once the process group is up, every node resumes from the epoch rank 0 resumes from."""
    module, name = NODE_SYNC
    cli: Any = importlib.import_module(module)
    original = getattr(cli, name, None)
    if original is None:
        raise RuntimeError(CHANGED.format(f"{module}.{name}"))

    def setup(*args, **kwargs):  # after adapt(): on a CPU, original is the gloo setup
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


NODES_DISAGREE = "[eagle3-console] the nodes disagree: "


def rows_digest(data: Path) -> str:
    """sha256 of the prepared rows' files (speculators' sampler packs batches from every row's length: every
    node must hold the same rows)."""
    import hashlib

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
    import shutil

    import torch.distributed as dist

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    points: list = [None] * dist.get_world_size()
    dist.all_gather_object(points, resume_point(save))
    want = points[0]
    if all(p == want for p in points):
        return
    needs = resume_point(save) != want and local == 0  # one writer per node (its ranks share the path)
    if needs:  # a checkpoint of this node's own that node 0 does not resume from: kept aside, not used
        import time
        for d in [d for d in save.iterdir() if d.name.isdigit()] if save.is_dir() else []:
            d.rename(save / f"not-node-0-{d.name}-{time.time_ns()}")
    if want is None:
        dist.barrier()
        return
    listing = [sorted(str(f.relative_to(save / str(want))) for f in (save / str(want)).rglob("*") if f.is_file())
               if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    files: list[str] = listing[0] or []
    part = save / f".from-node-0-{want}"
    if needs:
        shutil.rmtree(part, ignore_errors=True)
    size = 0
    for rel in files:
        blob: list = [(save / str(want) / rel).read_bytes() if rank == 0 else None]
        dist.broadcast_object_list(blob, src=0)
        if needs:
            (part / rel).parent.mkdir(parents=True, exist_ok=True)
            (part / rel).write_bytes(blob[0])
            size += len(blob[0])
    if needs:
        part.rename(save / str(want))
        print(f"[eagle3-console] resuming from node 0's epoch {want}: received {len(files)} files "
              f"({size / 2**20:.1f} MiB) into {save / str(want)}", file=sys.stderr, flush=True)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    tokenizer_when_no_processor()
    forward_metric_records()
    keep_sub_epoch_checkpoints()
    adapted = adapt()
    share_checkpoint_across_nodes()
    requests = int(os.environ.get(REQUESTS_ENV) or 1)
    if requests > 1:
        from pipeline.compat import speculators_online
        print(f"[eagle3-console] online: {speculators_online.install(requests)}", file=sys.stderr, flush=True)
    said = (f"no accelerator: adapted {', '.join(adapted)} for CPU" if adapted
            else f"fused loss: split shared autotuner state {split_fused_autotuner_lists() or 'none found'}")
    print(f"[eagle3-console] {said}", file=sys.stderr, flush=True)
    from speculators.cli import app

    app(args=list(sys.argv[1:] if argv is None else argv), prog_name="speculators")


if __name__ == "__main__":
    main()
