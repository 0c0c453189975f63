"""A one-line text widget that repaints without a layout pass."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget


class Line(Widget):
    """One line of text that repaints without a layout pass: Static.update re-runs the screen's layout,
    which measured ~2 % of a core at one update per second; this costs a repaint of one line."""

    DEFAULT_CSS = "Line { height: 1; }"

    def __init__(self, id: str):
        super().__init__(id=id)
        self.text = ""

    def set(self, text: str) -> None:
        if text != self.text:
            self.text = text
            self.refresh()

    def render(self) -> Text:
        return Text(self.text, no_wrap=True, overflow="ellipsis")
