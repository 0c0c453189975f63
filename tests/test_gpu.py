import pytest

from pipeline import gpu
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, h200


@pytest.fixture
def nvml():
    def install(gpus):
        gpu.use_nvml(FakeNvml(gpus))
    yield install
    import pynvml
    gpu.use_nvml(pynvml)


def test_real_library_not_found_on_this_machine():
    import pynvml
    gpu.use_nvml(pynvml)
    snap = gpu.sample()
    assert snap.unavailable and "NVML" in snap.unavailable and snap.gpus == ()
    assert "no NVIDIA GPU/driver found" in snap.hint
    assert gpu.gpu_memory_by_pid() is None


def test_not_supported_field_is_na_and_lost_gpu_is_one_row(nvml):
    nvml([h200(0, fail={"temperature": NVML_ERROR_NOT_SUPPORTED}),
          h200(1, fail={"util": NVML_ERROR_GPU_IS_LOST}), h200(2, procs=[(4242, 3 << 30)])])
    snap = gpu.sample()
    g0, g1, g2 = snap.gpus
    assert g0.temp_c is None and g0.util_pct == 40 and not g0.lost  # N/A field, the rest still read
    assert g1.lost and g1.util_pct is None  # one lost GPU: one row, the others keep updating
    assert g2.util_pct == 42 and g2.processes[0].pid == 4242
    assert gpu.gpu_memory_by_pid() == {4242: 3 << 30}


def test_stage_monitor_summarises_utilization_memory_and_energy(nvml):
    import time
    nvml([h200(0), h200(1, fail={"temperature": NVML_ERROR_NOT_SUPPORTED})])
    with gpu.StageMonitor(interval=0.05) as mon:
        time.sleep(0.4)
    s = mon.summary()
    assert s["gpu0_util_mean"] == 40 and s["gpu1_util_max"] == 41
    assert s["gpu1_mem_peak_gib"] == 21.0
    assert 0 < s["gpu0_energy_wh"] < 300 * 0.5 / 3600 * 1.5  # 300 W for ≈0.4 s


def test_stage_monitor_is_silent_without_nvml():
    import pynvml
    gpu.use_nvml(pynvml)
    with gpu.StageMonitor(interval=0.05) as mon:
        pass
    assert mon.summary() is None
