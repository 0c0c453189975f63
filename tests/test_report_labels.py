"""The run report says what each figure is (issue 43 item 7): every table column has a name, each loss says
which of speculators' three it is (a TTT step's own, the sum over the TTT steps, its epoch mean), and the
n-gram line compares the head's figure with the like of it. The run is written by hand: a train stage's
metric events and pick-checkpoint's result, as the stages write them."""
from __future__ import annotations

import re

import pytest

from pipeline.evaluation import diagnose
from pipeline.layout import atomicio
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, read
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.report import notes, plots
from pipeline.run import jobs
from tests.helpers import TINY

K = 3  # TTT steps


def step_losses(epoch: int, step: int) -> list[float]:
    """Each TTT step's loss of one logged step: later steps higher, falling over training."""
    return [(4.0 + i) / (1 + epoch + step / 10) for i in range(K)]


@pytest.fixture
def trained(tmp_path) -> RunDir:
    run = RunDir.create(load_profile(TINY), tmp_path / "run")
    last: dict = {}
    for epoch in range(2):
        for step in range(5):
            per = step_losses(epoch, step)
            last = {"train/loss": sum(per), **{f"train/loss_{i}": v for i, v in enumerate(per)},
                    **{f"train/full_acc_{i}": 0.5 / (i + 1) for i in range(K)}}
            run.emit("train", "metric", epoch=epoch, step=epoch * 5 + step, **last)
        val = [v * 1.1 for v in step_losses(epoch, 5)]
        run.emit("train", "metric", epoch=epoch, **{"val/loss_epoch": sum(val)},
                 **{f"val/loss_{i}_epoch": v for i, v in enumerate(val)},
                 **{f"val/full_acc_{i}_epoch": 0.4 / (i + 1) for i in range(K)})
    run.update_stage("train", status="done", seconds=1.0,
                     figures={"train_loss": round(last["train/loss"], 4), "val_loss_epoch": round(sum(val), 4)})
    epochs = diagnose.epoch_metrics(run.events())  # what pick-checkpoint puts beside each checkpoint
    picked = [{"label": str(e), "epoch": e, "tau": 1.2 + e / 10, "acceptance_per_position": [0.3, 0.1, 0.05],
               **{k: epochs[e].get(k) for k in ("train_loss", "val_loss", "val_acc")}} for e in sorted(epochs)]
    atomicio.atomic_write_json(run.checkpoints_result, {
        "backend": "offline", "prompts": 4, "k": K, "checkpoints": picked,
        "chosen": {"label": "1", "why": "checkpoint 1 has the best τ"}})
    return run


def tables(md: str) -> list[list[list[str]]]:
    """Every markdown table of the report: its rows of cells, the header first (the |---| line left out)."""
    found, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|(-+\|)+", line):
                current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            found.append(current)
            current = []
    return found


def test_every_column_of_every_table_has_a_name(trained):
    md = notes.to_markdown(trained, jobs.snapshot(trained))
    found = tables(md)
    assert any(t[0][0] == "checkpoint" for t in found)
    for header, *rows in found:
        assert all(header), header  # no empty-headed column
        assert all(len(row) == len(header) for row in rows), header


def test_each_loss_says_which_loss_it_is(trained):
    md = notes.to_markdown(trained, jobs.snapshot(trained))
    header, *rows = next(t for t in tables(md) if t[0][0] == "checkpoint")
    train_col = next(i for i, h in enumerate(header) if h.startswith("train loss"))
    val_col = next(i for i, h in enumerate(header) if h.startswith("val loss"))
    assert "epoch mean" in header[train_col] and "epoch" in header[val_col]
    # the table's train loss is the scale of the sum over the TTT steps, above any one step's loss
    events = [e for e in trained.events() if "train/loss" in e]
    for row in rows:
        epoch = int(row[0])
        sums = [e["train/loss"] for e in events if e["epoch"] == epoch]
        shown = float(row[train_col])
        assert shown == pytest.approx(sum(sums) / len(sums), rel=1e-3)
        assert shown > max(e[f"train/loss_{i}"] for e in events if e["epoch"] == epoch for i in range(K))
    under = md.split("## Choosing the checkpoint", 1)[1].split("|\n\n", 1)[1].split("\n\n")[0]
    assert under.startswith("Losses: both the sum over the TTT steps")  # the line under the table says so
    # the stages table's train_loss is the last logged step's sum: said under that table
    stages_end = md.index("| train | ")
    assert "train_loss: the last logged step's training loss, the sum over the k TTT steps" in md[stages_end:]


def test_every_plot_says_which_loss_it_draws(trained):
    md = notes.to_markdown(trained, jobs.snapshot(trained))
    for name in ("training", "checkpoints"):
        image = md.index(f"![{name}](")
        assert f"*{plots.CAPTIONS[name]}.*" in md[image:image + 800]
    assert "sum over the TTT steps" in plots.CAPTIONS["training"] and "own loss" in plots.CAPTIONS["training"]
    assert "mean over the epoch" in plots.CAPTIONS["checkpoints"]


def test_the_training_plot_draws_the_sum_above_its_ttt_steps(trained, monkeypatch, tmp_path):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    assert plots.training_curves(trained, tmp_path)
    loss_ax = drawn[0].axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in loss_ax.get_lines()}
    total = lines.pop("sum over TTT steps (train/loss)")
    assert sorted(lines) == [f"TTT step {i} alone" for i in range(K)]
    assert total == pytest.approx([sum(step) for step in zip(*lines.values(), strict=True)])
    assert loss_ax.get_yscale() == "log" and "log" in loss_ax.get_ylabel()


def test_the_ngram_line_compares_the_heads_figure_by_its_name():
    offline = read(EvaluateOfflineResult, {"tau": 1.68, "ngram_tau": 2.19, "ngram_tokens_per_step": 1.05})
    line = notes.ngram_comparison(offline, None)
    assert "against the head's 1.680 (its τ: drafting at every step, its tokens per step)" in line
    online = read(DeployMeasureResult, {"tokens_per_step": 1.62, "ngram_tau": 2.0, "ngram_tokens_per_step": 1.1})
    line = notes.ngram_comparison(None, online)
    assert "tokens per step 1.100 against the head's 1.620 (its tokens per step)" in line
    assert f"x{1.62 / 1.1:.2f}" in line
