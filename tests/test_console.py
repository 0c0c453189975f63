"""The console driven with Textual's Pilot over injected, deterministic run files."""
import asyncio
import os
import signal
import socket
import subprocess
import time

import pytest
from textual.widgets import Button, DataTable, Log, Static

from console.app import ConfirmScreen, ConsoleApp, HelpScreen
from pipeline import gpu, notes, procs
from pipeline.profile import load_profile
from pipeline.rundir import RunDir
from pipeline.server import ServerRecord
from pipeline.stages import stage_names
from tests.conftest import TINY
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, h200


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run(tmp_path):
    profile = load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs"), "server.port": free_port()})
    run = RunDir.create(profile, tmp_path / "run")
    run.update_stage("build-target", status="done", seconds=1.5, figures={"params": 1115264})
    run.update_stage("regenerate", status="done", seconds=4.0, figures={})
    run.update_stage("prepare", status="running")
    run.emit("prepare", "start")
    run.emit("prepare", "progress", done=30, total=120, unit="rows")
    run.logs_dir.mkdir(exist_ok=True)
    run.log_path("prepare").write_text("".join(f"line {i} {'alpha' if i % 2 else 'beta'}\n" for i in range(40)))
    notes.add(run, "prepare started", source="auto", stage="prepare")
    return run


def sampler(gpus):
    fake = FakeNvml(gpus)

    def sample():
        gpu.use_nvml(fake)
        return gpu.sample()
    return sample


def text_of(table: DataTable) -> str:
    return "\n".join(" | ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count))


def run_app(app, coro, size=(120, 40)):
    async def main():
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.6)
            await coro(app, pilot)
    asyncio.run(main())


def test_stage_panel_progress_and_log(run):
    async def check(app, pilot):
        stages = text_of(app.query_one("#stages", DataTable))
        assert "build-target | ✔ done" in stages and "prepare | ▶ running" in stages
        assert "30/120 rows" in stages and "· pending" in stages
        log = app.query_one("#log", Log)
        assert log.line_count == 40 and log.lines[-1] == "line 39 alpha"
        with open(run.log_path("prepare"), "a") as fh:
            fh.write("\x1b[31mline 40 alpha\x1b[0m\n")
        await pilot.pause(1.2)
        assert log.lines[-1] == "line 40 alpha"  # tail followed, ANSI stripped
        await pilot.press("slash")
        await pilot.press(*"alpha", "enter")
        await pilot.pause(0.2)
        assert log.line_count == 21 and all("alpha" in l for l in log.lines)
        summary = str(app.query_one("#summary").text)
        assert "stage prepare" in summary and "no NVML" in summary

    import pynvml
    gpu.use_nvml(pynvml)
    run_app(ConsoleApp(run.root), check)


def test_gpu_panel_na_field_lost_gpu_and_processes(run):
    gpus = [h200(0, fail={"temperature": NVML_ERROR_NOT_SUPPORTED}), h200(1, fail={"memory": NVML_ERROR_GPU_IS_LOST}),
            h200(2, procs=[(os.getpid(), 5 << 30)])]

    async def check(app, pilot):
        await pilot.press("2")
        await pilot.pause(0.3)
        rows = app.w["gpus"].plain.splitlines()
        assert "N/A" in rows[0] and "40%" in rows[0]
        assert "GPU LOST" in rows[1]
        assert "42%" in rows[2] and "22.0/141G" in rows[2]
        procs_ = text_of(app.query_one("#gpu-procs", DataTable))
        assert str(os.getpid()) in procs_ and "5.0GiB" in procs_

    try:
        run_app(ConsoleApp(run.root, sampler=sampler(gpus)), check)
    finally:
        import pynvml
        gpu.use_nvml(pynvml)


def test_no_nvml_panel_says_so(run):
    async def check(app, pilot):
        await pilot.press("2")
        await pilot.pause(0.3)
        assert "no NVIDIA GPU/driver found" in app.w["gpus"].plain

    import pynvml
    gpu.use_nvml(pynvml)
    run_app(ConsoleApp(run.root), check)


@pytest.fixture
def fake_server(run):
    """A real process group recorded as the port's server (the controller stops any group the same way)."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    profile = run.profile()
    from pipeline import box
    ctl = box.controller(profile)
    ctl.record_path.parent.mkdir(parents=True, exist_ok=True)
    ctl._save(ServerRecord(pid=proc.pid, pgid=proc.pid, host="127.0.0.1", port=profile.server.port,
                           mode="baseline", argv=["sleep", "300"], log="", started=time.time()))
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_stop_server_asks_naming_pid_and_port_then_stops(run, fake_server):
    async def check(app, pilot):
        await pilot.pause(0.5)
        await pilot.press("x")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ConfirmScreen)
        question = str(app.screen.query_one("#question").render())
        assert str(fake_server.pid) in question and str(run.profile().server.port) in question
        await pilot.press("n")
        await pilot.pause(0.3)
        assert fake_server.poll() is None  # declined: nothing stopped
        await pilot.press("x")
        await pilot.pause(0.3)
        await pilot.press("y")
        for _ in range(50):
            await pilot.pause(0.2)
            if fake_server.poll() is not None:
                break
        assert fake_server.poll() is not None and procs.group_members(fake_server.pid) == []

    run_app(ConsoleApp(run.root), check)


def test_readonly_disables_every_control(run, fake_server):
    async def check(app, pilot):
        await pilot.pause(0.5)
        for key in ("x", "r", "m"):
            await pilot.press(key)
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ConfirmScreen)
        assert all(b.disabled for b in app.query(Button))
        assert fake_server.poll() is None
        assert "READ-ONLY" in str(app.query_one("#summary").text)

    run_app(ConsoleApp(run.root, readonly=True), check)


def test_notes_input_export_and_help(run):
    async def check(app, pilot):
        await pilot.press("n")
        await pilot.press(*"tau looks low", "enter")
        await pilot.pause(0.3)
        assert notes.read(run)[-1]["text"] == "tau looks low"
        await pilot.press("escape")
        app.set_focus(None)
        await pilot.press("e")
        await pilot.pause(0.2)
        assert "tau looks low" in (run.root / "notes.md").read_text()
        await pilot.press("question_mark")
        await pilot.pause(0.2)
        assert isinstance(app.screen, HelpScreen)

    run_app(ConsoleApp(run.root), check)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_fits_small_and_large_terminals(run, size):
    async def check(app, pilot):
        assert app.query_one("#stages", DataTable).row_count == len(stage_names())
        assert app.query_one("#summary").region.y == 0  # the summary line is on screen

    run_app(ConsoleApp(run.root), check, size=size)


def test_eval_tab_shows_matrix_decision_and_loss_curve(run):
    import json
    run.eval_dir.mkdir(exist_ok=True)
    (run.eval_dir / "online.json").write_text(json.dumps({
        "k": 3, "concurrency": [1], "decision": "do not deploy: speedup x0.72 at concurrency 1 (threshold x1.10)",
        "matrix": {"baseline": {"levels": {"1": {"output_tok_s": 240.0, "tpot_ms": 4.1, "speedup": 1.0}}},
                   "ngram": {"error": "ServerError: vLLM (ngram) exited with 1: numba missing"},
                   "eagle3": {"identical_outputs": True, "levels": {"1": {
                       "output_tok_s": 175.0, "tpot_ms": 5.7, "speedup": 0.729, "mean_acceptance_length": 1.8,
                       "acceptance_per_position": [0.55, 0.19, 0.06]}}}}}))
    for i, loss in enumerate([0.2, 0.1, 0.05, 0.02]):
        run.emit("train", "metric", step=i, **{"train/loss": loss})

    async def check(app, pilot):
        await pilot.press("5")
        await pilot.pause(0.3)
        rows = text_of(app.query_one("#matrix", DataTable)).splitlines()
        assert rows[0].startswith("baseline | 1 | 240.0")
        assert "ngram" in rows[1] and "numba missing" in rows[1]  # a refused method is a row saying why
        assert "1.800" in rows[2] and "0.55" in rows[2] and "✔ yes" in rows[2]
        assert "do not deploy" in rows[3]
        curve = str(app.query_one("#loss-curve", Static).render())
        assert "over 4 logged steps" in curve and "█" in curve

    run_app(ConsoleApp(run.root), check)
