"""The one place that calls NVML (nvidia-ml-py), as nvitop does: every call goes through `_query`,
every NVML error becomes an answer (a field N/A, a GPU lost, no library), never an exception. The
samples are immutable snapshots that a UI only renders."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

GIB = 1 << 30
NA = None  # a field NVML does not support (or would not tell) is None: rendered "N/A"

_lock = threading.Lock()
_state: dict = {"nvml": None, "init": None, "names": {}}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None
    name: str = ""


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    lost: bool = False
    util_pct: int | None = NA
    mem_used: int | None = NA
    mem_total: int | None = NA
    temp_c: int | None = NA
    power_w: float | None = NA
    power_limit_w: float | None = NA
    sm_clock_mhz: int | None = NA
    processes: tuple[GpuProcess, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class GpuSnapshot:
    t: float
    gpus: tuple[GpuSample, ...] = ()
    unavailable: str | None = None  # why there is no NVML at all (CI, laptops): the panel says so
    hint: str = ""


def _nvml():
    if _state["nvml"] is None:
        import pynvml
        _state["nvml"] = pynvml
    return _state["nvml"]


def use_nvml(module) -> None:
    """Swap the NVML module (tests inject one that raises chosen NVML errors); resets init."""
    with _lock:
        _state.update(nvml=module, init=None, names={})


def _init() -> bool:
    with _lock:
        if _state["init"] is None:
            try:
                _nvml().nvmlInit()
                _state["init"] = True
            except Exception as exc:  # noqa: BLE001 - LibraryNotFound, DriverNotLoaded, ImportError…
                _state["init"] = f"{type(exc).__name__}: {exc}"
        return _state["init"] is True


def unavailable_reason() -> str | None:
    return None if _init() else str(_state["init"])


class _Lost(Exception):
    pass


def _query(func, *args):
    """NotSupported / NoPermission / NotFound on a field -> N/A; GpuIsLost / Unknown -> the GPU is lost."""
    nv = _nvml()
    try:
        return func(*args)
    except nv.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in (getattr(nv, "NVML_ERROR_GPU_IS_LOST", -1), getattr(nv, "NVML_ERROR_UNKNOWN", -2)):
            raise _Lost(str(exc)) from None
        return NA


def _sample_one(i: int) -> GpuSample:
    nv = _nvml()
    name = _state["names"].get(i, f"GPU {i}")
    try:
        handle = _query(nv.nvmlDeviceGetHandleByIndex, i)
        if handle is NA:
            return GpuSample(index=i, name=name, lost=True, error="no handle")
        if i not in _state["names"]:
            got = _query(nv.nvmlDeviceGetName, handle)
            name = _state["names"][i] = (got.decode() if isinstance(got, bytes) else got) or name
        util = _query(nv.nvmlDeviceGetUtilizationRates, handle)
        mem = _query(nv.nvmlDeviceGetMemoryInfo, handle)
        temp = _query(nv.nvmlDeviceGetTemperature, handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        power = _query(nv.nvmlDeviceGetPowerUsage, handle)
        limit = _query(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        clock = _query(nv.nvmlDeviceGetClockInfo, handle, getattr(nv, "NVML_CLOCK_SM", 1))
        procs = _query(nv.nvmlDeviceGetComputeRunningProcesses, handle) or []
    except _Lost as exc:
        return GpuSample(index=i, name=name, lost=True, error=str(exc))
    return GpuSample(  # a field NVML would not tell (NA) stays NA
        index=i, name=name, util_pct=getattr(util, "gpu", NA), mem_used=getattr(mem, "used", NA),
        mem_total=getattr(mem, "total", NA), temp_c=temp, sm_clock_mhz=clock,
        power_w=power / 1000 if power is not NA else NA, power_limit_w=limit / 1000 if limit is not NA else NA,
        processes=tuple(GpuProcess(p.pid, getattr(p, "usedGpuMemory", None), _proc_name(p.pid)) for p in procs),
    )


def _proc_name(pid: int) -> str:
    try:
        import psutil
        return psutil.Process(pid).name()
    except Exception:  # noqa: BLE001 - gone, or another container's pid
        return "?"


def sample() -> GpuSnapshot:
    if not _init():
        return GpuSnapshot(t=time.time(), unavailable=str(_state["init"]),
                           hint="no NVIDIA GPU/driver found (NVML could not be loaded); everything else works")
    count = _query(_nvml().nvmlDeviceGetCount)
    return GpuSnapshot(t=time.time(), gpus=tuple(_sample_one(i) for i in range(count or 0)))


def gpu_memory_by_pid() -> dict[int, int] | None:
    """Bytes of GPU memory held per process on all GPUs; None when NVML is not available."""
    snap = sample()
    if snap.unavailable:
        return None
    held: dict[int, int] = {}
    for g in snap.gpus:
        for p in g.processes:
            held[p.pid] = held.get(p.pid, 0) + (p.used_bytes or 0)
    return held


class StageMonitor:
    """Samples all GPUs in a background thread while a stage runs; `summary()` gives, per GPU that was
    seen, mean/max utilization, peak memory and energy (power integrated over time). Nothing at all
    where NVML is unavailable."""

    def __init__(self, interval: float = 1.0, timeline=None):
        self.interval = interval
        self.timeline = timeline  # a JSON-lines file that gets {t, util, mem} per sample, for the report
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[GpuSnapshot] = []

    def __enter__(self) -> StageMonitor:
        if _init():
            self._thread = threading.Thread(target=self._loop, name="gpu-stage-monitor", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            snap = sample()
            self._samples.append(snap)
            if self.timeline is not None and snap.gpus:
                from pipeline.layout.atomicio import append_jsonl
                append_jsonl(self.timeline, {"t": snap.t, "util": {str(g.index): g.util_pct for g in snap.gpus},
                                             "mem": {str(g.index): g.mem_used for g in snap.gpus}})
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def summary(self) -> dict | None:
        if not self._samples:
            return None
        per_gpu: dict[int, dict] = {}
        for n, snap in enumerate(self._samples):
            dt = snap.t - self._samples[n - 1].t if n else 0.0
            for g in snap.gpus:
                if g.lost:
                    continue
                acc = per_gpu.setdefault(g.index, {"util": [], "mem": 0, "energy_j": 0.0})
                if g.util_pct is not None:
                    acc["util"].append(g.util_pct)
                acc["mem"] = max(acc["mem"], g.mem_used or 0)
                acc["energy_j"] += (g.power_w or 0.0) * dt
        out = {}
        for i, acc in per_gpu.items():
            util = acc["util"]
            out[f"gpu{i}_util_mean"] = round(sum(util) / len(util), 1) if util else None
            out[f"gpu{i}_util_max"] = max(util) if util else None
            out[f"gpu{i}_mem_peak_gib"] = round(acc["mem"] / 2**30, 2)
            out[f"gpu{i}_energy_wh"] = round(acc["energy_j"] / 3600, 3)
        return out or None
