"""An NVML stand-in for tests only (no GPU on CI): pynvml's function names, and NVMLError raised with
pynvml's real error codes, so the console's degradation paths can be exercised."""
from types import SimpleNamespace

import pynvml

NVMLError = pynvml.NVMLError
NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
GiB = 1 << 30


class FakeNvml:
    """gpus: list of dicts; a dict may name `fail`: {function name: NVML error code}."""

    NVMLError = NVMLError
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = NVML_CLOCK_SM

    def __init__(self, gpus):
        self.gpus = gpus

    def _get(self, name, h):
        code = self.gpus[h].get("fail", {}).get(name)
        if code is not None:
            raise NVMLError(code)
        return self.gpus[h]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._get("name", h)["name"]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._get("util", h)["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._get("memory", h)
        return SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"])

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._get("temperature", h)["temp"]

    def nvmlDeviceGetPowerUsage(self, h):
        return self._get("power", h)["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._get("power_limit", h)["limit_mw"]

    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._get("clock", h)["sm"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self._get("procs", h).get("procs", [])]


def h200(i, **extra):
    return {"name": "NVIDIA H200", "util": 40 + i, "used": (20 + i) * GiB, "total": 141 * GiB, "temp": 50 + i,
            "power_mw": 300_000, "limit_mw": 700_000, "sm": 1980, "procs": [], **extra}
