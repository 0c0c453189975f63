"""A one-line text widget that repaints without a layout pass."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widget import Widget


class Line(Widget):
    """One line of text that repaints without a layout pass: Static.update re-runs the screen's layout,
    which measured ~2 % of a core at one update per second; this costs a repaint of one line. `tail` is
    never cut: the text before it gives way (READ-ONLY and PAUSED stay on an 80-column summary)."""

    DEFAULT_CSS = "Line { height: 1; } Line .line--tail { text-style: bold reverse; }"
    COMPONENT_CLASSES = {"line--tail"}

    def __init__(self, id: str):
        super().__init__(id=id)
        self.text = ""
        self.tail = ""

    def set(self, text: str, tail: str = "") -> None:
        if (text, tail) != (self.text, self.tail):
            self.text, self.tail = text, tail
            self.refresh()

    def render(self) -> Text:
        head = Text(self.text, no_wrap=True, overflow="ellipsis")
        if not self.tail:
            return head
        head.truncate(max(0, self.size.width - cell_len(self.tail) - 1), overflow="ellipsis")
        return Text.assemble(head, " ", (self.tail, self.get_component_rich_style("line--tail")), no_wrap=True)
