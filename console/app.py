"""eagle3-console's Textual console: renders a run's files and sends commands; never runs a stage.

Workers sample NVML and read the run in threads and post immutable snapshots as messages; only the
message handlers touch widgets (REFERENCE.md §5). The job runs detached: quitting (q) or losing the
terminal leaves it running, and `eagle3-console attach RUN_DIR` shows the same state again."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections import deque
from pathlib import Path

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import (
    Button,
    DataTable,
    Footer,
    Input,
    Label,
    Log,
    Static,
    TabbedContent,
    TabPane,
)

from pipeline import box, gpu, jobs, notes
from pipeline.rundir import RunDir
from pipeline.runview import LogTailer, RunView, RunWatcher
from pipeline.stages import STAGES, stage_names

GLYPH = {"done": "✔ done", "running": "▶ running", "failed": "✖ failed", "pending": "· pending",
         "skipped": "↷ skipped", "stale": "? stale", "n/a": "  n/a"}
HISTORY = 60


def human_bytes(n: int | None) -> str:
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def na(value, fmt="{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def fmt_secs(s: float | None) -> str:
    if s is None:
        return ""
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


BLOCKS = "▁▂▃▄▅▆▇█"


def spark(values, width: int = 8) -> str:
    """A text sparkline of the last `width` percentages (0-100), one block per sample."""
    tail = list(values)[-width:]
    return "".join(BLOCKS[min(7, int(v / 100 * 8))] for v in tail).rjust(width)


def coarse_secs(s: float | None) -> str:
    """The running stage's elapsed time, in whole minutes as its ETA: a repaint of the stage table costs
    ~40 ms on a small CPU (NOTES.md), so a clock that moves every second, or every 10 s, would be most
    of the console's cost. Finished stages show m:ss."""
    if s is None:
        return ""
    m = int(s) // 60
    return "<1m" if m == 0 else (f"{m}m" if m < 60 else f"{m // 60}h{m % 60:02d}m")


def eta_text(s: float | None) -> str:
    """An estimate, shown as one: whole minutes (it moves faster than the clock, so seconds would
    repaint the table every tick)."""
    if s is None:
        return ""
    m = int(s // 60)
    return "<1m" if m == 0 else (f"~{m}m" if m < 60 else f"~{m // 60}h{m % 60:02d}m")


def bar(fraction: float | None, width: int = 12) -> str:
    if fraction is None:
        return " " * width
    filled = round(fraction * width)
    return "█" * filled + "░" * (width - filled)


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
        widths = [max((cell_len(row[c][0]) for row in cells if c < len(row)), default=0) for c in range(len(self.header))]
        return [Strip([Segment(text + " " * (widths[c] - cell_len(text) + 2), style or (bold if n == 0 else base))
                       for c, (text, style) in enumerate(row)]).crop_extend(0, width, base)
                for n, row in enumerate(cells)]

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._strips is None or self._built_width != width:
            self._strips, self._built_width = self._build(width), width
        return self._strips[y] if y < len(self._strips) else Strip.blank(width, self.rich_style)


# ---------------------------------------------------------------- messages (from workers)

class GpuSampled(Message):
    def __init__(self, snapshot: gpu.GpuSnapshot):
        super().__init__()
        self.snapshot = snapshot


class RunPolled(Message):
    def __init__(self, view: RunView, log_lines: list[str], log_name: str | None, server: dict, job: dict):
        super().__init__()
        self.view, self.log_lines, self.log_name, self.server, self.job = view, log_lines, log_name, server, job

    def shown(self) -> tuple:
        """What the run panel shows: running stages' clocks only to the minute, as they are drawn."""
        stages = tuple(replace(s, elapsed_s=s.elapsed_s // 60, eta_s=s.eta_s and s.eta_s // 60)
                       if s.status == "running" and s.elapsed_s is not None else s for s in self.view.stages)
        return replace(self.view, stages=stages), self.log_name, self.server, self.job

    def same_as(self, other: RunPolled | None) -> bool:
        return other is not None and not self.log_lines and self.shown() == other.shown()


class Flash(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class ServerActionDone(Message):
    def __init__(self, text: str, ok: bool):
        super().__init__()
        self.text, self.ok = text, ok


# ---------------------------------------------------------------- screens

class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ModeScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Start the server in which mode?")
            for mode in ("production", "baseline", "speculative", "extraction"):
                yield Button(mode, id=f"mode-{mode}")

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id.removeprefix("mode-"))


HELP = """\
[b]eagle3-console[/b] — keys

  1 2 3 4 5 Run / GPUs / Server / Notes / Eval (benchmark matrix, loss curve) tab
  x         stop the vLLM server (asks, naming PIDs, port and GPUs)
  r         restart the server in its current mode (asks)
  m         start the server in a chosen mode (asks)
  /         filter the log (empty filter = all lines)
  F         follow the log tail again
  space     pause / resume the display (collection continues)
  n         write a note;  e  export notes as Markdown into the run
  ctrl+p    command palette;  ?  this help;  q  quit (the job keeps running)

Status is text as well as colour: ✔ done ▶ running ✖ failed · pending; a lost GPU reads "GPU LOST".
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP)

    def action_dismiss(self) -> None:
        self.dismiss(None)


# ---------------------------------------------------------------- app

class ConsoleApp(App):
    TITLE = "eagle3-console"
    CSS = """
    #summary { height: 1; background: $boost; }
    TabbedContent { height: 1fr; }
    TabPane { height: 1fr; padding: 0; }
    #stages { height: 1fr; min-height: 5; }
    #log { height: 1fr; border-top: solid $primary; }
    #filter { display: none; }
    #filter.visible { display: block; }
    #gpus { height: auto; max-height: 60%; }
    #gpu-procs { height: 1fr; border-top: solid $primary; }
    #server-info { height: auto; padding: 0 1; }
    #notes-log { height: 1fr; }
    ConfirmScreen, ModeScreen, HelpScreen { align: center middle; }
    #dialog { width: 70; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    #buttons { height: auto; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit (job continues)"),
        Binding("question_mark", "help", "Help"),
        Binding("1", "tab('run')", "Run", show=False), Binding("2", "tab('gpus')", "GPUs", show=False),
        Binding("3", "tab('server')", "Server", show=False), Binding("4", "tab('notes')", "Notes", show=False),
        Binding("5", "tab('eval')", "Eval", show=False),
        Binding("x", "stop_server", "Stop server"), Binding("r", "restart_server", "Restart"),
        Binding("m", "start_mode", "Mode", show=False),
        Binding("slash", "filter", "Filter log"), Binding("F", "follow", "Follow", show=False),
        Binding("space", "pause", "Pause"), Binding("n", "note", "Note"), Binding("e", "export", "Export notes"),
    ]

    def __init__(self, run_dir: Path, readonly: bool = False, interval: float = 1.0, sampler=None, clock=time.time):
        super().__init__()
        self.rundir = RunDir.open(run_dir)
        self.profile = self.rundir.profile()
        self.readonly = readonly
        self.interval = max(0.25, interval)  # as nitop: faster than 4 Hz costs more than it shows
        self.sampler = sampler or gpu.sample
        self.watcher = RunWatcher(self.rundir, stage_names(), clock=clock)
        self.tailer: LogTailer | None = None
        self.tailer_name: str | None = None
        self.log_name: str | None = None
        self.log_buffer: deque[str] = deque(maxlen=10_000)
        self.log_filter = ""
        self.paused = False
        self.server: dict = {"state": "none"}
        self.snapshot: gpu.GpuSnapshot | None = None
        self.history: dict[int, tuple[deque, deque]] = {}
        self._rows: dict[str, list[tuple]] = {}
        self._shown: dict[str, object] = {}

    # ---- layout
    def compose(self) -> ComposeResult:
        yield Line(id="summary")
        with TabbedContent(initial="run"):
            with TabPane("1 Run", id="run"):
                yield DataTable(id="stages", cursor_type="row", zebra_stripes=True)
                yield Input(placeholder="filter the log (Enter applies, empty = all)", id="filter")
                yield Log(id="log", max_lines=10_000, auto_scroll=True)
            with TabPane("2 GPUs", id="gpus-tab"):
                yield Grid("gpus", ("GPU", "name", "util", "history", "memory", "history", "temp", "power", "SM MHz"))
                yield DataTable(id="gpu-procs")
            with TabPane("3 Server", id="server"):
                yield Static(id="server-info")
                with Horizontal(id="buttons"):
                    yield Button("Stop (x)", id="btn-stop", variant="error")
                    yield Button("Restart (r)", id="btn-restart", variant="warning")
                    yield Button("Start in mode… (m)", id="btn-mode")
            with TabPane("4 Notes", id="notes"):
                yield Log(id="notes-log", max_lines=5000, auto_scroll=True)
                yield Input(placeholder="write a note, Enter to append", id="note-input")
            with TabPane("5 Eval", id="eval"):
                yield Static(id="loss-curve")
                yield DataTable(id="matrix")
        yield Footer()

    def on_mount(self) -> None:
        # Handlers use these references, not query_one: a query searches the active screen, which is
        # a dialog while one is open.
        self.w = {w.id: w for w in self.query("#summary, #stages, #filter, #log, #gpus, "
                                              "#gpu-procs, #server-info, #notes-log, #note-input, #loss-curve, #matrix")}
        self.tabs = self.query_one(TabbedContent)
        table = self.query_one("#stages", DataTable)
        table.add_columns("stage", "status", "progress", "elapsed", "ETA", "figures")
        self.query_one("#gpu-procs", DataTable).add_columns("GPU", "PID", "process", "GPU memory")
        self.query_one("#matrix", DataTable).add_columns("method", "conc.", "tok/s", "TPOT ms", "τ",
                                                         "acceptance per position", "speedup", "same output")
        if self.readonly:
            for b in self.query(Button):
                b.disabled = True
        self._feed_stop = threading.Event()
        threading.Thread(target=self._feed, name="console-feed", daemon=True).start()

    def on_unmount(self) -> None:
        self._feed_stop.set()

    # ---- the feed: one daemon thread samples NVML and reads the run each interval and posts what
    # it found. Not a Textual worker per tick: each worker's start and state changes are messages
    # the app dispatches, which cost more than the sampling itself; a daemon thread never blocks exit.
    def _feed(self) -> None:
        last_run = None
        while not self._feed_stop.is_set():
            started = time.monotonic()
            try:
                self.post_message(GpuSampled(self.sampler()))
            except Exception as exc:  # the sampler reports NVML errors itself; anything else is shown
                self.post_message(GpuSampled(gpu.GpuSnapshot(time.time(), (), unavailable=f"sampler: {exc}")))
            try:
                polled = self.poll_run()
                if not polled.same_as(last_run):  # unchanged run, log, server and job: nothing to render
                    last_run = polled
                    self.post_message(polled)
            except Exception as exc:
                self.post_message(Flash(f"reading the run failed: {exc}"))
            self._feed_stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def poll_run(self) -> RunPolled:
        view = self.watcher.poll()
        name = view.current or self.log_name or next((s.name for s in reversed(view.stages)
                                                      if s.status != "pending"), None)
        if name and name != self.tailer_name:
            self.tailer, self.tailer_name = LogTailer(self.rundir.log_path(name)), name
        lines = self.tailer.new_lines() if self.tailer else []
        server = box.controller(self.profile).status()
        if "uptime_s" in server:  # shown to 10 s, as the stages' elapsed: a finer figure repaints every tick
            server["uptime_s"] = server["uptime_s"] // 10 * 10
        return RunPolled(view, lines, name, server, jobs.job_state(self.rundir))

    # ---- rendering (message handlers own all state)
    def _set(self, widget: Static, content) -> None:
        """Static.update repaints even when nothing changed; most ticks change nothing here."""
        if self._shown.get(widget.id) != content:
            self._shown[widget.id] = content
            widget.update(content)

    def _fill(self, table: DataTable, rows: list[tuple]) -> None:
        """Redraw only what changed: a changed cell is updated in place; the table is rebuilt only
        when the number of rows changes (most ticks change a few numbers, or nothing)."""
        from textual.coordinate import Coordinate

        old = self._rows.get(table.id)
        if old == rows:
            return
        if old is None or len(old) != len(rows):
            table.clear()
            for row in rows:
                table.add_row(*row)
        else:
            for r, (before, after) in enumerate(zip(old, rows)):
                for c, (a, b) in enumerate(zip(before, after)):
                    if a != b:
                        table.update_cell_at(Coordinate(r, c), b)
        self._rows[table.id] = rows

    @on(GpuSampled)
    def show_gpus(self, msg: GpuSampled) -> None:
        self.snapshot = snap = msg.snapshot
        for g in snap.gpus:
            util, mem = self.history.setdefault(g.index, (deque(maxlen=HISTORY), deque(maxlen=HISTORY)))
            util.append(g.util_pct or 0)
            mem.append(100 * g.mem_used / g.mem_total if g.mem_used and g.mem_total else 0)
        if not self.paused and self.tabs.active == "gpus-tab":  # hidden tables are drawn on activation
            self._draw_gpus(snap)

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "gpus-tab" and self.snapshot is not None:
            self._draw_gpus(self.snapshot)

    def _draw_gpus(self, snap: gpu.GpuSnapshot) -> None:
        rows: list[tuple] = [("-", snap.hint)] if snap.unavailable else []
        for g in snap.gpus:
            if g.lost:
                rows.append((str(g.index), g.name.removeprefix("NVIDIA "), Text("✖ GPU LOST", style="bold red"), Text(g.error[:30])))
                continue
            util_hist, mem_hist = self.history[g.index]
            mem = f"{na(g.mem_used and g.mem_used / 2**30, '{:.1f}')}/{na(g.mem_total and g.mem_total / 2**30, '{:.0f}')}G"
            power = f"{na(g.power_w, '{:.0f}')}/{na(g.power_limit_w, '{:.0f}')}W"
            rows.append((str(g.index), g.name.removeprefix("NVIDIA "), na(g.util_pct, "{}%"), spark(util_hist), mem, spark(mem_hist),
                         na(g.temp_c, "{}°C"), power, na(g.sm_clock_mhz)))
        self.w["gpus"].set(rows)
        self._fill(self.w["gpu-procs"], [(str(g.index), str(p.pid), p.name, human_bytes(p.used_bytes))
                                         for g in snap.gpus for p in g.processes])

    @on(RunPolled)
    def show_run(self, msg: RunPolled) -> None:
        self.server = msg.server
        if msg.log_name != self.log_name:
            self.log_name = msg.log_name
            self.log_buffer.clear()
            self.w["log"].clear()
        self.log_buffer.extend(msg.log_lines)
        if self.paused:
            return
        shown = [l for l in msg.log_lines if self.log_filter in l] if self.log_filter else msg.log_lines
        if shown:
            self.w["log"].write_lines(shown)  # batched: one call per tick
        view = msg.view
        applies = {s.name: s.applies(self.profile) for s in STAGES}
        rows = []
        for s in view.stages:
            status = s.status if applies.get(s.name, True) else "n/a"
            progress = f"{bar(s.fraction)} {s.done:g}/{s.total:g} {s.unit}" if s.total and s.status == "running" \
                else bar(s.fraction)
            figs = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.figures)
            elapsed = coarse_secs(s.elapsed_s) if s.status == "running" else fmt_secs(s.elapsed_s)
            rows.append((s.name, GLYPH.get(status, status), progress, elapsed, eta_text(s.eta_s),
                         Text(figs[:60])))  # Text: an error like "[Errno 28] …" is not markup
        self._fill(self.w["stages"], rows)
        gpus = "no NVML" if self.snapshot and self.snapshot.unavailable else \
            f"{len(self.snapshot.gpus)} GPU(s)" if self.snapshot else "GPUs …"
        srv = self.server
        server = f"{srv.get('mode')} pid {srv.get('pid')} :{srv.get('port')} " + \
            ("healthy" if srv.get("healthy") else "not healthy") if srv.get("state") == "running" else "no server"
        flags = (" · PAUSED" if self.paused else "") + (" · READ-ONLY" if self.readonly else "")
        self.w["summary"].set(
            f" {Path(view.root).name} · job {msg.job['state']} · stage {view.current or '-'} · {server} · "
            f"{gpus}{flags}")
        self._set(self.w["server-info"], self._server_text())
        self._show_eval(view)
        notes_log = self.w["notes-log"]
        if len(view.notes) > notes_log.line_count:
            notes_log.write_lines([f"{n['ts'][11:19]} {n.get('stage') or n.get('source')}: {n['text']}"
                                   for n in view.notes[notes_log.line_count:]])

    def _show_eval(self, view: RunView) -> None:
        if view.train_loss:
            losses = view.train_loss
            width = 70  # the whole run, bucketed: each block is the mean loss of its share of the steps
            buckets = [losses[i * len(losses) // width:(i + 1) * len(losses) // width] for i in range(width)]
            means = [sum(b) / len(b) for b in buckets if b]
            top = max(means) or 1.0
            curve = "".join(BLOCKS[min(7, int(v / top * 7.999))] for v in means)
            self._set(self.w["loss-curve"], f"training loss over {len(losses)} logged steps "
                                        f"(first {losses[0]:.3g}, now {losses[-1]:.3g})\n{curve}")
        res = view.evaluation
        if not res:
            return
        rows = []
        for method, row in res["matrix"].items():
            if row.get("error") and not row.get("levels"):
                rows.append((method, "", "", "", "", Text(f"✖ {row['error'][:60]}"), "", ""))
            for c, lv in sorted(row.get("levels", {}).items(), key=lambda kv: int(kv[0])):
                acc = lv.get("acceptance_per_position") or []
                bars = " ".join(f"{BLOCKS[min(7, int(a * 7.999))]}{a:.2f}" for a in acc)
                same = "" if method == "baseline" else ("✔ yes" if row.get("identical_outputs") else "✖ NO")
                rows.append((method, str(c), f"{lv['output_tok_s']:.1f}", na(lv.get("tpot_ms"), "{:.2f}"),
                             na(lv.get("mean_acceptance_length"), "{:.3f}"), bars, na(lv.get("speedup"), "x{}"), same))
        rows.append(("decision", "", "", "", "", Text(res.get("decision", "")), "", ""))
        self._fill(self.w["matrix"], rows)

    def _server_text(self) -> str:
        s = self.server
        if s.get("state") != "running":
            return f"vLLM on {self.profile.server.host}:{self.profile.server.port}: not running ({s.get('state')})"
        return (f"mode {s['mode']} · pid {s['pid']} (group {s['pgid']}: {s.get('pids')}) · port {s['port']} · "
                f"{'healthy' if s.get('healthy') else 'NOT healthy'} · up {fmt_secs(s.get('uptime_s'))}\nlog {s.get('log')}")

    # ---- controls
    def _gpus_of(self, pids: list[int]) -> str:
        if not self.snapshot or self.snapshot.unavailable:
            return "no GPUs (no NVML)"
        idx = sorted({g.index for g in self.snapshot.gpus for p in g.processes if p.pid in pids})
        return "GPUs " + ", ".join(map(str, idx)) if idx else "no GPU memory held"

    def _refuse_if_readonly(self) -> bool:
        if self.readonly:
            self.notify("read-only console: controls are disabled", severity="warning")
        return self.readonly

    def action_stop_server(self) -> None:
        if self._refuse_if_readonly():
            return
        s = self.server
        if s.get("state") != "running":
            self.notify("no server is running on the port", severity="warning")
            return
        question = (f"Stop the {s['mode']} vLLM server?\nPIDs {s.get('pids')} (process group {s['pgid']}), "
                    f"port {s['port']}, {self._gpus_of(s.get('pids', []))}.")
        self.push_screen(ConfirmScreen(question), lambda yes: yes and self.server_command("stop", None))

    def action_restart_server(self) -> None:
        if self._refuse_if_readonly():
            return
        s = self.server
        mode = s.get("mode") if s.get("state") == "running" and s.get("mode") != "adopted" else "production"
        question = (f"Restart the server in {mode} mode?\nStops PIDs {s.get('pids', [])} on port "
                    f"{self.profile.server.port} ({self._gpus_of(s.get('pids', []))}) first.")
        self.push_screen(ConfirmScreen(question), lambda yes: yes and self.server_command("start", mode))

    def action_start_mode(self) -> None:
        if self._refuse_if_readonly():
            return

        def chosen(mode: str | None) -> None:
            if mode:
                s = self.server
                q = (f"Start {mode} on port {self.profile.server.port}?" +
                     (f"\nStops PIDs {s.get('pids')} ({s.get('mode')}) first." if s.get("state") == "running" else ""))
                self.push_screen(ConfirmScreen(q), lambda yes: yes and self.server_command("start", mode))

        self.push_screen(ModeScreen(), chosen)

    @on(Button.Pressed, "#btn-stop")
    def _stop_button(self) -> None:
        self.action_stop_server()

    @on(Button.Pressed, "#btn-restart")
    def _restart_button(self) -> None:
        self.action_restart_server()

    @on(Button.Pressed, "#btn-mode")
    def _mode_button(self) -> None:
        self.action_start_mode()

    @work(thread=True, exclusive=True, group="server", exit_on_error=False)
    def server_command(self, what: str, mode: str | None) -> None:
        from pipeline.server import ServerError
        try:
            if what == "stop":
                result = box.free_port(self.profile, lambda m: None)
                self.post_message(ServerActionDone(f"stopped: {result}", True))
                return
            target_dir, mode_args = box.mode_inputs(self.profile, self.rundir, mode)
            rec = box.start_mode(self.profile, mode, target_dir, self.rundir.log_path(f"server-{mode}"),
                                 self.rundir.root / ".cache", lambda m: None, **mode_args)
            self.post_message(ServerActionDone(f"{mode} server healthy, pid {rec.pid}", True))
        except (ServerError, ValueError, OSError) as exc:
            self.post_message(ServerActionDone(str(exc), False))

    @on(ServerActionDone)
    def _server_done(self, msg: ServerActionDone) -> None:
        self.notify(msg.text, severity="information" if msg.ok else "error", timeout=8)
        notes.add(self.rundir, f"console: server {msg.text}", source="operator")

    @on(Flash)
    def _flash(self, msg: Flash) -> None:
        self.notify(msg.text, severity="error", timeout=8)

    # ---- log, display, notes
    def action_filter(self) -> None:
        box_ = self.w["filter"]
        box_.add_class("visible")
        box_.focus()

    @on(Input.Submitted, "#filter")
    def apply_filter(self, event: Input.Submitted) -> None:
        self.log_filter = event.value
        log = self.w["log"]
        log.clear()
        log.write_lines([l for l in self.log_buffer if self.log_filter in l] if self.log_filter else list(self.log_buffer))
        if not event.value:
            event.input.remove_class("visible")
        log.focus()

    def action_follow(self) -> None:
        log = self.w["log"]
        log.auto_scroll = True
        log.scroll_end(animate=False)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.notify("display paused (collection continues)" if self.paused else "display resumed")

    def action_note(self) -> None:
        self.query_one(TabbedContent).active = "notes"
        self.w["note-input"].focus()

    @on(Input.Submitted, "#note-input")
    def add_note(self, event: Input.Submitted) -> None:
        if event.value.strip():
            notes.add(self.rundir, event.value.strip())
            event.input.value = ""
            self.notify("note appended")

    def action_export(self) -> None:
        from pipeline.atomicio import atomic_write_text
        out = self.rundir.root / "notes.md"
        atomic_write_text(out, notes.export(self.rundir, "md"))
        self.notify(f"notes exported to {out}")

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = {"gpus": "gpus-tab"}.get(tab, tab)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def main(run_dir: Path, readonly: bool = False, interval: float = 1.0) -> int:
    import signal

    app = ConsoleApp(run_dir, readonly=readonly, interval=interval)
    # A closed SSH session sends SIGHUP: leave cleanly; the job runs in its own session and continues.
    signal.signal(signal.SIGHUP, lambda *_: app.call_later(app.exit))
    app.run()
    return 0
