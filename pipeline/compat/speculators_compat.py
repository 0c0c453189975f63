"""speculators 0.9.0's version adaptations for `speculators train`, made in the trainer's own process without
editing installed files (pipeline/training/launch.py applies them).

Without an accelerator (NOTES.md "speculators' trainer on CPU"): three places that are fatal on a CPU, plus, under
torchrun, the process-group setup, which derives NCCL from the accelerator: on a CPU it uses gloo.
With an accelerator: the fused Triton loss's two kernels share one autotuner `configs`/`keys` list,
which torch ≥ 2.11's compiler refuses ("ListVariable … is already tracked for mutation",
NOTES.md "On H200s"); the backward kernel gets its own copies. Everywhere: the verifier's processor, which
a multimodal verifier (Kimi-K2.5) cannot load without torchvision, falls back to its tokenizer; and the
trainer's metric records reach the train stage as JSON lines (METRICS_MARK), not as the console text rich
prints them as.

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
# (the head's config and weights) into KEPT_DIR as soon as it is saved (pipeline/layout/checkpoints.py reads them).
SAVE = ("speculators.train.trainer", "Trainer")  # its maybe_save_checkpoint(epoch, local_step)
KEEP_ENV = "EAGLE3_CONSOLE_KEEP_SUB_EPOCH"
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
# Always: a warm start (--from-pretrained) gets the head in the dtype it was saved in — speculators saves in
# hidden_states_dtype, bf16 — and trains those bf16 weights, where a cold start's are built and trained in
# fp32 (measured on the demo: the warm epochs 5.4 s against 3.8 s on a CPU, and an optimizer on bf16 weights
# loses its small updates on a GPU too); the head built from it is made float32, as a cold one is.
WARM_START = ("speculators.train.cli", "build_draft_model")
ALWAYS_ADAPTED = [PROCESSOR, METRICS_SETUP, WARM_START]
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

    from pipeline.layout.atomicio import read_json

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


def warm_start_in_float32() -> None:
    module, name = WARM_START
    cli: Any = importlib.import_module(module)
    if not hasattr(cli, name):
        raise RuntimeError(CHANGED.format(f"{module}.{name}"))
    original = cli.build_draft_model

    def build_draft_model(args, *rest, **kwargs):
        model = original(args, *rest, **kwargs)
        return model.float() if getattr(args, "from_pretrained", None) else model  # d2t/t2d stay integers

    cli.build_draft_model = build_draft_model
