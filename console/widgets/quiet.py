"""A Static that repaints only when what it shows changed (Static.update repaints every time; most ticks
change nothing)."""
from __future__ import annotations

from textual.widgets import Static


class QuietStatic(Static):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shown: object = None

    def show(self, content) -> bool:
        """Shown, and whether it changed."""
        if content == self._shown:
            return False
        self._shown = content
        self.update(content)
        return True
