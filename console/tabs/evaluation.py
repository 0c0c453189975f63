"""5 Eval: the training loss, the checkpoint choice and the benchmark matrix."""
from __future__ import annotations

from textual.widgets import TabPane

from console import views
from console.widgets import DiffTable, QuietStatic
from pipeline.layout.results import RunSnapshot
from pipeline.run.runview import RunView

# what decides first, the widest last: at 80 columns the speedup and the lossless check stay on screen
MATRIX_COLUMNS = ("method", "conc.", "speedup", "τ", "lossless", "tok/s", "TTFT ms", "TPOT ms",
                  "acceptance per position")


class EvalTab(TabPane):
    def __init__(self) -> None:
        self.loss, self.checkpoints = QuietStatic(id="loss-curve"), QuietStatic(id="checkpoints", markup=False)
        self.decision = QuietStatic(id="decision", markup=False)  # wraps: never cut at 80 columns
        self.matrix = DiffTable(id="matrix")
        self.matrix.add_columns(*MATRIX_COLUMNS)
        super().__init__("5 Eval", self.loss, self.checkpoints, self.decision, self.matrix, id="eval")

    def show(self, view: RunView, run: RunSnapshot | None = None) -> None:
        if view.train_loss:
            self.loss.show(views.loss_curve(view.train_loss))
        if view.checkpoints:
            self.checkpoints.show(views.checkpoints_text(view.checkpoints))
        if view.evaluation:
            self.decision.show(views.decision_text(view.evaluation, run))
            self.matrix.fill(views.matrix_rows(view.evaluation))
