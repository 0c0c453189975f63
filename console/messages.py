"""Messages the console's threads post to the app; only the app's handlers touch widgets."""
from __future__ import annotations

from dataclasses import dataclass, replace

from textual.message import Message

from pipeline.host import gpu
from pipeline.layout.results import RunSnapshot
from pipeline.run.runview import RunView


@dataclass
class GpuSampled(Message):
    snapshot: gpu.GpuSnapshot


@dataclass
class RunPolled(Message):
    """The run as it stands (`snap`: jobs.snapshot, stage rows without the output checks), its files as the
    watcher read them (`view`: progress, ETA, figures, with the snapshot's statuses), the new log lines, and
    the other nodes' lines (`peers`)."""

    view: RunView
    log_lines: list[str]
    log_name: str | None
    snap: RunSnapshot
    peers: tuple[str, ...] = ()

    def shown(self) -> tuple:
        """What the run panel shows: running stages' clocks only to the minute, as they are drawn."""
        stages = tuple(replace(s, elapsed_s=s.elapsed_s // 60, eta_s=s.eta_s and s.eta_s // 60)
                       if s.status == "running" and s.elapsed_s is not None else s for s in self.view.stages)
        return replace(self.view, stages=stages), self.log_name, self.snap, self.peers

    def same_as(self, other: RunPolled | None) -> bool:
        return other is not None and not self.log_lines and self.shown() == other.shown()


@dataclass
class Outcome(Message):
    """What to tell the operator, and whether it went well: a server command done, the notes exported, a read
    of the run that failed. The app shows it; it bubbles there from the tab that posted it."""

    text: str
    ok: bool


@dataclass
class PortHeldByRun(Message):
    """A server command was refused: another process's run holds the serving port."""

    what: str
    mode: str | None
    holder: dict
