"""The console driven with Textual's Pilot over injected, deterministic run files."""
import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from rich.console import Console
from textual.widgets import Button, DataTable, Log, Static

from console.app import ConfirmScreen, ConsoleApp, HelpScreen
from pipeline import gpu, notes, procs
from pipeline.profile import load_profile
from pipeline.rundir import RunDir
from pipeline.server import ServerRecord
from pipeline.stages import stage_names
from tests.conftest import ROOT, TINY, stages_until_train_running
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, h200


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_alive(run):
    """This test process as the run's runner: its running stage is live, not interrupted."""
    run.update_state(runner={"pid": os.getpid(), "since": psutil.Process().create_time()})


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
    runner_alive(run)
    return run


def sampler(gpus):
    fake = FakeNvml(gpus)

    def sample():
        gpu.use_nvml(fake)
        return gpu.sample()
    return sample


def text_of(table: DataTable) -> str:
    return "\n".join(" | ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count))


def screen_text(app) -> str:
    """The screen as the terminal shows it, as text (the same render as App.export_screenshot)."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def line_of(screen: str, stage: str) -> str:
    return next(line for line in screen.splitlines() if re.match(rf"\s*{re.escape(stage)}\s", line))


def question(app) -> str:
    assert isinstance(app.screen, ConfirmScreen)
    return str(app.screen.query_one("#question").render())


async def until(pilot, done, seconds=10.0):
    for _ in range(int(seconds / 0.1)):
        if done():
            return
        await pilot.pause(0.1)
    assert done()


def run_app(app, coro, size=(120, 40)):
    async def main():
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.6)
            # on a loaded machine the first full frame (footer included) can come later than that
            deadline = time.monotonic() + 15
            while not screen_text(app).rstrip("\n").splitlines()[-1].strip() and time.monotonic() < deadline:
                await pilot.pause(0.1)
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
        assert log.line_count == 21 and all("alpha" in line for line in log.lines)
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
        rows = app.gpus.grid.plain.splitlines()
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
        assert "no NVIDIA GPU/driver found" in app.gpus.grid.plain

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
        footer = screen_text(app).rstrip("\n").splitlines()[-1]
        assert not any(k in footer for k in ("Stop server", "Restart", "Note", "Export")), footer
        await pilot.press("n")  # no note field, and n does not open one
        await pilot.pause(0.2)
        assert not app.query_one("#note-input").display and app.tabs.active == "run"

    run_app(ConsoleApp(run.root, readonly=True), check)


def test_notes_input_export_and_help(run):
    async def check(app, pilot):
        await pilot.press("n")
        await pilot.press(*"tau looks low", "enter")
        await pilot.pause(0.3)
        assert notes.read(run)[-1]["text"] == "tau looks low"
        await pilot.press("escape")
        app.set_focus(None)
        await pilot.press("e")  # rendered in a thread worker: the file appears when it is done
        out = run.root / "notes.md"
        await until(pilot, lambda: out.exists())
        assert "tau looks low" in out.read_text()
        await pilot.press("question_mark")
        await pilot.pause(0.2)
        assert isinstance(app.screen, HelpScreen)

    run_app(ConsoleApp(run.root), check)


def test_notes_export_failure_is_a_notification(run):
    (run.root / "notes.md").mkdir()  # the export cannot replace a directory, not even as root
    told = []

    async def check(app, pilot):
        notify = app.notify
        app.notify = lambda message, **kw: told.append((message, kw.get("severity"))) or notify(message, **kw)
        app.set_focus(None)
        await pilot.press("e")
        await until(pilot, lambda: any("export failed" in m for m, _ in told))
        assert ("error" in [sev for m, sev in told if "export failed" in m]) and "notes.md" in str(told)
        assert app.is_running and app.return_code is None  # no traceback: the console carries on

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
        "deploy": False, "reason": "speedup x0.72 at concurrency 1 (threshold x1.10)",
        "matrix": {"baseline": {"levels": {"1": {"output_tok_s": 240.0, "tpot_ms": 4.1, "ttft_ms": 13.3,
                                                  "decode_tpot_ms": 2.36, "speedup": 1.0, "tokens_per_step": 1.0}}},
                   "ngram": {"error": "ServerError: vLLM (ngram) exited with 1: numba missing"},
                   "eagle3": {"identical_outputs": True, "levels": {"1": {
                       "output_tok_s": 175.0, "tpot_ms": 5.7, "speedup": 0.729, "mean_acceptance_length": 1.8,
                       "acceptance_per_position": [0.55, 0.19, 0.06], "tokens_per_step": 1.74}}}}}))
    for i, loss in enumerate([0.2, 0.1, 0.05, 0.02]):
        run.emit("train", "metric", step=i, **{"train/loss": loss})

    async def check(app, pilot):
        await pilot.press("5")
        await pilot.pause(0.3)
        rows = text_of(app.query_one("#matrix", DataTable)).splitlines()
        assert rows[0].startswith("baseline | 1 | 240.0 | 13.3 | 2.36")  # TTFT, then TPOT after the first token
        assert "ngram" in rows[1] and "numba missing" in rows[1]  # a refused method is a row saying why
        assert "1.800" in rows[2] and "0.55" in rows[2] and "✔ yes" in rows[2]
        assert len(rows) == 3  # the decision is not a table row (a cell cut it)
        decision = str(app.query_one("#decision", Static).render())
        assert "tokens per decode step at c = 1: baseline 1.00 · eagle3 1.74" in decision
        shown = " ".join(screen_text(app).split())  # wrapped, never cut: every word on screen
        assert "decision: do not deploy: speedup x0.72 at concurrency 1 (threshold x1.10)" in shown
        curve = str(app.query_one("#loss-curve", Static).render())
        assert "over 4 logged steps" in curve and "█" in curve

    run_app(ConsoleApp(run.root), check, size=(80, 24))
    run_app(ConsoleApp(run.root), check, size=(120, 40))


def test_the_run_tab_says_what_next_when_the_run_has_ended(run):
    """prepare recorded running, and no runner process behind it: interrupted."""
    state = json.loads(run.state_path.read_text())
    state.pop("runner", None)
    run.state_path.write_text(json.dumps(state))

    async def check(app, pilot):
        await pilot.pause(0.3)
        outcome = app.query_one("#outcome", Static)
        assert outcome.display and "next: its process is gone; resume with: eagle3-console run --resume" \
            in str(outcome.render())
        assert f"run --resume {run.root}" in " ".join(screen_text(app).split())

    run_app(ConsoleApp(run.root), check, size=(80, 24))
    run_app(ConsoleApp(run.root), check, size=(120, 40))


# ---------------------------------------------------------------- what fits on screen

T0 = 1_800_000_000.0
TRAIN_FIGURES = {"loss": "0.0123", "train/loss": "0.0125", "val/loss_epoch": "0.0211", "val_loss": "0.0211",
                 "step": "143"}


@pytest.fixture
def busy_run(tmp_path):
    """Six stages done; train running 3 minutes in, 2 of 48 epochs after 2 minutes (ETA 45 min), four figures."""
    profile = load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs"), "server.port": free_port()})
    run = RunDir.create(profile, tmp_path / "run")
    state = json.loads(run.state_path.read_text())
    state["stages"] = {"preflight": {"status": "done", "seconds": 0.4, "figures": {}}, **stages_until_train_running()}
    run.state_path.write_text(json.dumps(state))
    events = [{"t": T0, "stage": "train", "kind": "start"},
              {"t": T0 + 120, "stage": "train", "kind": "metric", "step": 143, "train/loss": 0.0125,
               "val/loss_epoch": 0.0211},
              {"t": T0 + 120, "stage": "train", "kind": "progress", "done": 2, "total": 48, "unit": "epochs",
               "step": 143, "loss": 0.0123}]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    runner_alive(run)
    return run


def busy_app(run):
    return ConsoleApp(run.root, interval=3600, clock=lambda: T0 + 180)  # 3 min in; 2 of 48 epochs at 2 min: ETA 45 min


def assert_figures_whole(line: str) -> list[str]:
    """Every figure on the line is one of the run's, written in full: none cut mid-number."""
    shown = re.findall(r"([\w/]+)=([^,\s]+)", line)
    assert all(TRAIN_FIGURES.get(k) == v for k, v in shown), line
    return [k for k, _ in shown]


def assert_footer_shows_the_keys(app, screen: str):
    footer = screen.rstrip("\n").splitlines()[-1]
    for binding in (b for b in app.BINDINGS if b.show):
        assert f"{app.get_key_display(binding)} {binding.description}" in footer, footer


@pytest.mark.parametrize("extra", [(), ("publish-online",)], ids=["12-stages", "13-stages"])
def test_80x24_shows_every_stage_its_status_readable_times_and_the_footer(busy_run, monkeypatch, extra):
    names = [*stage_names(), *extra]
    monkeypatch.setattr("console.app.stage_names", lambda: names)

    async def check(app, pilot):
        screen = screen_text(app)
        table = app.query_one("#stages", DataTable)
        assert table.row_count == len(names) and table.scrollbars_enabled == (False, False)
        assert table.region.bottom <= app.query_one("#log").region.y  # the log is below, not over it
        for name in names:
            status = "▶ running" if name == "train" else "· pending" if name in ("evaluate-offline", *extra) else \
                "  n/a" if name in ("measure-production", "pick-checkpoint", "deploy-measure", "handover") \
                else "✔ done"
            assert status in line_of(screen, name), screen
        train = line_of(screen, "train")
        assert "2/48 epochs" in train and " 3m " in train and "~45m" in train, train
        assert "loss" in assert_figures_whole(train)  # the most telling figure has room
        assert_footer_shows_the_keys(app, screen)

    run_app(busy_app(busy_run), check, size=(80, 24))


def test_120_columns_give_a_running_stage_its_figures(busy_run):
    async def check(app, pilot):
        screen = screen_text(app)
        train = line_of(screen, "train")
        assert len(assert_figures_whole(train)) == 4 and "…" not in train, train  # all four, whole
        assert "2/48 epochs" in train and "~45m" in train
        assert_footer_shows_the_keys(app, screen)

    run_app(busy_app(busy_run), check, size=(120, 40))


def test_a_failed_or_interrupted_stage_reads_so_with_its_error(busy_run):
    state = json.loads(busy_run.state_path.read_text())
    state["stages"]["vocab"] = {"status": "failed", "seconds": 0.5, "error": "OSError: [Errno 28] No space left"}
    del state["runner"]  # no process runs the job: its running stage was interrupted
    busy_run.state_path.write_text(json.dumps(state))

    async def check(app, pilot):
        screen = screen_text(app)
        assert "✖ failed" in line_of(screen, "vocab") and "[Errno 28] No space" in line_of(screen, "vocab")
        assert "✖ interrupted" in line_of(screen, "train") and "~45m" not in line_of(screen, "train")
        assert "job interrupted" in screen.splitlines()[0]

    run_app(busy_app(busy_run), check, size=(120, 40))


# ---------------------------------------------------------------- a run in progress holds the port

@pytest.fixture
def port_holder(run):
    """Another process's run holding the serving port's lock (the lock is per process)."""
    code = ("import sys, time; from pipeline import portlock; from pipeline.rundir import RunDir; "
            "r = RunDir.open(sys.argv[1]); fh = portlock.hold(r.profile(), r.root); print('held', flush=True); "
            "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run.root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_server_stop_while_a_run_holds_the_port_asks_again_naming_it(run, fake_server, port_holder):
    holder = f"{run.root} (pid {port_holder.pid})"

    async def second_question(app, pilot):
        await pilot.press("x")
        await pilot.pause(0.3)
        assert holder in question(app)  # the first question already names the run
        await pilot.press("y")  # the worker is refused (PortHeld): a second question, naming the run
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen) and "current stage will fail" in question(app))
        assert holder in question(app) and "anyway" in question(app)

    async def check(app, pilot):
        await pilot.pause(0.5)
        await second_question(app, pilot)
        await pilot.press("n")
        await pilot.pause(1.0)
        # no second yes: nothing stopped
        assert fake_server.poll() is None and not isinstance(app.screen, ConfirmScreen)
        await second_question(app, pilot)
        await pilot.press("y")
        await until(pilot, lambda: fake_server.poll() is not None)
        assert procs.group_members(fake_server.pid) == [] and port_holder.poll() is None  # the run itself goes on
        await pilot.pause(0.3)
        assert str(run.root) in notes.read(run)[-1]["text"]  # the run's notes record what was forced

    run_app(ConsoleApp(run.root), check)
