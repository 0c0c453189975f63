"""PNG plots of a run for the report: training loss and accuracy per TTT step over steps, τ per checkpoint,
acceptance per position per method, GPU utilization over the run's timeline. Read-only over the run's files.

speculators logs three losses that differ in scale (speculators/models/eagle3/core.py, metrics.py, train/
trainer.py): train/loss_i, TTT step i's loss alone; train/loss, a logged step's sum over the k TTT steps (the
figure the console and the train stage show); val/loss_epoch, the same sum averaged over the validation split.
The report's epoch means average train/loss over an epoch's logged steps (pipeline/evaluation/diagnose.py). Every plot
says which one it draws."""
from __future__ import annotations

from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.matrix import level_of
from pipeline.layout.results import EvaluateOfflineResult
from pipeline.layout.rundir import RunDir


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def training_curves(run: RunDir, out: Path) -> Path | None:
    metrics = [e for e in atomicio.read_jsonl(run.events_path)
               if e.get("stage") == "train" and e.get("kind") == "metric" and any(k.startswith("train/") for k in e)]
    if not metrics:
        return None
    steps = list(range(1, len(metrics) + 1))
    ttt = sorted({int(k.rsplit("_", 1)[1]) for e in metrics for k in e if k.startswith("train/loss_")})
    fig, (ax1, ax2) = _plt().subplots(1, 2, figsize=(11, 3.8))
    if any("train/loss" in e for e in metrics):  # the sum drawn over its parts: the two scales side by side
        ax1.plot(steps, [e.get("train/loss") for e in metrics], color="black", lw=1.2,
                 label="sum over TTT steps (train/loss)")
    for i in ttt:
        ax1.plot(steps, [e.get(f"train/loss_{i}") for e in metrics], label=f"TTT step {i} alone", lw=1)
        ax2.plot(steps, [e.get(f"train/full_acc_{i}") for e in metrics], label=f"TTT step {i}", lw=1)
    ax1.set(title="training loss of each logged step", xlabel="logged step", ylabel="loss (log scale)", yscale="log")
    ax2.set(title="full accuracy per TTT step", xlabel="logged step", ylabel="accuracy", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "training.png")


def acceptance(run: RunDir, out: Path) -> Path | None:
    series: dict[str, list[float]] = {}
    if offline := run.result(EvaluateOfflineResult).acceptance_per_position:
        series["eagle3 (offline)"] = offline
    if res := atomicio.read_json(run.online_result):
        low = min(res["concurrency"])
        for method, row in res["matrix"].items():
            if per_position := level_of(row, low).get("acceptance_per_position"):
                series[f"{method} (vLLM)"] = per_position
    if not series:
        return None
    fig, ax = _plt().subplots(figsize=(7, 3.8))
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(values))], values, width, label=name)
    k = max(len(v) for v in series.values())
    ax.set_xticks([i + 0.4 - width / 2 for i in range(k)], [f"position {i + 1}" for i in range(k)])
    ax.set(title="acceptance per draft position", ylabel="accepted / verify steps", ylim=(0, 1))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "acceptance.png")


def checkpoints(run: RunDir, out: Path) -> Path | None:
    """τ per checkpoint (pick-checkpoint) beside each epoch's training and validation loss."""
    picked = atomicio.read_json(run.checkpoints_result)
    entries = (picked or {}).get("checkpoints") or []
    if not entries:
        return None
    fig, ax = _plt().subplots(figsize=(9, 3.8))
    xs = list(range(len(entries)))
    ax.plot(xs, [e["tau"] for e in entries], "o-", color="tab:blue", label="τ (held-out prompts)")
    chosen = (picked.get("chosen") or {}).get("label")
    for x, e in zip(xs, entries, strict=True):
        if e["label"] == chosen:
            ax.plot([x], [e["tau"]], "*", ms=16, color="tab:red", label=f"deployed: {chosen}")
    ax.set(title="τ per checkpoint against the training losses", xlabel="checkpoint", ylabel="τ")
    ax.set_xticks(xs, [e["label"] for e in entries], rotation=45 if len(xs) > 12 else 0)
    ax.grid(alpha=0.3)
    loss = ax.twinx()
    for key, style, name in (("train_loss", "s--", "train loss (epoch mean)"), ("val_loss", "^--", "val loss (epoch)")):
        if pts := [(x, e[key]) for x, e in zip(xs, entries, strict=True) if e.get(key) is not None]:
            loss.plot([p[0] for p in pts], [p[1] for p in pts], style, color="grey", lw=1, ms=4, label=name,
                      alpha=0.8 if key == "train_loss" else 0.5)
    loss.set_ylabel("loss (sum over TTT steps)")
    handles = ax.get_legend_handles_labels()[0] + loss.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    return _save(fig, out / "checkpoints.png")


def gpu_timeline(run: RunDir, out: Path) -> Path | None:
    samples = atomicio.read_jsonl(run.gpu_timeline)
    if not samples:
        return None
    t0 = samples[0]["t"]
    fig, ax = _plt().subplots(figsize=(11, 3.2))
    for idx in sorted({int(k) for s in samples for k in s["util"]}):
        ax.plot([s["t"] - t0 for s in samples], [s["util"].get(str(idx)) for s in samples], lw=1, label=f"GPU {idx}")
    for e in atomicio.read_jsonl(run.events_path):
        if e.get("kind") == "start" and e.get("t", 0) >= t0:
            ax.axvline(e["t"] - t0, color="grey", lw=0.5)
            ax.text(e["t"] - t0, 101, e["stage"], fontsize=7, rotation=45)
    ax.set(title="GPU utilization over the run", xlabel="seconds", ylabel="%", ylim=(0, 100))
    ax.legend(fontsize=8)
    return _save(fig, out / "gpu_utilization.png")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomicio.atomic_write_with(path, lambda p: fig.savefig(p, dpi=110, bbox_inches="tight", format="png"))
    _plt().close(fig)
    return path


CAPTIONS = {
    "training": "Left: the training loss of each logged step, the sum over the TTT steps (train/loss, as the "
                "console shows it) above each TTT step's own loss, on a log scale; right: each TTT step's full "
                "accuracy on the step's batch",
    "checkpoints": "τ of each checkpoint on the held-out prompts against its epoch's losses, both the sum over "
                   "the TTT steps: train, the mean over the epoch's logged steps; val, over the validation split",
    "acceptance": "The share of verify steps that accepted each draft position (offline, and through vLLM at "
                  "the lowest concurrency)",
    "gpu": "GPU utilization over the run, the stages' starts marked",
}


def all_plots(run: RunDir, out: Path) -> dict[str, Path]:
    kinds = (("training", training_curves), ("checkpoints", checkpoints), ("acceptance", acceptance),
             ("gpu", gpu_timeline))
    return {name: path for name, plot in kinds if (path := plot(run, out))}
