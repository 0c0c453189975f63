"""Messages the console's threads post to the app; only the app's handlers touch widgets."""
from __future__ import annotations

from dataclasses import replace

from textual.message import Message

from pipeline import gpu
from pipeline.results import RunSnapshot
from pipeline.runview import RunView


class GpuSampled(Message):
    def __init__(self, snapshot: gpu.GpuSnapshot):
        super().__init__()
        self.snapshot = snapshot


class RunPolled(Message):
    """The run as it stands (`snap`: jobs.snapshot, stage rows without the output checks), its files as the
    watcher read them (`view`: progress, ETA, figures, with the snapshot's statuses), the new log lines, and
    the other nodes' lines (`peers`)."""

    def __init__(self, view: RunView, log_lines: list[str], log_name: str | None, snap: RunSnapshot,
                 peers: tuple[str, ...] = ()):
        super().__init__()
        self.view, self.log_lines, self.log_name, self.snap, self.peers = view, log_lines, log_name, snap, peers

    @property
    def server(self) -> dict:
        return self.snap.server

    def shown(self) -> tuple:
        """What the run panel shows: running stages' clocks only to the minute, as they are drawn."""
        stages = tuple(replace(s, elapsed_s=s.elapsed_s // 60, eta_s=s.eta_s and s.eta_s // 60)
                       if s.status == "running" and s.elapsed_s is not None else s for s in self.view.stages)
        return replace(self.view, stages=stages), self.log_name, self.snap, self.peers

    def same_as(self, other: RunPolled | None) -> bool:
        return other is not None and not self.log_lines and self.shown() == other.shown()


class Flash(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class Outcome(Message):
    """A piece of slow work finished: what to tell the operator, and whether it went well."""

    def __init__(self, text: str, ok: bool):
        super().__init__()
        self.text, self.ok = text, ok


class ServerActionDone(Outcome):
    pass


class NotesExported(Outcome):
    pass


class PortHeldByRun(Message):
    """A server command was refused: another process's run holds the serving port."""

    def __init__(self, what: str, mode: str | None, holder: dict):
        super().__init__()
        self.what, self.mode, self.holder = what, mode, holder
