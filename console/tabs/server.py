"""3 Server: the serving port's server, and its controls — each asks first; a run in progress holding the
port is a second question."""
from __future__ import annotations

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, TabPane

from console import commands, views
from console.messages import Outcome, PortHeldByRun
from console.screens import ConfirmScreen, ModeScreen
from console.widgets import QuietStatic
from pipeline import gpu
from pipeline.profile import Profile
from pipeline.rundir import RunDir
from pipeline.server import ServerError


class ServerTab(TabPane):
    KEYS = (Binding("x", "stop_server", "Stop server"), Binding("r", "restart_server", "Restart"),
            Binding("m", "start_mode", "Mode", show=False))

    def __init__(self, profile: Profile, rundir: RunDir, readonly: bool, note) -> None:
        self.info = QuietStatic(id="server-info", markup=False)  # argv, paths: "[" is not markup
        super().__init__("3 Server", self.info, Horizontal(
            Button("Stop (x)", id="stop_server", variant="error", disabled=readonly),
            Button("Restart (r)", id="restart_server", variant="warning", disabled=readonly),
            Button("Start in mode… (m)", id="start_mode", disabled=readonly), id="buttons"), id="server")
        self.profile, self.rundir = profile, rundir
        self.note = note  # the notes tab's: a server command is written into the notes
        self.server: dict = {"state": "none"}
        self.snapshot: gpu.GpuSnapshot | None = None

    def show(self, server: dict) -> None:
        self.server = server
        self.info.show(views.server_text(server, self.profile))

    def _gpus_of(self, pids: list[int]) -> str:
        if not self.snapshot or self.snapshot.unavailable:
            return "no GPUs (no NVML)"
        idx = sorted({g.index for g in self.snapshot.gpus for p in g.processes if p.pid in pids})
        return "GPUs " + ", ".join(map(str, idx)) if idx else "no GPU memory held"

    def _confirm_then(self, question: str, what: str, mode: str | None) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.server_command(what, mode)

        holder = commands.port_holder(self.profile)
        warning = f"\n{views.holder_text(holder)} is using this server." if holder else ""
        self.app.push_screen(ConfirmScreen(question + warning), answered)

    def action_stop_server(self) -> None:
        s = self.server
        if s.get("state") != "running":
            self.notify("no server is running on the port", severity="warning")
            return
        self._confirm_then(f"Stop the {s['mode']} vLLM server?\nPIDs {s.get('pids')} (process group {s['pgid']}), "
                           f"port {s['port']}, {self._gpus_of(s.get('pids', []))}.", "stop", None)

    def action_restart_server(self) -> None:
        s = self.server
        mode = s.get("mode") if s.get("state") == "running" and s.get("mode") != "adopted" else "production"
        self._confirm_then(f"Restart the server in {mode} mode?\nStops PIDs {s.get('pids', [])} on port "
                           f"{self.profile.server.port} ({self._gpus_of(s.get('pids', []))}) first.", "start", mode)

    def action_start_mode(self) -> None:
        def chosen(mode: str | None) -> None:
            if mode:
                s = self.server
                stops = f"\nStops PIDs {s.get('pids')} ({s.get('mode')}) first." if s.get("state") == "running" else ""
                self._confirm_then(f"Start {mode} on port {self.profile.server.port}?{stops}", "start", mode)

        self.app.push_screen(ModeScreen(), chosen)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        getattr(self, f"action_{event.button.id}")()  # each button's id names its action

    @work(thread=True, exclusive=True, group="server", exit_on_error=False)
    def server_command(self, what: str, mode: str | None, held_by: dict | None = None) -> None:
        """Stop or start the port's server; `held_by`: the operator chose to force it past that run."""
        forced = f" (forced: {views.holder_text(held_by)} held the port)" if held_by else ""
        try:
            done = commands.serve(self.profile, self.rundir, what, mode, force=held_by is not None)
            self.post_message(Outcome(done + forced, True))
        except commands.PortHeld as exc:
            self.post_message(PortHeldByRun(what, mode, exc.holder))
        except (ServerError, ValueError, OSError) as exc:
            self.post_message(Outcome(str(exc), False))

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

        self.app.push_screen(ConfirmScreen(question), answered)

    @on(Outcome)
    def _server_done(self, msg: Outcome) -> None:
        self.note(f"console: server {msg.text}", source="operator")
