"""1 Run: every stage, and the current stage's log with a filter."""
from __future__ import annotations

from collections import deque

from textual import on
from textual.binding import Binding
from textual.widgets import Input, Log, TabPane

from console import views
from console.messages import RunPolled
from console.widgets import QuietStatic, StageTable
from pipeline.profile import Profile


class RunTab(TabPane):
    KEYS = (Binding("slash", "filter", "Filter", tooltip="Filter the log"),
            Binding("F", "follow", "Follow", show=False))

    def __init__(self, profile: Profile, stage_count: int):
        self.stages = StageTable(id="stages", stage_count=stage_count)
        self.outcome = QuietStatic(id="outcome", markup=False)  # a run that has ended: its decision, what next
        self.nodes = QuietStatic(id="nodes", markup=False)  # a multi-node job's other nodes (train.node_exporters)
        self.filter = Input(placeholder="filter the log (Enter applies, empty = all)", id="filter")
        self.lines = Log(id="log", max_lines=10_000, auto_scroll=True)
        super().__init__("1 Run", self.stages, self.nodes, self.outcome, self.filter, self.lines, id="run")
        self.profile = profile
        self.log_name: str | None = None
        self.log_buffer: deque[str] = deque(maxlen=10_000)  # every line, for a later filter
        self.log_filter = ""

    def take_log(self, msg: RunPolled, paused: bool) -> None:
        """Keep every new line; show the ones the filter lets through unless paused."""
        if msg.log_name != self.log_name:
            self.log_name = msg.log_name
            self.log_buffer.clear()
            self.lines.clear()
        self.log_buffer.extend(msg.log_lines)
        shown = [line for line in msg.log_lines if self.log_filter in line]
        if shown and not paused:
            self.lines.write_lines(shown)  # batched: one call per tick

    def show(self, msg: RunPolled) -> None:
        self.stages.show(msg.view.stages)
        for widget, text in ((self.outcome, views.outcome(msg.snap, msg.view.evaluation)),
                             (self.nodes, "\n".join(msg.peers))):
            if widget.show(text):
                widget.set_class(bool(text), "visible")

    def action_filter(self) -> None:
        self.filter.add_class("visible")
        self.filter.focus()

    @on(Input.Submitted, "#filter")
    def apply_filter(self, event: Input.Submitted) -> None:
        self.log_filter = event.value
        self.lines.clear()
        self.lines.write_lines([line for line in self.log_buffer if self.log_filter in line])
        if not event.value:
            event.input.remove_class("visible")
        self.lines.focus()

    def action_follow(self) -> None:
        self.lines.auto_scroll = True
        self.lines.scroll_end(animate=False)
