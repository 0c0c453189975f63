"""A DataTable that redraws only the cells that changed."""
from __future__ import annotations

from textual.coordinate import Coordinate
from textual.widgets import DataTable


class DiffTable(DataTable):
    """`fill(rows)` updates a changed cell in place and rebuilds the rows only when their number
    changes: most ticks change a few numbers, or nothing (NOTES.md: a stage-table repaint ~40 ms)."""

    _filled: list[tuple] | None = None

    def fill(self, rows: list[tuple]) -> None:
        if rows == self._filled:
            return
        if self._filled is None or len(self._filled) != len(rows):
            super().clear()
            self.add_rows(rows)
        else:
            for r, (before, after) in enumerate(zip(self._filled, rows, strict=True)):
                for c, (old, new) in enumerate(zip(before, after, strict=True)):
                    if old != new:
                        self.update_cell_at(Coordinate(r, c), new)
        self._filled = rows

    def clear(self, columns: bool = False):
        self._filled = None
        return super().clear(columns)
