"""The log pager: a stage's log and its servers' logs, one at a time, with search and follow (Enter or `l` on a
stage; ctrl+p "Log: STAGE"). It reads the files itself, on a timer, as the Run tab's tail does; the app's
global keys stay bound (q quits, 1–5 leave it for a tab, ? helps); Escape goes back."""
from __future__ import annotations

import json
import re
from pathlib import Path

from rich.highlighter import Highlighter
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input, Log

from console.formatting import human_bytes
from console.widgets import Line
from pipeline.layout.rundir import RunDir
from pipeline.layout.tail import LogTailer

PAGER_BYTES = 8 << 20  # a longer log is shown from its last 8 MiB (the header says so)
PAGER_LINES = 100_000


def stage_logs(run: RunDir, stage: str) -> list[tuple[Path, str]]:
    """(path, what it is): the stage's log, the logs of the servers it started (its "server" events name
    them), then the run's other server logs (the handover's production server is not an event)."""
    own: list[str] = []
    try:
        with open(run.events_path, "rb") as fh:
            for raw in fh:  # on Enter, not per tick; a run of days has a long events file: parse only its servers
                if b'"server"' in raw and b'"kind": "server"' in raw:
                    try:
                        event = json.loads(raw)
                    except json.JSONDecodeError:
                        continue
                    if event.get("stage") == stage and (name := f"server-{event.get('method') or event.get('mode')}") \
                            not in own:
                        own.append(name)
    except FileNotFoundError:
        pass
    others = sorted(p.stem for p in run.logs_dir.glob("server-*.log") if p.stem not in own)
    return [(run.log_path(stage), ""), *((run.log_path(n), f"{stage}'s server") for n in own),
            *((run.log_path(n), "a server of the run") for n in others)]


class Matches(Highlighter):
    """The search term, case-insensitive, in reverse video (not colour alone)."""

    def __init__(self) -> None:
        self.pattern: re.Pattern | None = None

    def highlight(self, text: Text) -> None:
        if self.pattern:
            text.highlight_regex(self.pattern, "reverse bold")


class LogPager(Screen[None]):
    DEFAULT_CSS = """
    LogPager #pager-title { background: $boost; }
    LogPager #pager-log { height: 1fr; overflow-x: auto; scrollbar-size-vertical: 1; }
    LogPager #pager-search { display: none; }
    LogPager #pager-search.visible { display: block; }
    """
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("slash", "search", "Search"),
        Binding("n", "match(1)", "Next"), Binding("N", "match(-1)", "Prev", show=False),
        Binding("F", "follow", "Follow"),
        Binding("right_square_bracket", "other(1)", "Next log"),
        Binding("left_square_bracket", "other(-1)", "Prev log", show=False),
    ]

    def __init__(self, logs: list[tuple[Path, str]], interval: float = 1.0):
        super().__init__()
        self.logs, self.interval = logs, interval
        self.index = 0
        self.tailer = LogTailer(logs[0][0])
        self.matches: list[int] = []
        self.match = -1

    def compose(self) -> ComposeResult:
        self.title_line = Line(id="pager-title")
        self.lines = Log(id="pager-log", max_lines=PAGER_LINES, auto_scroll=True, highlight=True)
        self.lines.highlighter = self.highlighter = Matches()
        self.search = Input(placeholder="search: Enter finds, n next, N previous, Esc leaves the box",
                            id="pager-search")
        yield self.title_line
        yield self.lines
        yield self.search
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._read()
        self.lines.focus()
        self.set_interval(self.interval, self._read)

    def _read(self) -> None:
        """New lines of the file shown; the log follows them unless scrolled up (F follows again)."""
        if new := self.tailer.new_lines(PAGER_BYTES):
            before = self.lines.line_count
            self.lines.write_lines(new)
            if self.highlighter.pattern:  # only the new lines searched, unless the oldest were dropped
                start = before if self.lines.line_count == before + len(new) else 0
                self.matches = self.matches[:len(self.matches) if start else 0] + self._find_in(start)
        self._title()

    def _find_in(self, start: int) -> list[int]:
        pattern = self.highlighter.pattern
        return [i for i, line in enumerate(self.lines.lines[start:], start) if pattern and pattern.search(line)]

    def _title(self) -> None:
        path, what = self.logs[self.index]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        shown = ("not written" if size is None else "empty" if size == 0 else
                 f"last {human_bytes(PAGER_BYTES)} of {human_bytes(size)}" if size > PAGER_BYTES else human_bytes(size))
        found = ""
        if self.highlighter.pattern:
            n = len(self.matches)
            at = (f"{self.match + 1}/{n} line {self.matches[self.match] + 1}" if 0 <= self.match < n
                  else f"{n} lines" if n else "not found")
            found = f"“{self.search.value}” {at}"
        follow = "following" if self.lines.is_vertical_scroll_end else "held: F follows"
        # what is searched and whether it follows are never cut; the file's name and size give way
        self.title_line.set(f" {self.index + 1}/{len(self.logs)} {path.name}" + (f" ({what})" if what else "")
                            + f" {shown}",
                            " · ".join(t for t in (found, follow) if t))

    def action_back(self) -> None:
        if self.focused is self.search:  # Escape leaves the box first, the pager second
            self._leave_search()
        else:
            self.dismiss()

    def action_search(self) -> None:
        self.search.add_class("visible")
        self.search.focus()

    def _leave_search(self) -> None:
        """The box goes (the term stays in the title): the log keeps every row."""
        self.search.remove_class("visible")
        self.lines.focus()

    @on(Input.Submitted, "#pager-search")
    def _find(self, event: Input.Submitted) -> None:
        term = event.value
        self.highlighter.pattern = re.compile(re.escape(term), re.IGNORECASE) if term else None
        self.matches = self._find_in(0)
        # the first match from the top line shown down, as less does
        top = self.lines.scroll_offset.y
        self.match = next((n for n, i in enumerate(self.matches) if i >= top), 0) - 1
        self._leave_search()
        self.action_match(1)

    def action_match(self, step: int) -> None:
        if self.matches:
            self.match = (self.match + step) % len(self.matches)
            self.lines.auto_scroll = False  # held on the match, not pulled to new lines
            self.lines.scroll_to(y=max(0, self.matches[self.match] - 2), animate=False, immediate=True)
        self.lines.refresh()
        self._title()

    def action_follow(self) -> None:
        """To the end, and on with what is written from now (read at once, not at the next tick)."""
        self.lines.auto_scroll = True
        self.lines.scroll_end(animate=False, immediate=True)
        self._read()

    def action_other(self, step: int) -> None:
        self.index = (self.index + step) % len(self.logs)
        self.tailer = LogTailer(self.logs[self.index][0])
        self.lines.clear()
        self.lines.auto_scroll = True
        self.matches, self.match = [], -1
        self._read()
