"""Aligned rows of text drawn line by line from prebuilt strips (the GPU rows)."""
from __future__ import annotations

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget


class Grid(Widget):
    """Rows of text in aligned columns that repaint in place, drawn line by line from prebuilt strips.
    The GPU rows change every second; a DataTable repainting them cost 1.55 % of a core, a Static
    0.40 %, this less (NOTES.md, bench/console_cost.py)."""

    DEFAULT_CSS = "Grid { height: auto; }"

    def __init__(self, id: str, header: tuple[str, ...]):
        super().__init__(id=id)
        self.header = header
        self.rows: list[tuple] = []
        self._strips: list[Strip] | None = None
        self._built_width = 0

    def set(self, rows: list[tuple]) -> None:
        if rows != self.rows:
            relayout = len(rows) != len(self.rows)
            self.rows, self._strips = rows, None
            self.refresh(layout=relayout)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.rows) + 1

    @property
    def plain(self) -> str:
        return "\n".join(" | ".join(str(c) for c in row) for row in self.rows)

    def _build(self, width: int) -> list[Strip]:
        base = self.rich_style  # a style lookup costs ~0.2 ms: once per change, not once per line
        bold = base + Style(bold=True)
        cells = [[(str(c), base + Style.parse(c.style) if isinstance(c, Text) and isinstance(c.style, str) else None)
                  for c in row] for row in (self.header, *self.rows)]
        widths = [max((cell_len(row[c][0]) for row in cells if c < len(row)), default=0)
                  for c in range(len(self.header))]
        return [Strip([Segment(text + " " * (widths[c] - cell_len(text) + 2), style or (bold if n == 0 else base))
                       for c, (text, style) in enumerate(row)]).crop_extend(0, width, base)
                for n, row in enumerate(cells)]

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._strips is None or self._built_width != width:
            self._strips, self._built_width = self._build(width), width
        return self._strips[y] if y < len(self._strips) else Strip.blank(width, self.rich_style)
