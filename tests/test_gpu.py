import json

import pytest

from pipeline.host import gpu
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, GiB, h200
from tests.helpers import wait_for


@pytest.fixture
def real_nvml():
    """The installed NVML, whatever this machine has: no library (CI, laptops) or real GPUs."""
    import pynvml
    gpu.use_nvml(pynvml)
    yield


@pytest.fixture
def nvml(real_nvml):
    def install(gpus):
        gpu.use_nvml(FakeNvml(gpus))
    yield install
    import pynvml
    gpu.use_nvml(pynvml)


def timeline(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def test_real_nvml_is_reported_as_found(real_nvml):
    """Without NVML (CI): one reason, no rows, no exception. With it (a GPU box): one row per GPU."""
    snap = gpu.sample()
    if snap.unavailable:
        assert "NVML" in snap.unavailable and snap.gpus == ()
        assert "no NVIDIA GPU/driver found" in snap.hint
        assert gpu.unavailable_reason() == snap.unavailable
        assert gpu.gpu_memory_by_pid() is None
    else:
        assert snap.hint == "" and gpu.unavailable_reason() is None
        assert [g.index for g in snap.gpus] == list(range(len(snap.gpus)))
        for g in snap.gpus:
            assert g.name and (g.lost or (g.mem_total or 0) > 0), g
        held = gpu.gpu_memory_by_pid()
        assert isinstance(held, dict)  # {} when no process holds GPU memory, never None


def test_not_supported_field_is_na_and_lost_gpu_is_one_row(nvml):
    nvml([h200(0, fail={"temperature": NVML_ERROR_NOT_SUPPORTED}),
          h200(1, fail={"util": NVML_ERROR_GPU_IS_LOST}), h200(2, procs=[(4242, 3 << 30)])])
    snap = gpu.sample()
    g0, g1, g2 = snap.gpus
    assert g0.temp_c is None and g0.util_pct == 40 and not g0.lost  # N/A field, the rest still read
    assert g1.lost and g1.util_pct is None  # one lost GPU: one row, the others keep updating
    assert g2.util_pct == 42 and g2.processes[0].pid == 4242
    assert gpu.gpu_memory_by_pid() == {4242: 3 << 30}


def test_stage_monitor_summarises_utilization_memory_and_energy(nvml, tmp_path):
    nvml([h200(0), h200(1, fail={"temperature": NVML_ERROR_NOT_SUPPORTED})])
    path = tmp_path / "timeline.jsonl"
    with gpu.StageMonitor(interval=0.05, timeline=path) as mon:
        wait_for(lambda: len(timeline(path)) >= 4, what="four GPU samples")
    s = mon.summary()
    assert s["gpu0_util_mean"] == 40 and s["gpu1_util_max"] == 41
    assert s["gpu1_mem_peak_gib"] == 21.0 and s["gpu0_mem_peak_gib"] == h200(0)["used"] / GiB
    # Power integrated over the samples actually taken (300 W between the first and the last one),
    # whatever the time a busy machine took between them.
    samples = timeline(path)
    span = samples[-1]["t"] - samples[0]["t"]
    assert span > 0
    assert s["gpu0_energy_wh"] == pytest.approx(300 * span / 3600, abs=1e-3)


def test_stage_monitor_samples_only_where_nvml_is(real_nvml, tmp_path):
    """No NVML: no thread, no summary, no timeline. NVML on a GPU box: a summary for every GPU it saw."""
    path = tmp_path / "timeline.jsonl"
    snap = gpu.sample()
    with gpu.StageMonitor(interval=0.05, timeline=path) as mon:
        if not snap.unavailable and snap.gpus:
            wait_for(lambda: len(timeline(path)) >= 2, what="two GPU samples")
    s = mon.summary()
    healthy = [g.index for g in snap.gpus if not g.lost]
    if snap.unavailable:
        assert s is None and not path.exists()
    elif healthy:
        assert s is not None and {f"gpu{i}_mem_peak_gib" for i in healthy} <= set(s)
    else:  # NVML without a usable GPU: samples, nothing to summarise
        assert s is None
