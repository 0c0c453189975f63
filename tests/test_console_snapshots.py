"""SVG snapshots of the console at 80x24 and 160x48 from injected, deterministic data (fixed clock,
fixed events, an NVML stand-in). Baselines: `pytest tests/test_console_snapshots.py --snapshot-update`."""
import json
import os

import psutil
import pytest

from console.app import ConsoleApp
from pipeline.host import gpu
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from tests.conftest import TINY, stages_until_train_running
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, h200

T0 = 1_800_000_000.0


@pytest.fixture
def frozen_run(tmp_path):
    profile = load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs"), "server.port": 1})
    run = RunDir.create(profile, tmp_path / "run")
    state = json.loads(run.state_path.read_text())
    state["stages"] = stages_until_train_running()
    state["runner"] = {"pid": os.getpid(), "since": psutil.Process().create_time()}  # a live run
    run.state_path.write_text(json.dumps(state))
    events = [{"t": T0, "stage": "train", "kind": "start"},
              {"t": T0 + 40, "stage": "train", "kind": "progress", "done": 8, "total": 16, "unit": "epochs",
               "step": 143, "loss": 0.0123}]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    run.logs_dir.mkdir(exist_ok=True)
    run.log_path("train").write_text("".join(f"epoch {i // 18} step {i} train/loss=0.{900 - i:03d}\n"
                                             for i in range(30)))
    return run


def fake_sampler():
    fake = FakeNvml([h200(0, procs=[(999_999_001, 12 << 30)]), h200(1, fail={"temperature": NVML_ERROR_NOT_SUPPORTED}),
                     h200(2, fail={"memory": NVML_ERROR_GPU_IS_LOST}), h200(3)])

    def sample():
        gpu.use_nvml(fake)
        snap = gpu.sample()
        return gpu.GpuSnapshot(t=T0, gpus=snap.gpus)
    return sample


async def first_frame(pilot, seconds: float = 15.0):
    """Until the first full frame is drawn (its footer's line not empty) and the first poll of the run and of
    the GPUs has been shown: a fixed pause showed a frame without its footer on a loaded machine (two test
    workers on 2 cores), and once the stage table's cursor still on its first row, the poll not yet in."""
    import time

    from tests.test_console import screen_text

    def drawn() -> bool:
        app = pilot.app
        polled = getattr(app, "polled", True) is not None and getattr(app, "snapshot", True) is not None
        return polled and bool(screen_text(app).rstrip("\n").splitlines()[-1].strip())
    await pilot.pause(0.8)
    deadline = time.monotonic() + seconds
    while not drawn() and time.monotonic() < deadline:
        await pilot.pause(0.1)
    await pilot.pause(0.2)  # the refresh after the last message


@pytest.fixture(autouse=True)
def restore_nvml():
    yield
    import pynvml
    gpu.use_nvml(pynvml)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@pytest.mark.parametrize("tab", ["1", "2"])
def test_console_snapshot(snap_compare, frozen_run, size, tab):
    app = ConsoleApp(frozen_run.root, interval=3600, sampler=fake_sampler(), clock=lambda: T0 + 60)

    async def settle(pilot):
        await first_frame(pilot)
        await pilot.press(tab)
        await pilot.pause(0.5)

    assert snap_compare(app, terminal_size=size, run_before=settle)


@pytest.fixture
def finished_here():
    """A finished run at a fixed path: the Run tab names it (what next: the report's command)."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.test_console import finished_run
    where = Path(tempfile.gettempdir()) / "eagle3-console-snapshot"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    yield finished_run(where, 1)
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("keys", [(), ("l", "slash", *"alpha", "enter")], ids=["result", "pager"])
def test_finished_run_snapshot_at_80x24(snap_compare, finished_here, keys):
    """The result on the first screen (READ-ONLY kept, empty columns gone, the last log written), and the
    pager on it with a search."""
    app = ConsoleApp(finished_here.root, readonly=True, interval=3600, sampler=fake_sampler())

    async def settle(pilot):
        await first_frame(pilot)
        await pilot.press(*keys)
        await pilot.pause(0.5)

    assert snap_compare(app, terminal_size=(80, 24), run_before=settle)
