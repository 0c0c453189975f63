"""3 Server: the serving port's server, and its controls — each asks first, naming what it stops (pids,
process group, user, GPUs, host:port, argv) and what it starts (argv, draft, host:port, GPUs); a run in
progress holding the port is a second question. The port is the host's: the server shown may be another
folder's run's, or a vLLM that no record names."""
from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Label, TabPane

from console import commands, views
from console.messages import Outcome, PortHeldByRun
from console.screens import ConfirmScreen, ModeScreen
from console.widgets import QuietStatic
from pipeline.host import gpu
from pipeline.layout.rundir import RunDir
from pipeline.profile import Profile
from pipeline.serving.server import ServerError


class AnyModeScreen(ModeScreen):
    """The mode picker with every mode the CLI has (commands.MODES: ngram and regenerate too)."""

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Start the server in which mode?")
            for mode in commands.MODES:
                yield Button(mode, id=f"mode-{mode}", compact=True)  # one line each: six fit 80x24


def stopping_text(s: dict, gpus: str) -> str:
    """What a control stops, for its question: the server's pids, group, user, GPUs, host:port and argv."""
    argv = s.get("argv")
    argv = " ".join(argv) if isinstance(argv, list) else argv
    if s.get("state") == "unrecorded":
        return (f"the vLLM that no record names on {s['host']}:{s['port']}: pid {s['pid']} (process group "
                f"{s['pgid']}), user {s.get('user')}, {gpus}\n  argv: {argv}")
    whose = f", run {s['run']}" if s.get("run") else ", the operator's"
    return (f"the {s['mode']} vLLM on {s['host']}:{s['port']}: PIDs {s.get('pids')} (process group {s['pgid']}), "
            f"user {s.get('user', '?')}{whose}, {gpus}\n  argv: {argv}")


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
        self.asked_pid: int | None = None  # the server a refused command's question named

    def show(self, server: dict) -> None:
        self.server = server
        s = server
        if s.get("state") == "unrecorded":  # a listener this tool did not start: said, never hidden
            what = "a vLLM that no record names" if s.get("vllm") else "a process that is not vLLM"
            text = (f"{s['host']}:{s['port']}: {what} — pid {s.get('pid')} (process group {s.get('pgid')}), "
                    f"user {s.get('user')}\nargv: {s.get('argv')}")
        else:
            text = views.server_text(s, self.profile)
            if s.get("state") == "running":
                text += f"\nuser {s.get('user', '?')} · {('run ' + s['run']) if s.get('run') else 'the operator'}"
        if held := s.get("held_by"):
            text += f"\nheld by run {held.get('run')} (pid {held.get('pid')}, user {held.get('user', '?')})"
        self.info.show(text)

    def _gpus_of(self, pids: list[int]) -> str:
        if not self.snapshot or self.snapshot.unavailable:
            return "no GPUs (no NVML)"
        idx = sorted({g.index for g in self.snapshot.gpus for p in g.processes if p.pid in pids})
        return "GPUs " + ", ".join(map(str, idx)) if idx else "no GPU memory held"

    def _confirm_then(self, question: str, what: str, mode: str | None, expect: int | None = None) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.server_command(what, mode, expect=expect)

        holder = commands.port_holder(self.profile)
        warning = f"\n{views.holder_text(holder)} is using this server." if holder else ""
        self.app.push_screen(ConfirmScreen(question + warning), answered)

    def _stops(self) -> tuple[str, int | None] | None:
        """What a control stops first (its text and pid, the consent bound to it), ("", None) when nothing
        serves the port; None (said) when something is there that no control may stop."""
        s = self.server
        if s.get("state") == "running":
            return stopping_text(s, self._gpus_of(s.get("pids", []))), s["pid"]
        if s.get("state") == "unrecorded":
            if not s.get("vllm") or s.get("pid") is None:
                self.notify(f"port {s['port']} is in use by pid {s.get('pid')} (user {s.get('user')}): {s.get('argv')}"
                            f" — not vLLM or not visible to this user: not stopped from here", severity="error")
                return None
            return stopping_text(s, self._gpus_of([s["pid"]])), s["pid"]
        return "", None

    def _starting_text(self, mode: str) -> str | None:
        try:
            plan = commands.start_preview(self.profile, self.rundir, mode)
        except (ValueError, OSError) as exc:  # no draft, no target yet: said, nothing asked
            self.notify(f"{mode}: {exc}", severity="error")
            return None
        gpus = ("no GPUs (no NVML): vLLM on CPU" if not self.snapshot or self.snapshot.unavailable
                else f"GPUs {plan['gpus']}")
        draft = f", draft {plan['draft']}" if plan["draft"] else ""
        return f"{mode} on {plan['host']}:{plan['port']}, {gpus}{draft}\n  argv: {plan['argv']}"

    def action_stop_server(self) -> None:
        s = self.server
        if s.get("state") not in ("running", "unrecorded"):
            self.notify("no server is running on the port", severity="warning")
            return
        if (stops := self._stops()) is None:
            return
        self._confirm_then(f"Stop {stops[0]}?", "stop", None, stops[1])

    def _ask_start(self, what: str, mode: str) -> None:
        if (stops := self._stops()) is None or (starts := self._starting_text(mode)) is None:
            return
        first = f"\nStops first: {stops[0]}" if stops[0] else ""
        verb = "Restart the server as" if what == "restart" else "Start"
        self._confirm_then(f"{verb} {starts}{first}", what, mode, stops[1])

    def action_restart_server(self) -> None:
        s = self.server
        running = s.get("state") == "running" and s.get("mode") not in (None, "adopted")
        self._ask_start("restart", str(s["mode"]) if running else "production")

    def action_start_mode(self) -> None:
        def chosen(mode: str | None) -> None:
            if mode:
                self._ask_start("start", mode)

        self.app.push_screen(AnyModeScreen(), chosen)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        getattr(self, f"action_{event.button.id}")()  # each button's id names its action

    @work(thread=True, exclusive=True, group="server", exit_on_error=False)
    def server_command(self, what: str, mode: str | None, held_by: dict | None = None,
                       expect: int | None = None) -> None:
        """Stop or (re)start the port's server; `held_by`: the operator chose to force it past that run;
        `expect`: the pid the question named (nothing else is stopped)."""
        forced = f" (forced: {views.holder_text(held_by)} held the port)" if held_by else ""
        try:
            done = commands.serve(self.profile, self.rundir, what, mode, force=held_by is not None, expect=expect)
            self.post_message(Outcome(done + forced, True))
        except commands.PortHeld as exc:
            self.asked_pid = expect  # the second question keeps the first one's consent
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
                self.server_command(msg.what, msg.mode, held_by=msg.holder, expect=self.asked_pid)
            else:
                self.notify(f"nothing stopped: {run} keeps the server", severity="warning")

        self.app.push_screen(ConfirmScreen(question), answered)

    @on(Outcome)
    def _server_done(self, msg: Outcome) -> None:
        self.note(f"console: server {msg.text}", source="operator")
