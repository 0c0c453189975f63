"""1 Run: every stage, the result once decided, and the current stage's log with a filter; Enter or `l` on a
stage opens its log (and its servers') in the pager."""
from __future__ import annotations

from collections import deque

from textual import on
from textual.binding import Binding
from textual.widgets import DataTable, Input, Log, TabPane

from console import views
from console.messages import RunPolled
from console.widgets import QuietStatic, StageTable
from pipeline.profile import Profile


class RunTab(TabPane):
    KEYS = (Binding("slash", "filter", "Filter", tooltip="Filter the log"),
            Binding("F", "follow", "Follow", show=False),
            # not in the footer (80 columns are full): the log pane's title says it
            Binding("l", "open_log", "Stage log", show=False))

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
        self._cursor_to_log = False
        self._placed_row = 0  # where the tab last put the cursor: anywhere else, the operator put it

    def take_log(self, msg: RunPolled, paused: bool) -> None:
        """Keep every new line; show the ones the filter lets through unless paused."""
        if msg.log_name != self.log_name:
            self.log_name = msg.log_name
            self.log_buffer.clear()
            self.lines.clear()
            self.lines.border_title = f"{self.log_name}.log · Enter or l on a stage: its logs" if self.log_name else ""
            self._cursor_to_log = True
        self.log_buffer.extend(msg.log_lines)
        shown = [line for line in msg.log_lines if self.log_filter in line]
        if shown and not paused:
            self.lines.write_lines(shown)  # batched: one call per tick

    def show(self, msg: RunPolled) -> None:
        self.stages.show(msg.view.stages)
        names = self.stages.stage_names
        if self._cursor_to_log and self.log_name in names:  # the cursor on the stage followed: l opens it
            self._cursor_to_log = False
            # Not from under the operator's own choice. Focus does not tell it: the screen focuses the table on
            # mount, before or after the first poll as the machine's load decides.
            if self.stages.cursor_row == self._placed_row:
                self._placed_row = names.index(self.log_name)
                self.stages.move_cursor(row=self._placed_row, animate=False)
        for widget, text in ((self.outcome, views.outcome(msg.snap, msg.view.evaluation)),
                             (self.nodes, "\n".join(msg.peers))):
            if widget.show(text):
                widget.set_class(bool(text), "visible")

    @on(DataTable.RowSelected, "#stages")
    def _open_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open_log()

    def action_open_log(self) -> None:
        """The pager on the stage under the cursor (the one whose log the tab shows, until moved)."""
        stages = self.stages.stage_names
        if stages:
            self.app.open_log(stages[min(self.stages.cursor_row, len(stages) - 1)])  # type: ignore[attr-defined]

    def leave_input(self) -> None:
        """Escape in the filter: the filter as last applied stays; an empty one hides the box."""
        self.filter.value = self.log_filter
        if not self.log_filter:
            self.filter.remove_class("visible")
        self.lines.focus()

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
