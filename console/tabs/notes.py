"""4 Notes: the run's timeline and the operator's notes; a note written here, the notes exported."""
from __future__ import annotations

from textual import on, work
from textual.binding import Binding
from textual.widgets import Input, Log, TabbedContent, TabPane

from console import commands, views
from console.messages import Outcome
from pipeline.layout.rundir import RunDir
from pipeline.run.runview import RunView


class NotesTab(TabPane):
    KEYS = (Binding("n", "note", "Note"),
            Binding("e", "export", "Export", tooltip="Export the notes as Markdown into the run"))

    def __init__(self, rundir: RunDir, readonly: bool = False):
        self.lines = Log(id="notes-log", max_lines=5000, auto_scroll=True)
        self.input = Input(placeholder="write a note, Enter to append", id="note-input")
        self.input.display = not readonly  # a read-only console writes nothing into the run
        super().__init__("4 Notes", self.lines, self.input, id="notes")
        self.rundir = rundir

    def show(self, view: RunView) -> None:
        if len(view.notes) > self.lines.line_count:
            self.lines.write_lines([views.note_line(n) for n in view.notes[self.lines.line_count:]])

    def note(self, text: str, **kw) -> bool:
        """Appended, or the operator told why not (the console stays)."""
        try:
            commands.add_note(self.rundir, text, **kw)
        except OSError as exc:
            self.notify(f"note not written: {exc}", severity="error", timeout=8)
            return False
        return True

    def action_note(self) -> None:
        next(a for a in self.ancestors if isinstance(a, TabbedContent)).active = "notes"
        self.input.focus()

    def leave_input(self) -> None:
        self.lines.focus()

    @on(Input.Submitted, "#note-input")
    def add_note(self, event: Input.Submitted) -> None:
        """Appended, and the focus back on the notes: keys are keys again (`n` writes the next one)."""
        if event.value.strip() and self.note(event.value.strip()):
            event.input.value = ""
            self.notify("note appended")
            self.leave_input()

    @work(thread=True, exclusive=True, group="export", exit_on_error=False)
    def action_export(self) -> None:
        """Off the UI thread: the report may render plots."""
        self.notify("exporting the notes…")
        try:
            out = commands.export_notes(self.rundir)
        except Exception as exc:  # a read-only run, a full disk, a plot that failed: a notification, not a traceback
            self.post_message(Outcome(f"notes export failed: {type(exc).__name__}: {exc}", False))
        else:
            self.post_message(Outcome(f"notes exported to {out}", True))
