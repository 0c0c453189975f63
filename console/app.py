"""eagle3-console's Textual console: renders a run's files and sends commands; never runs a stage.

A feed thread samples NVML and reads the run, and workers run the slow commands (server stop/start,
the notes export); they post messages and only the message handlers touch widgets (docs/reference.md §5).
The job runs detached: quitting (q) or losing the terminal leaves it running, and
`eagle3-console attach RUN_DIR` shows the same state again.

This module wires the parts: tabs/ (one component per tab: its widgets, state and keys), commands.py (every
command to the engine), widgets/ (the line, grid and table widgets), screens.py (dialogs), messages.py
(what threads post), views.py (rows and text from snapshots), formatting.py, app.tcss (layout)."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from functools import partial
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input, TabbedContent

from console import views
from console.messages import GpuSampled, Outcome, RunPolled
from console.pager import LogPager, stage_logs
from console.screens import ConfirmScreen, HelpScreen, ModeScreen
from console.tabs import EvalTab, GpusTab, NotesTab, RunTab, ServerTab
from console.widgets import Line
from pipeline.host import gpu
from pipeline.layout.rundir import RunDir
from pipeline.layout.tail import LogTailer
from pipeline.run import jobs
from pipeline.run.runview import RunWatcher
from pipeline.stages import stage_names

__all__ = ["ConfirmScreen", "ConsoleApp", "HelpScreen", "ModeScreen", "main"]

TAB_IDS = {RunTab: "run", ServerTab: "server", NotesTab: "notes"}  # the tabs with keys of their own
TABS = (("run", "1 Run", "stages, the result, the log"), ("gpus", "2 GPUs", "utilization, memory, processes"),
        ("server", "3 Server", "the serving port's vLLM"), ("notes", "4 Notes", "the run's timeline and notes"),
        ("eval", "5 Eval", "the matrix, τ per checkpoint, the loss"))
SERVER_COMMANDS = (("stop_server", "stop", "stop the serving port's vLLM (asks first)"),
                   ("restart_server", "restart", "restart it in its mode (asks first)"),
                   ("start_mode", "start in a mode", "choose a mode, then asks"))
WRITES = ("stop_server", "restart_server", "start_mode", "note", "export")  # the actions a read-only console lacks


def routed(tab) -> list[Binding]:
    """A tab's own keys, bound app-wide (they work from every tab) and routed to that tab's actions."""
    return [dataclasses.replace(b, action=f"on_tab('{TAB_IDS[tab]}', '{b.action}')") for b in tab.KEYS]


PEERS_EVERY_S = 5.0

class ConsoleApp(App):
    TITLE = "eagle3-console"
    CSS_PATH = "app.tcss"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    SCREENS = {"help": HelpScreen}
    BINDINGS = [
        Binding("q", "quit", "Quit", tooltip="Quit the console; the job keeps running"),
        # ctrl+c quits too (Textual's own only says which key quits); in a text box it copies, as typing does
        Binding("ctrl+c", "quit", show=False),
        # Escape leaves a text box (note, filter) for its tab: the keys below are keys again, not text
        Binding("escape", "leave_input", show=False),
        Binding("question_mark", "push_screen('help')", "Help"),
        Binding("1", "tab('run')", "Run", show=False), Binding("2", "tab('gpus')", "GPUs", show=False),
        Binding("3", "tab('server')", "Server", show=False), Binding("4", "tab('notes')", "Notes", show=False),
        Binding("5", "tab('eval')", "Eval", show=False),
        *routed(ServerTab), *routed(RunTab),
        Binding("space", "pause", "Pause"),
        *routed(NotesTab),
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
        self.log_name: str | None = None  # the stage whose log is shown (the feed thread's; the run tab's own)
        self.paused = False
        self.polled: RunPolled | None = None
        self._peers: tuple[str, ...] = ()  # the job's other nodes (train.node_exporters), read every PEERS_EVERY_S
        self._peers_read = -PEERS_EVERY_S
        self.snapshot: gpu.GpuSnapshot | None = None

    # ---- layout: the tabs build themselves
    def compose(self) -> ComposeResult:
        # Handlers use these references, not query_one: a query searches the active screen, which is
        # a dialog while one is open.
        self.summary = Line(id="summary")
        yield self.summary
        self.notes = NotesTab(self.rundir, self.readonly)
        self.run_tab = RunTab(self.profile, len(self.watcher.stage_names))
        self.gpus, self.eval = GpusTab(), EvalTab()
        self.server_tab = ServerTab(self.profile, self.rundir, self.readonly, self.notes.note)
        with TabbedContent(initial="run") as self.tabs:
            yield from (self.run_tab, self.gpus, self.server_tab, self.notes, self.eval)
        yield Footer(compact=True)

    def on_mount(self) -> None:
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
                self.post_message(Outcome(f"reading the run failed: {exc}", False))
            self._feed_stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def poll_run(self) -> RunPolled:
        snap = jobs.snapshot(self.rundir, check_outputs=False, peers=False)
        if "uptime_s" in snap.server:  # shown to 10 s, as the stages' elapsed: a finer figure repaints every tick
            snap = dataclasses.replace(snap, server={**snap.server, "uptime_s": snap.server["uptime_s"] // 10 * 10})
        view = self.watcher.poll({s.name: s.status for s in snap.stages})
        name = view.current or self._last_with_output(view)
        if name and name != self.log_name:
            self.tailer, self.log_name = LogTailer(self.rundir.log_path(name)), name
        lines = self.tailer.new_lines() if self.tailer else []
        if time.monotonic() - self._peers_read > PEERS_EVERY_S:  # other nodes: HTTP, at most this often
            self._peers_read = time.monotonic()
            self._peers = tuple(p.line() for p in jobs.other_nodes(self.profile))
        return RunPolled(view, lines, name, snap, self._peers)

    def _last_with_output(self, view) -> str | None:
        """No stage runs: the last that wrote to its log (the handover's is often empty), else the last that
        ran. A dozen stat calls a tick, only while nothing runs."""
        ran = [s.name for s in reversed(view.stages) if s.status not in ("pending", "n/a")]
        for name in ran:
            with suppress(OSError):
                if self.rundir.log_path(name).stat().st_size:
                    return name
        return ran[0] if ran else None

    # ---- rendering: each message handed to the tabs that show it
    @on(GpuSampled)
    def show_gpus(self, msg: GpuSampled) -> None:
        self.snapshot = self.server_tab.snapshot = msg.snapshot
        self.gpus.sample(msg.snapshot)
        if not self.paused and self.tabs.active == "gpus-tab":  # hidden tables are drawn on activation
            self._draw_gpus()

    @on(TabbedContent.TabActivated, pane="#gpus-tab")
    def _draw_gpus(self) -> None:
        if self.snapshot is not None:
            self.gpus.draw(self.snapshot, self.polled.snap.roles if self.polled else {})

    @on(RunPolled)
    def show_run(self, msg: RunPolled) -> None:
        self.polled = msg
        self.run_tab.take_log(msg, self.paused)
        if self.paused:
            return
        self.run_tab.show(msg)
        self._show_summary(msg)
        self.server_tab.show(msg.snap.server)
        self.eval.show(msg.view, msg.snap)
        self.notes.show(msg.view)

    def _show_summary(self, msg: RunPolled) -> None:
        flags = " ".join(f for f, on in (("PAUSED", self.paused), ("READ-ONLY", self.readonly)) if on)
        self.summary.set(views.summary(msg.snap, msg.view.current, self.snapshot), flags)

    @on(Outcome)
    def _tell(self, msg: Outcome) -> None:
        self.notify(msg.text, severity="information" if msg.ok else "error", timeout=8)

    # ---- keys: the app's own, and the tabs' routed to them
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Read-only: no key that changes the box or the run is bound, or shown. In the pager the tabs' keys
        and pause give way to its own (its n is the next match, not a note)."""
        if isinstance(self.screen, LogPager) and action in ("on_tab", "pause"):
            return False
        return not (self.readonly and action == "on_tab" and parameters[1] in WRITES)

    def action_on_tab(self, tab: str, action: str) -> None:
        getattr(self.tabs.get_pane(tab), f"action_{action}")()

    def action_leave_input(self) -> None:
        """Out of a text box, back to its tab (each tab says where its focus goes: the filter's to the log)."""
        if isinstance(self.focused, Input):
            pane = next((a for a in self.focused.ancestors if hasattr(a, "leave_input")), None)
            if pane is not None:
                pane.leave_input()
            else:
                self.set_focus(None)

    def open_log(self, stage: str) -> None:
        """The pager on `stage`'s log and its servers' logs."""
        if isinstance(self.screen, LogPager):
            self.pop_screen()
        self.push_screen(LogPager(stage_logs(self.rundir, stage), self.interval))

    # ---- the command palette (ctrl+p): the console's own commands before Textual's
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for tab, title, what in TABS:
            yield SystemCommand(f"Tab {title}", what, partial(self.action_tab, tab))
        if not self.readonly:
            for action, title, what in SERVER_COMMANDS:  # the Server tab's own actions: the same questions
                yield SystemCommand(f"Server: {title}", what, partial(self.action_on_tab, "server", action))
            yield SystemCommand("Note: write a note", "into the run's notes",
                                partial(self.action_on_tab, "notes", "note"))
            yield SystemCommand("Export the notes", "notes.md into the run (the report)",
                                partial(self.action_on_tab, "notes", "export"))
        for stage in self.watcher.stage_names:
            yield SystemCommand(f"Log: {stage}", f"{stage}'s log and its servers' logs, in the pager",
                                partial(self.open_log, stage))
        yield SystemCommand("Pause / resume the display", "collection continues", self.action_pause)
        yield from super().get_system_commands(screen)

    def action_pause(self) -> None:
        self.paused = not self.paused
        if self.polled:
            self._show_summary(self.polled)
        self.notify("display paused (collection continues)" if self.paused else "display resumed")

    def action_tab(self, tab: str) -> None:
        if isinstance(self.screen, LogPager):  # 1–5 leave the pager for the tab
            self.pop_screen()
        # A focused widget in the pane being hidden would pull the tab back to it: focus leaves it first.
        self.set_focus(None)
        self.tabs.active = {"gpus": "gpus-tab"}.get(tab, tab)


def main(run_dir: Path, readonly: bool = False, interval: float = 1.0) -> int:
    import signal

    app = ConsoleApp(run_dir, readonly=readonly, interval=interval)
    # A closed SSH session sends SIGHUP: leave cleanly; the job runs in its own session and continues.
    signal.signal(signal.SIGHUP, lambda *_: app.call_later(app.exit))
    app.run()
    return 0
