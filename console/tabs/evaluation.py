"""5 Eval: the training loss, the checkpoint choice and the benchmark matrix."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static, TabPane

from console import views
from console.widgets import DiffTable
from pipeline.runview import RunView

MATRIX_COLUMNS = ("method", "conc.", "tok/s", "TTFT ms", "TPOT ms", "τ", "acceptance per position", "speedup",
                  "same output")


class EvalTab(TabPane):
    KEYS = ()

    def __init__(self) -> None:
        super().__init__("5 Eval", id="eval")
        self._shown: dict[str | None, object] = {}
        self.loss, self.checkpoints = Static(id="loss-curve"), Static(id="checkpoints", markup=False)
        self.decision = Static(id="decision", markup=False)  # wraps: never cut at 80 columns
        self.matrix = DiffTable(id="matrix")

    def compose(self) -> ComposeResult:
        yield self.loss
        yield self.checkpoints
        yield self.decision
        yield self.matrix

    def on_mount(self) -> None:
        self.matrix.add_columns(*MATRIX_COLUMNS)

    def _set(self, widget: Static, content) -> None:
        """Static.update repaints even when nothing changed; most ticks change nothing here."""
        if self._shown.get(widget.id) != content:
            self._shown[widget.id] = content
            widget.update(content)

    def show(self, view: RunView) -> None:
        if view.train_loss:
            self._set(self.loss, views.loss_curve(view.train_loss))
        if view.checkpoints:
            self._set(self.checkpoints, views.checkpoints_text(view.checkpoints))
        if view.evaluation:
            self._set(self.decision, views.decision_text(view.evaluation))
            self.matrix.fill(views.matrix_rows(view.evaluation))
