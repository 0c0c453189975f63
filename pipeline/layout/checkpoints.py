"""The trainer's checkpoints on disk: which are complete, which a kill left half-written, and the candidates
pick-checkpoint measures. speculators writes one directory per epoch (`checkpoints/N/`); a sub-epoch
checkpoint (--checkpoint-freq < 1) goes into the same directory and is overwritten by the next one, so
with evaluate.checkpoints = "each" the trainer's launcher copies each as it is saved into
`checkpoints/kept/N-stepS/` (pipeline/compat/speculators_compat.py) — the head's config and weights only,
what evaluation and vLLM read."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.compat.speculators_compat import KEPT_DIR as KEPT
from pipeline.layout import atomicio


def epoch_dirs(save_path: Path) -> list[Path]:
    if not save_path.is_dir():
        return []
    return sorted((p for p in save_path.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()),
                  key=lambda p: int(p.name))


def training_state(path: Path) -> dict | None:
    state = atomicio.read_json(path / "training_state.json")
    return state if isinstance(state, dict) and "epoch" in state else None


def weights_readable(path: Path) -> bool:
    try:
        from safetensors import safe_open
        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            fh.keys()
    except Exception:  # noqa: BLE001 - any unreadable piece means incomplete
        return False
    return True


def epoch_complete(path: Path) -> bool:
    """speculators writes training_state.json after the weights, optimizer and scheduler, so a
    parsable one marks the directory complete; weights must also be a readable safetensors file."""
    return (training_state(path) is not None and weights_readable(path)
            and (path / "optimizer_state_dict.pt").is_file())


def quarantine_incomplete(save_path: Path, log) -> list[str]:
    moved = []
    for path in epoch_dirs(save_path):
        if not epoch_complete(path):
            dest = save_path / "incomplete" / f"{path.name}-{int(time.time())}"
            dest.parent.mkdir(exist_ok=True)
            path.rename(dest)
            log.warning("moved half-written checkpoint %s aside to %s", path, dest)
            moved.append(path.name)
    return moved


def final_checkpoint(save_path: Path) -> Path | None:
    return next((p for p in reversed(epoch_dirs(save_path)) if epoch_complete(p)), None)


@dataclass(frozen=True)
class Checkpoint:
    """One candidate head: `label` "3" (epoch 3's end) or "3-step40" (epoch 3 after 40 of its steps)."""
    label: str
    epoch: int
    step: int  # steps into the epoch; 0 = the epoch's end
    path: Path

    @property
    def order(self) -> tuple[int, float]:
        return self.epoch, self.step or float("inf")

    def fingerprint(self) -> str:
        """Changes when the weights do (a re-trained epoch) or move (an epoch's directory that now holds its
        end, where a kept copy holds the step measured): a measurement is only reused while it holds."""
        st = (self.path / "model.safetensors").stat()
        return f"{self.path}:{st.st_size}:{st.st_mtime_ns}"


def candidates(save_path: Path) -> list[Checkpoint]:
    """Every complete checkpoint the trainer saved, in training order: each epoch's end and each kept
    sub-epoch copy. An epoch directory that still holds a sub-epoch checkpoint (training stopped mid-epoch)
    counts as that step."""
    found: dict[str, Checkpoint] = {}
    for path in epoch_dirs(save_path):
        state = training_state(path)
        if state is None or not epoch_complete(path):
            continue
        step = int(state.get("local_step") or 0)
        label = path.name if step == 0 else f"{path.name}-step{step}"
        found[label] = Checkpoint(label, int(path.name), step, path)
    for name in kept_sub_epoch(save_path):
        path = save_path / KEPT / name
        if (state := training_state(path)) is not None and weights_readable(path):
            found.setdefault(name, Checkpoint(name, int(state["epoch"]), int(state["local_step"]), path))
    return sorted(found.values(), key=lambda c: c.order)


START = "start"  # the warm start's head among the candidates (train.from_pretrained)


def measures_checkpoints(profile) -> bool:
    """pick-checkpoint runs (node 0): every checkpoint with evaluate.checkpoints = "each"; with a warm start
    the starting head beside the last (or every) checkpoint, so that what is deployed is never worse than
    where the training started."""
    return profile.train.first_node and (profile.evaluate.checkpoints == "each" or bool(profile.train.from_pretrained))


def with_start(found: list[Checkpoint], start: Path | None, every: bool) -> list[Checkpoint]:
    """The candidates pick-checkpoint measures: every checkpoint (`every`) or the last, after the warm start's
    head (label "start", epoch -1) where there is one."""
    chosen = found if every else found[-1:]
    return ([Checkpoint(START, -1, 0, start)] if start is not None else []) + chosen


def kept_sub_epoch(save_path: Path) -> list[str]:
    kept = save_path / KEPT
    return sorted(p.name for p in kept.iterdir() if not p.name.startswith(".")) if kept.is_dir() else []
