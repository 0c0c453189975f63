"""2 GPUs: every GPU's fields with their history, and the processes on them with their roles in the run."""
from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.widgets import TabPane

from console import views
from console.widgets import DiffTable, Grid
from pipeline import gpu

HISTORY = 60
GPU_COLUMNS = ("GPU", "name", "util", "history", "memory", "history", "temp", "power", "SM MHz")
PROCESS_COLUMNS = ("GPU", "PID", "process", "role", "GPU memory")


class GpusTab(TabPane):
    KEYS = ()

    def __init__(self) -> None:
        super().__init__("2 GPUs", id="gpus-tab")
        self.history: dict[int, tuple[deque, deque]] = {}
        self.grid, self.procs = Grid("gpus", GPU_COLUMNS), DiffTable(id="gpu-procs")

    def compose(self) -> ComposeResult:
        yield self.grid
        yield self.procs

    def on_mount(self) -> None:
        self.procs.add_columns(*PROCESS_COLUMNS)

    def sample(self, snap: gpu.GpuSnapshot) -> None:
        """Every sample goes into the history, shown or not."""
        for g in snap.gpus:
            util, mem = self.history.setdefault(g.index, (deque(maxlen=HISTORY), deque(maxlen=HISTORY)))
            util.append(g.util_pct or 0)
            mem.append(100 * g.mem_used / g.mem_total if g.mem_used and g.mem_total else 0)

    def draw(self, snap: gpu.GpuSnapshot, roles: dict[int, str]) -> None:
        self.grid.set(views.gpu_rows(snap, self.history))
        self.procs.fill(views.gpu_process_rows(snap, roles))
