"""2 GPUs: every GPU's fields with their history, and the processes on them with their roles in the run."""
from __future__ import annotations

from collections import deque

from textual.widgets import TabPane

from console import views
from console.formatting import human_bytes
from console.widgets import DiffTable, Grid
from pipeline.host import gpu

HISTORY = 60
GPU_COLUMNS = ("GPU", "name", "util", "history", "memory", "history", "temp", "power", "SM MHz")
PROCESS_COLUMNS = ("GPU", "PID", "process", "role", "GPU memory")


class GpusTab(TabPane):
    def __init__(self) -> None:
        self.grid, self.procs = Grid("gpus", GPU_COLUMNS), DiffTable(id="gpu-procs")
        self.procs.add_columns(*PROCESS_COLUMNS)
        super().__init__("2 GPUs", self.grid, self.procs, id="gpus-tab")
        self.history: dict[int, tuple[deque, deque]] = {}

    def sample(self, snap: gpu.GpuSnapshot) -> None:
        """Every sample goes into the history, shown or not."""
        for g in snap.gpus:
            util, mem = self.history.setdefault(g.index, (deque(maxlen=HISTORY), deque(maxlen=HISTORY)))
            util.append(g.util_pct or 0)
            mem.append(100 * g.mem_used / g.mem_total if g.mem_used and g.mem_total else 0)

    def draw(self, snap: gpu.GpuSnapshot, roles: dict[int, str]) -> None:
        """Every GPU with its history; every GPU process with its role: serving (the server's mode) or training."""
        hint: list[tuple] = [("-", snap.hint)] if snap.unavailable else []
        self.grid.set(hint + [views.gpu_row(g, *self.history.get(g.index, ((), ()))) for g in snap.gpus])
        self.procs.fill([(str(g.index), str(p.pid), p.name, roles.get(p.pid, ""), human_bytes(p.used_bytes))
                         for g in snap.gpus for p in g.processes])
