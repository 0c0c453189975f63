"""The one place that calls NVML (nvidia-ml-py). Every NVML error becomes an answer, never a crash:
no library / no driver -> None ("no NVIDIA GPU/driver found")."""
from __future__ import annotations

import threading

_lock = threading.Lock()
_state = {"init": None}  # None = not tried, True = ready, str = why not


def _init() -> bool:
    with _lock:
        if _state["init"] is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                _state["init"] = True
            except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ImportError…
                _state["init"] = f"{type(exc).__name__}: {exc}"
        return _state["init"] is True


def unavailable_reason() -> str | None:
    return None if _init() else str(_state["init"])


def gpu_memory_by_pid() -> dict[int, int] | None:
    """Bytes of GPU memory held per process on all GPUs; None when NVML is not available."""
    if not _init():
        return None
    import pynvml
    held: dict[int, int] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                held[proc.pid] = held.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
        except pynvml.NVMLError:
            continue  # a lost or unsupported GPU: the others still answer
    return held
