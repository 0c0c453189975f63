"""eagle3-console's Textual console: renders a run's files and sends commands; never runs a stage.

A feed thread samples NVML and reads the run, and workers run the slow commands (server stop/start,
the notes export); they post messages and only the message handlers touch widgets (docs/reference.md §5).
The job runs detached: quitting (q) or losing the terminal leaves it running, and
`eagle3-console attach RUN_DIR` shows the same state again.

Beside this module: widgets/ (the line, grid and table widgets), screens.py (dialogs), messages.py
(what threads post), views.py (rows and text from snapshots), formatting.py, app.tcss (layout)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, Footer, Input, Log, Static, TabbedContent, TabPane

from console import views
from console.messages import Flash, GpuSampled, NotesExported, Outcome, PortHeldByRun, RunPolled, ServerActionDone
from console.screens import ConfirmScreen, HelpScreen, ModeScreen
from console.widgets import DiffTable, Grid, Line, StageTable
from pipeline import box, gpu, jobs, notes, portlock
from pipeline.rundir import RunDir
from pipeline.runview import LogTailer, RunView, RunWatcher
from pipeline.server import ServerError
from pipeline.stages import STAGES, stage_names

__all__ = ["ConfirmScreen", "ConsoleApp", "HelpScreen", "ModeScreen", "main"]

HISTORY = 60
GPU_COLUMNS = ("GPU", "name", "util", "history", "memory", "history", "temp", "power", "SM MHz")
PROCESS_COLUMNS = ("GPU", "PID", "process", "role", "GPU memory")
MATRIX_COLUMNS = ("method", "conc.", "tok/s", "TTFT ms", "TPOT ms", "τ", "acceptance per position", "speedup",
                  "same output")


@dataclass(frozen=True)
class Widgets:
    """The widgets the handlers update, by id (`gpu_procs`: #gpu-procs), each as its own kind."""
    summary: Line
    stages: StageTable
    filter: Input
    log: Log
    gpus: Grid
    gpu_procs: DiffTable
    server_info: Static
    notes_log: Log
    note_input: Input
    loss_curve: Static
    checkpoints: Static
    matrix: DiffTable


class ConsoleApp(App):
    TITLE = "eagle3-console"
    CSS_PATH = "app.tcss"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    BINDINGS = [
        Binding("q", "quit", "Quit", tooltip="Quit the console; the job keeps running"),
        Binding("question_mark", "help", "Help"),
        Binding("1", "tab('run')", "Run", show=False), Binding("2", "tab('gpus')", "GPUs", show=False),
        Binding("3", "tab('server')", "Server", show=False), Binding("4", "tab('notes')", "Notes", show=False),
        Binding("5", "tab('eval')", "Eval", show=False),
        Binding("x", "stop_server", "Stop server"), Binding("r", "restart_server", "Restart"),
        Binding("m", "start_mode", "Mode", show=False),
        Binding("slash", "filter", "Filter", tooltip="Filter the log"), Binding("F", "follow", "Follow", show=False),
        Binding("space", "pause", "Pause"), Binding("n", "note", "Note"),
        Binding("e", "export", "Export", tooltip="Export the notes as Markdown into the run"),
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
        self.polled: RunPolled | None = None
        self.snapshot: gpu.GpuSnapshot | None = None
        self.history: dict[int, tuple[deque, deque]] = {}
        self._shown: dict[str | None, object] = {}

    # ---- layout
    def compose(self) -> ComposeResult:
        yield Line(id="summary")
        with TabbedContent(initial="run"):
            with TabPane("1 Run", id="run"):
                yield StageTable(id="stages", stage_count=len(self.watcher.stage_names))
                yield Input(placeholder="filter the log (Enter applies, empty = all)", id="filter")
                yield Log(id="log", max_lines=10_000, auto_scroll=True)
            with TabPane("2 GPUs", id="gpus-tab"):
                yield Grid("gpus", GPU_COLUMNS)
                yield DiffTable(id="gpu-procs")
            with TabPane("3 Server", id="server"):
                yield Static(id="server-info", markup=False)  # argv, paths: "[" is not markup
                with Horizontal(id="buttons"):
                    yield Button("Stop (x)", id="btn-stop", variant="error")
                    yield Button("Restart (r)", id="btn-restart", variant="warning")
                    yield Button("Start in mode… (m)", id="btn-mode")
            with TabPane("4 Notes", id="notes"):
                yield Log(id="notes-log", max_lines=5000, auto_scroll=True)
                yield Input(placeholder="write a note, Enter to append", id="note-input")
            with TabPane("5 Eval", id="eval"):
                yield Static(id="loss-curve")
                yield Static(id="checkpoints", markup=False)
                yield DiffTable(id="matrix")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # Handlers use these references, not query_one: a query searches the active screen, which is
        # a dialog while one is open.
        q = self.query_one
        self.w = Widgets(summary=q("#summary", Line), stages=q("#stages", StageTable), filter=q("#filter", Input),
                         log=q("#log", Log), gpus=q("#gpus", Grid), gpu_procs=q("#gpu-procs", DiffTable),
                         server_info=q("#server-info", Static), notes_log=q("#notes-log", Log),
                         note_input=q("#note-input", Input), loss_curve=q("#loss-curve", Static),
                         checkpoints=q("#checkpoints", Static), matrix=q("#matrix", DiffTable))
        self.tabs = self.query_one(TabbedContent)
        self.w.gpu_procs.add_columns(*PROCESS_COLUMNS)
        self.w.matrix.add_columns(*MATRIX_COLUMNS)
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
        snap = jobs.snapshot(self.rundir, stages=False)
        server = dict(snap.server)
        if "uptime_s" in server:  # shown to 10 s, as the stages' elapsed: a finer figure repaints every tick
            server["uptime_s"] = server["uptime_s"] // 10 * 10
        job = {"state": snap.state, "pid": snap.pid, "roles": snap.roles}
        return RunPolled(view, lines, name, server, job)

    # ---- rendering (message handlers own all state)
    def _set(self, widget: Static, content) -> None:
        """Static.update repaints even when nothing changed; most ticks change nothing here."""
        if self._shown.get(widget.id) != content:
            self._shown[widget.id] = content
            widget.update(content)

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
        self.w.gpus.set(views.gpu_rows(snap, self.history))
        self.w.gpu_procs.fill(views.gpu_process_rows(snap, self.polled.job.get("roles", {}) if self.polled else {}))

    @on(RunPolled)
    def show_run(self, msg: RunPolled) -> None:
        self.server, self.polled = msg.server, msg
        self._take_log(msg)
        if self.paused:
            return
        view = msg.view
        applies = {s.name: s.applies(self.profile) for s in STAGES}
        self.w.stages.show(views.live_stages(view.stages, msg.job), applies)
        self._show_summary(msg)
        self._set(self.w.server_info, views.server_text(self.server, self.profile))
        self._show_eval(view)
        self._show_notes(view)

    def _show_summary(self, msg: RunPolled) -> None:
        flags = (" · PAUSED" if self.paused else "") + (" · READ-ONLY" if self.readonly else "")
        self.w.summary.set(views.summary(msg.view.root, msg.job, msg.view.current, msg.server, self.snapshot, flags))

    def _take_log(self, msg: RunPolled) -> None:
        """Keep every new line (for a later filter); show the ones the filter lets through unless paused."""
        if msg.log_name != self.log_name:
            self.log_name = msg.log_name
            self.log_buffer.clear()
            self.w.log.clear()
        self.log_buffer.extend(msg.log_lines)
        shown = [line for line in msg.log_lines if self.log_filter in line]
        if shown and not self.paused:
            self.w.log.write_lines(shown)  # batched: one call per tick

    def _show_eval(self, view: RunView) -> None:
        if view.train_loss:
            self._set(self.w.loss_curve, views.loss_curve(view.train_loss))
        if view.checkpoints:
            self._set(self.w.checkpoints, views.checkpoints_text(view.checkpoints))
        if view.evaluation:
            self.w.matrix.fill(views.matrix_rows(view.evaluation))

    def _show_notes(self, view: RunView) -> None:
        notes_log = self.w.notes_log
        if len(view.notes) > notes_log.line_count:
            notes_log.write_lines([views.note_line(n) for n in view.notes[notes_log.line_count:]])

    # ---- server controls: each asks first; a run in progress holding the port is a second question
    def _gpus_of(self, pids: list[int]) -> str:
        if not self.snapshot or self.snapshot.unavailable:
            return "no GPUs (no NVML)"
        idx = sorted({g.index for g in self.snapshot.gpus for p in g.processes if p.pid in pids})
        return "GPUs " + ", ".join(map(str, idx)) if idx else "no GPU memory held"

    def _holder_warning(self) -> str:
        try:
            holder = portlock.holder(self.profile)
        except OSError:  # the lock file cannot be opened from here: the command checks again and says
            return ""
        return f"\n{views.holder_text(holder)} is using this server." if holder else ""

    def _refuse_if_readonly(self) -> bool:
        if self.readonly:
            self.notify("read-only console: controls are disabled", severity="warning")
        return self.readonly

    def _confirm_then(self, question: str, what: str, mode: str | None) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.server_command(what, mode)

        self.push_screen(ConfirmScreen(question + self._holder_warning()), answered)

    def action_stop_server(self) -> None:
        if self._refuse_if_readonly():
            return
        s = self.server
        if s.get("state") != "running":
            self.notify("no server is running on the port", severity="warning")
            return
        self._confirm_then(f"Stop the {s['mode']} vLLM server?\nPIDs {s.get('pids')} (process group {s['pgid']}), "
                           f"port {s['port']}, {self._gpus_of(s.get('pids', []))}.", "stop", None)

    def action_restart_server(self) -> None:
        if self._refuse_if_readonly():
            return
        s = self.server
        mode = s.get("mode") if s.get("state") == "running" and s.get("mode") != "adopted" else "production"
        self._confirm_then(f"Restart the server in {mode} mode?\nStops PIDs {s.get('pids', [])} on port "
                           f"{self.profile.server.port} ({self._gpus_of(s.get('pids', []))}) first.", "start", mode)

    def action_start_mode(self) -> None:
        if self._refuse_if_readonly():
            return

        def chosen(mode: str | None) -> None:
            if mode:
                s = self.server
                stops = f"\nStops PIDs {s.get('pids')} ({s.get('mode')}) first." if s.get("state") == "running" else ""
                self._confirm_then(f"Start {mode} on port {self.profile.server.port}?{stops}", "start", mode)

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
    def server_command(self, what: str, mode: str | None, held_by: dict | None = None) -> None:
        """Stop or start the port's server; `held_by`: the operator chose to force it past that run."""
        forced = f" (forced: {views.holder_text(held_by)} held the port)" if held_by else ""
        try:
            self.post_message(ServerActionDone(self._serve(what, mode, force=held_by is not None) + forced, True))
        except box.PortHeld as exc:
            self.post_message(PortHeldByRun(what, mode, exc.holder))
        except (ServerError, ValueError, OSError) as exc:
            self.post_message(ServerActionDone(str(exc), False))

    def _serve(self, what: str, mode: str | None, force: bool) -> str:
        """In the server worker's thread: the command itself, through pipeline.box as the CLI's."""
        if what == "stop":
            return f"stopped: {box.free_port(self.profile, lambda m: None, force=force)}"
        if mode is None:  # the start commands all name a mode
            raise ValueError("no server mode chosen")
        target_dir, mode_args = box.mode_inputs(self.profile, self.rundir, mode)
        rec = box.start_mode(self.profile, mode, target_dir, log_path=self.rundir.log_path(f"server-{mode}"),
                             cache_root=self.rundir.cache_root, say=lambda m: None, force=force, **mode_args)
        return f"{mode} server healthy, pid {rec.pid}"

    @on(PortHeldByRun)
    def _ask_to_force(self, msg: PortHeldByRun) -> None:
        run = views.holder_text(msg.holder)
        question = (f"{run} is using this server: its current stage will fail.\n"
                    f"Pull the server from under it anyway? y/n")

        def answered(yes: bool | None) -> None:
            if yes:
                self.server_command(msg.what, msg.mode, held_by=msg.holder)
            else:
                self.notify(f"nothing stopped: {run} keeps the server", severity="warning")

        self.push_screen(ConfirmScreen(question), answered)

    @on(ServerActionDone)
    def _server_done(self, msg: ServerActionDone) -> None:
        self._tell(msg)
        self._append_note(f"console: server {msg.text}", source="operator")

    @on(NotesExported)
    def _tell(self, msg: Outcome) -> None:
        self.notify(msg.text, severity="information" if msg.ok else "error", timeout=8)

    @on(Flash)
    def _flash(self, msg: Flash) -> None:
        self.notify(msg.text, severity="error", timeout=8)

    # ---- log, display, notes
    def action_filter(self) -> None:
        box_ = self.w.filter
        box_.add_class("visible")
        box_.focus()

    @on(Input.Submitted, "#filter")
    def apply_filter(self, event: Input.Submitted) -> None:
        self.log_filter = event.value
        log = self.w.log
        log.clear()
        log.write_lines([line for line in self.log_buffer if self.log_filter in line])
        if not event.value:
            event.input.remove_class("visible")
        log.focus()

    def action_follow(self) -> None:
        log = self.w.log
        log.auto_scroll = True
        log.scroll_end(animate=False)

    def action_pause(self) -> None:
        self.paused = not self.paused
        if self.polled:
            self._show_summary(self.polled)
        self.notify("display paused (collection continues)" if self.paused else "display resumed")

    def action_note(self) -> None:
        self.tabs.active = "notes"
        self.w.note_input.focus()

    @on(Input.Submitted, "#note-input")
    def add_note(self, event: Input.Submitted) -> None:
        if event.value.strip() and self._append_note(event.value.strip()):
            event.input.value = ""
            self.notify("note appended")

    def _append_note(self, text: str, **kw) -> bool:
        try:
            notes.add(self.rundir, text, **kw)
            return True
        except OSError as exc:  # a read-only run or a full disk: say so, keep the console
            self.notify(f"note not written: {exc}", severity="error", timeout=8)
            return False

    def action_export(self) -> None:
        self.notify("exporting the notes…")
        self.export_notes()

    @work(thread=True, exclusive=True, group="export", exit_on_error=False)
    def export_notes(self) -> None:
        """The report may render matplotlib plots: seconds, off the UI thread. The destination is
        opened first: a run that cannot be written fails before anything is rendered."""
        from pipeline.atomicio import atomic_write_rendered

        out = self.rundir.notes_export
        try:
            atomic_write_rendered(out, lambda: notes.export(self.rundir, "md", out).encode())
        except Exception as exc:  # a read-only run, a full disk, a plot that failed: a notification, not a traceback
            self.post_message(NotesExported(f"notes export failed: {type(exc).__name__}: {exc}", False))
        else:
            self.post_message(NotesExported(f"notes exported to {out}", True))

    def action_tab(self, tab: str) -> None:
        self.tabs.active = {"gpus": "gpus-tab"}.get(tab, tab)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def main(run_dir: Path, readonly: bool = False, interval: float = 1.0) -> int:
    import signal

    app = ConsoleApp(run_dir, readonly=readonly, interval=interval)
    # A closed SSH session sends SIGHUP: leave cleanly; the job runs in its own session and continues.
    signal.signal(signal.SIGHUP, lambda *_: app.call_later(app.exit))
    app.run()
    return 0
