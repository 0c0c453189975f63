"""The Run tab's stage table: one compact row per stage, its columns fitted to the width. Figures come
before the progress bar: the bar shrinks or goes (the count stays) when that shows more of them; the
elapsed column goes only on a very narrow table; a figure that does not fit is dropped whole, never cut
mid-number (only an error message is cut, with an ellipsis)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from rich.cells import cell_len
from rich.text import Text

from console.formatting import bar, coarse_secs, count, eta_text, figure, fmt_secs
from console.widgets.table import DiffTable
from pipeline.run.runview import StageView

GLYPH = {"done": "✔ done", "running": "▶ running", "failed": "✖ failed", "interrupted": "✖ interrupted",
         "pending": "· pending", "skipped": "↷ skipped", "stale": "? stale", "n/a": "  n/a"}
SHORT_KEYS = {"samples_per_s": "samples/s", "tokens_per_s": "tok/s", "profile/tokens_per_s": "train tok/s",
              "generate_tok_s": "gen tok/s", "mean_acceptance_length": "acc_len",
              "val/loss_epoch": "val_loss"}
PADDING = 1  # DataTable's cell_padding: every column costs its width + 2
FIGURES_MIN = 16  # the elapsed column goes only when keeping it would leave the figures less than this
LAYOUTS = ((12, "elapsed"), (6, "elapsed"), (0, "time"), (0, None))  # (bar, elapsed) as in LaidOut


@dataclass(frozen=True)
class LaidOut:
    bar: int  # progress bar cells; 0: the count alone
    elapsed: str | None  # the elapsed column's header; None: no such column
    headers: tuple[str, ...]  # the columns before the figures, empty ones left out
    rows: list[tuple[str, ...]]
    widths: list[int]
    room: int  # cells left for the figures


def progress(s: StageView, width: int) -> str:
    shown = [bar(s.fraction, width)] if width else []
    if s.total and s.status == "running":
        shown.append(f"{count(s.done or 0)}/{count(s.total)} {s.unit}".rstrip())
    return " ".join(shown)


def headers(elapsed: str | None) -> tuple[str, ...]:
    return ("stage", "status", "progress", *((elapsed,) if elapsed else ()), "ETA")


def fixed_cells(s: StageView, bar_width: int, elapsed: str | None) -> tuple[str, ...]:
    clock = coarse_secs if s.status == "running" else fmt_secs
    times = (clock(s.elapsed_s),) if elapsed else ()
    return (s.name, GLYPH.get(s.status, s.status), progress(s, bar_width), *times, eta_text(s.eta_s))


def in_progress(stages) -> bool:
    """A stage with a partial bar to show: one running, or one that stopped part way. Done stages' full bars
    alone say no more than their ✔ (a finished run gives their width to the figures)."""
    return any(s.fraction is not None and s.status not in ("done", "stale") for s in stages)


def lay_out(stages, bar_width: int, elapsed: str | None, width: int) -> LaidOut:
    names = headers(elapsed)
    rows = [fixed_cells(s, bar_width, elapsed) for s in stages]
    # a progress or ETA column with nothing in it (a finished run) is left out, not kept empty
    keep = [c for c, h in enumerate(names) if h not in ("progress", "ETA") or any(r[c] for r in rows)]
    widths = [max([cell_len(names[c]), *(cell_len(r[c]) for r in rows)]) for c in keep]
    if 2 in keep:  # the progress cell at its widest (done = total): counting up never widens the column
        widths[2] = max([widths[2], *(cell_len(progress(replace(s, done=s.total), bar_width)) for s in stages)])
    return LaidOut(bar_width, elapsed, tuple(names[c] for c in keep), [tuple(r[c] for c in keep) for r in rows],
                   widths, width - sum(w + 2 * PADDING for w in widths) - 2 * PADDING)


def figures_text(figures: tuple, short: bool = False) -> str:
    return ", ".join(figure(SHORT_KEYS.get(k, k) if short else k, v) for k, v in figures)


def is_error(s: StageView) -> bool:
    return any(k == "error" for k, _ in s.figures)


def fit_figures(figures: tuple, room: int) -> tuple[str, int]:
    """All figures if they fit, else with short names, else the most telling ones and "…"; and how
    many figures that shows."""
    for short in (False, True):
        if cell_len(text := figures_text(figures, short)) <= room:
            return text, len(figures)
    parts = [figure(SHORT_KEYS.get(k, k), v) for k, v in figures]  # most telling first: a narrow table drops the last
    for n in range(len(parts) - 1, -1, -1):
        if cell_len(text := ", ".join([*parts[:n], "…"])) <= room:
            return text, n
    return "", 0


def figures_cell(s: StageView, room: int) -> Text:
    """Figures fitted whole; an error message cut with an ellipsis. A Text: "[Errno 28] …" is not markup."""
    if not is_error(s):
        return Text(fit_figures(s.figures, room)[0])
    cut = Text(figures_text(s.figures))
    cut.truncate(max(room, 0), overflow="ellipsis")
    return cut


def choose(laid: list[LaidOut], stages) -> LaidOut:
    """Of the layouts that keep the elapsed column and leave the figures FIGURES_MIN cells (or all they
    need), the one that shows the most figures, the richest of equals; else the leanest."""
    wanted = min(FIGURES_MIN, max((cell_len(figures_text(s.figures, short=True)) for s in stages
                                   if not is_error(s)), default=0))
    roomy = [t for t in laid if t.elapsed and t.room >= wanted] or [laid[-1]]
    return max(roomy, key=lambda t: sum(fit_figures(s.figures, t.room)[1] for s in stages if not is_error(s)))


def stage_table(stages: tuple[StageView, ...], width: int):
    """(columns as (header, width) pairs, rows) for a table `width` cells wide."""
    layouts = LAYOUTS if in_progress(stages) else tuple(lo for lo in LAYOUTS if lo[0] == 0)
    t = choose([lay_out(stages, bar_width, elapsed, width) for bar_width, elapsed in layouts], stages)
    columns = (*zip(t.headers, t.widths, strict=True), ("figures", max(t.room, 0)))
    return columns, [(*row, figures_cell(s, t.room)) for row, s in zip(t.rows, stages, strict=True)]


class StageTable(DiffTable):
    """The stages with status, progress, elapsed, ETA and figures, laid out again when the width changes."""

    def __init__(self, id: str, stage_count: int):
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, cell_padding=PADDING)
        # As tall as all its rows from the start: the log below keeps its height, and its tail in view.
        self.styles.height = stage_count + 1
        self._stages: tuple[StageView, ...] = ()
        self._columns: tuple | None = None

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self._stages]

    def show(self, stages: tuple[StageView, ...]) -> None:
        self._stages = stages
        self._refit()

    def on_resize(self) -> None:
        self._refit()

    def _refit(self) -> None:
        columns, rows = stage_table(self._stages, self.scrollable_content_region.width)
        if columns != self._columns:
            row = self.cursor_row  # a new layout keeps the cursor where it was (clear puts it on row 0)
            self.clear(columns=True)
            for header, width in columns:
                self.add_column(header, width=width)
            self._columns = columns
            self.fill(rows)
            self.move_cursor(row=row, animate=False)
        else:
            self.fill(rows)
