"""The console's modal screens: a yes/no question, the choice of a server mode, the keys."""
from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

MODES = ("production", "baseline", "speculative", "extraction")


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "dismiss(True)", "Yes"), Binding("n,escape", "dismiss(False)", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question", markup=False)  # paths and argv as written
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ModeScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Start the server in which mode?")
            for mode in MODES:
                yield Button(mode, id=f"mode-{mode}")

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss((event.button.id or "").removeprefix("mode-"))  # every button has an id


HELP = """\
[b]eagle3-console[/b] — keys

1 … 5    tabs: Run, GPUs, Server, Notes, Eval (matrix, loss)
x        stop the vLLM server (asks: PIDs, port, GPUs)
r        restart the server in its current mode (asks)
m        start the server in a chosen mode (asks)
         a run in progress on the port: x r m ask twice
/        filter the log (empty = all lines);  F  follow it
space    pause / resume the display (collection continues)
n        write a note;  e  export the notes into the run
ctrl+p   command palette;  ?  this help
q        quit: the job keeps running

Status is text and colour: ✔ done ▶ running ✖ failed · pending;
a lost GPU reads "GPU LOST".
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP)
