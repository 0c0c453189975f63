"""The console driven with Textual's Pilot over injected, deterministic run files."""
import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from rich.console import Console
from textual.widgets import Button, DataTable, Log, Static

from console.app import ConfirmScreen, ConsoleApp, HelpScreen
from pipeline.host import gpu, procs
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.report import notes
from pipeline.serving.server import ServerRecord
from pipeline.stages import stage_names
from tests.conftest import ROOT, TINY, stages_until_train_running
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, h200
from tests.helpers import free_port


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
    from pipeline.serving import ports
    ctl = ports.controller(profile)
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
        assert "READ-ONLY" in screen_text(app).splitlines()[0]
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
        # what decides first (speedup, τ, lossless), then tok/s, TTFT, TPOT after the first token
        assert rows[0].startswith("baseline | 1 | x1.0 | N/A |  | 240.0 | 13.3 | 2.36")
        assert "ngram" in rows[1] and "numba missing" in rows[1]  # a refused method is a row saying why
        assert rows[2].startswith("eagle3 | 1 | x0.729 | 1.800 | ✔ yes | 175.0") and "0.55" in rows[2]
        header = next(line for line in screen_text(app).splitlines() if "method" in line)
        assert "speedup" in header and "lossless" in header, header  # on screen at 80 columns too
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


@pytest.mark.parametrize("extra", [(), ("publish-online",)], ids=["13-stages", "14-stages"])
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
                "  n/a" if name in ("measure-production", "measure-existing", "pick-checkpoint", "deploy-measure",
                                    "handover") \
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
    code = ("import sys, time; from pipeline.host import portlock; from pipeline.layout.rundir import RunDir; "
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


# ---------------------------------------------------------------- no focus trap

def test_escape_leaves_the_note_box_and_the_keys_are_keys_again(run):
    async def check(app, pilot):
        await pilot.press("n", *"half a note")
        assert app.focused is app.notes.input
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert app.focused is not app.notes.input and app.tabs.active == "notes"
        await pilot.press("1", "space", "e")  # a tab, pause, export: none of them typed into the box
        await pilot.pause(0.3)
        assert app.tabs.active == "run" and app.paused and app.notes.input.value == "half a note"
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running)

    run_app(ConsoleApp(run.root), check)


def test_a_note_appended_gives_the_keys_back(run):
    async def check(app, pilot):
        await pilot.press("n", *"tau looks low", "enter")
        await pilot.pause(0.3)
        assert notes.read(run)[-1]["text"] == "tau looks low"
        await pilot.press("2")
        await pilot.pause(0.2)
        assert app.tabs.active == "gpus-tab" and app.notes.input.value == ""

    run_app(ConsoleApp(run.root), check)


def test_escape_leaves_the_filter_unapplied_and_tabs_switch_again(run):
    async def check(app, pilot):
        log = app.query_one("#log", Log)
        await pilot.press("slash", *"alp")
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert app.focused is log and not app.run_tab.filter.display  # nothing applied: the box goes
        assert log.line_count == 40
        await pilot.press("5")
        await pilot.pause(0.2)
        assert app.tabs.active == "eval"
        await pilot.press("1", "slash", *"alpha", "enter", "slash", *"beta", "escape")
        await pilot.pause(0.2)
        # the applied filter stays, in the box and in the log; the edit left unapplied is dropped
        assert app.run_tab.filter.display and app.run_tab.filter.value == "alpha"
        assert all("alpha" in line for line in log.lines)

    run_app(ConsoleApp(run.root), check)


def test_tab_keys_switch_from_a_focused_table(run):
    """A focused widget in the pane being hidden pulled the tab back to it: 1–5 did nothing from a table."""
    async def check(app, pilot):
        await pilot.press("tab")
        await pilot.pause(0.2)
        assert app.focused is app.query_one("#stages")
        await pilot.press("2")
        await pilot.pause(0.2)
        assert app.tabs.active == "gpus-tab"
        app.query_one("#gpu-procs").focus()
        await pilot.press("1")
        await pilot.pause(0.2)
        assert app.tabs.active == "run"

    run_app(ConsoleApp(run.root), check)


# ---------------------------------------------------------------- a finished run: its result and any stage's log

DECISION = "do not deploy: speedup x0.72 at concurrency 1 (threshold x1.10)"


@pytest.fixture
def finished(tmp_path):
    return finished_run(tmp_path, free_port())


def finished_run(where, port: int) -> RunDir:
    """Every stage done (no process behind it), deploy-measure's decision with its economics, each stage's log
    written but the handover's (empty, as a run's often is), deploy-measure's baseline server in its events."""
    profile = load_profile(TINY, {"run.runs_dir": str(where / "runs"), "server.port": port, "evaluate.online": True})
    run = RunDir.create(profile, where / "eagle3-demo-20260101T000000Z-a-long-run-name")
    figures = {"deploy": False, "reason": DECISION.split(": ", 1)[1], "decision": DECISION, "speedup": 0.729,
               "mean_acceptance_length": 1.8, "tokens_per_step": 1.74, "identical_outputs": True, "step_ms": 9.78,
               "baseline_step_ms": 4.1, "break_even_tau": 2.63, "deploy_speedup": 1.1, "gpu": False}
    state = json.loads(run.state_path.read_text())
    state["stages"] = {n: {"status": "done", "seconds": 1.5 + i, "figures": {}} for i, n in enumerate(stage_names())}
    state["stages"]["deploy-measure"]["figures"] = figures
    run.state_path.write_text(json.dumps(state))
    run.eval_dir.mkdir(exist_ok=True)
    (run.eval_dir / "online.json").write_text(json.dumps({
        "concurrency": [1, 4], "decision": DECISION, "deploy": False, "reason": figures["reason"],
        "matrix": {"baseline": {"levels": {"1": {"output_tok_s": 240.0, "speedup": 1.0},
                                           "4": {"output_tok_s": 800.0, "speedup": 1.0}}},
                   "eagle3": {"identical_outputs": True, "levels": {
                       "1": {"output_tok_s": 175.0, "speedup": 0.729, "tokens_per_step": 1.74},
                       "4": {"output_tok_s": 600.0, "speedup": 0.75}}}}}))
    run.logs_dir.mkdir(exist_ok=True)
    for name in stage_names():
        run.log_path(name).write_text("".join(f"{name} line {i} {'alpha' if i % 2 else 'beta'}\n" for i in range(40)))
    run.log_path("handover").write_text("")
    run.log_path("server-baseline").write_text("INFO vllm serving\nINFO alpha request\n")
    run.log_path("server-production").write_text("INFO production\n")
    run.emit("deploy-measure", "server", mode="baseline", method="baseline", pid=1, port=1, start_s=3.0)
    return run


def test_a_finished_run_shows_its_result_at_80_columns_and_the_last_log_written(finished):
    async def check(app, pilot):
        screen = screen_text(app)
        flat = " ".join(screen.split())
        assert f"✖ {DECISION}" in flat
        assert "τ 1.74 · speedup x0.73 at c=1, x0.75 at c=4 · pays from τ 2.63 · lossless ✔" in flat, screen
        assert screen.splitlines()[0].rstrip().endswith("READ-ONLY")  # the long run name gives way, not the flag
        header = next(line for line in screen.splitlines() if line.strip().startswith("stage"))
        assert "ETA" not in header and "progress" not in header, header  # nothing in them: not shown
        log = app.query_one("#log", Log)  # handover's log is empty: deploy-measure's is the last written
        assert app.run_tab.log_name == "deploy-measure" and log.lines[-1] == "deploy-measure line 39 alpha"
        assert "deploy-measure.log" in screen
        await pilot.press("space")
        await pilot.pause(0.2)
        assert screen_text(app).splitlines()[0].rstrip().endswith("PAUSED READ-ONLY")

    run_app(ConsoleApp(finished.root, readonly=True), check, size=(80, 24))


def test_enter_on_a_stage_opens_its_logs_in_a_pager_with_search_and_follow(finished):
    from console.pager import LogPager

    async def check(app, pilot):
        await pilot.press("tab")  # the stage table; its cursor sits on the stage whose log is shown
        await pilot.pause(0.2)
        assert app.focused is app.run_tab.stages and app.run_tab.stages.cursor_row == 11
        await pilot.press("up", "up", "up", "enter")  # train
        await pilot.pause(0.5)
        pager = app.screen
        assert isinstance(pager, LogPager) and pager.lines.lines[-1] == "train line 39 alpha"
        assert "train.log" in pager.title_line.text and "following" in pager.title_line.tail
        await pilot.press("up")  # scrolled up: held
        await pilot.pause(0.2)
        top = pager.lines.scroll_offset.y
        await pilot.press("slash", *"LINE 1", "enter")  # case-insensitive
        await pilot.pause(0.3)
        assert app.focused is pager.lines and pager.matches == [1, *range(10, 20)]
        # the first match from the top line shown down; the view put two lines above it
        first = next(n for n, line in enumerate(pager.matches) if line >= top)
        assert pager.match == first and pager.lines.scroll_offset.y == pager.matches[first] - 2
        assert "held: F follows" in pager.title_line.tail
        await pilot.press(*["n"] * (11 - first))  # wraps round to the first
        await pilot.pause(0.2)
        assert pager.match == 0 and pager.lines.scroll_offset.y == 0
        await pilot.press("n", "n")
        await pilot.pause(0.2)
        assert pager.match == 2 and pager.lines.scroll_offset.y == 11 - 2  # the match, two lines below the top
        assert "“LINE 1” 3/11 line 12 · held: F follows" in pager.title_line.tail
        await pilot.press("N")
        await pilot.pause(0.2)
        assert pager.match == 1
        with open(finished.log_path("train"), "a") as fh:
            fh.write("train line 40 new\n")
        await pilot.press("F")
        await until(pilot, lambda: pager.lines.lines[-1] == "train line 40 new")
        assert "following" in pager.title_line.tail
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert app.screen is not pager

        app.open_log("deploy-measure")  # its own server's log second, the run's other servers after
        await pilot.pause(0.3)
        pager = app.screen
        assert [p.name for p, _ in pager.logs] == ["deploy-measure.log", "server-baseline.log",
                                                  "server-production.log"]
        await pilot.press("right_square_bracket")
        await pilot.pause(0.3)
        assert pager.lines.lines[-1] == "INFO alpha request" and "(deploy-measure's server)" in pager.title_line.text
        await pilot.press("2")  # a tab key leaves the pager for that tab
        await pilot.pause(0.3)
        assert not isinstance(app.screen, LogPager) and app.tabs.active == "gpus-tab"

    run_app(ConsoleApp(finished.root, interval=3600), check, size=(80, 24))


def test_the_command_palette_holds_the_consoles_commands(run, fake_server):
    from console.pager import LogPager

    async def pick(app, pilot, words):
        await pilot.press("ctrl+p")
        await pilot.pause(0.3)
        await pilot.press(*words)
        await pilot.pause(0.6)
        await pilot.press("enter")
        await pilot.pause(0.4)

    async def check(app, pilot):
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Tab 4 Notes", "Export the notes", "Note: write a note", "Server: stop", "Server: restart",
                "Server: start in a mode", "Log: train"} <= set(titles)
        await pick(app, pilot, "server stop")  # the Server tab's own action: the same question
        assert isinstance(app.screen, ConfirmScreen) and str(fake_server.pid) in question(app)
        await pilot.press("n")
        await pilot.pause(0.2)
        await pick(app, pilot, "log: train")
        assert isinstance(app.screen, LogPager) and app.screen.logs[0][0].name == "train.log"
        await pilot.press("escape")
        await pick(app, pilot, "tab 5")
        assert app.tabs.active == "eval"

    run_app(ConsoleApp(run.root), check)


def test_a_readonly_palette_has_no_command_that_writes(run):
    async def check(app, pilot):
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert not [t for t in titles if t.startswith(("Server", "Note", "Export"))] and "Log: train" in titles

    run_app(ConsoleApp(run.root, readonly=True), check)


def test_the_result_line_shows_what_exists_and_tolerates_fields_it_does_not_know():
    from console import verdict
    from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult

    online = {"decision": "deploy: x1.43", "deploy": True, "reason": "x1.43", "concurrency": [1, 8],
              "considered": {"row": "eagle3-schedule"}, "schedule": {"per_level": {"1": 3, "8": 2}},
              "expected_speedup": {"median": 1.31, "lo": 1.2, "hi": 1.4}, "some_later_field": [1, 2],
              "matrix": {"eagle3": {"levels": {"1": {"speedup": 0.9}}},
                         "eagle3-schedule": {"identical_outputs": False, "numeric_ties": 2, "levels": {
                             "8": {"speedup": 1.12, "k": 2, "per_position": [0.5]}, "1": {"speedup": 1.43, "k": 3},
                             "mix": {"speedup": 1.3, "traffic": "chat"}}}}}
    v = verdict.verdict(online, DeployMeasureResult(), EvaluateOfflineResult())
    # the row weighed for deployment, its k per level, the expectation on the traffic; no τ, no break-even: not shown
    assert verdict.figures_line(v) == ("speedup x1.43 at c=1 k=3, x1.12 at c=8 k=2, x1.30 at c=mix · "
                                       "x1.31 expected on the traffic · lossless ✖: outputs differ (2 bf16 ties)")
    assert v["levels"]["8"] == {"speedup": 1.12, "k": 2} and v["levels"]["mix"]["traffic"] == "chat"
    assert verdict.result_lines(v).startswith("✔ deploy: x1.43")
    bare = verdict.verdict({"decision": "do not deploy: no head", "deploy": False, "reason": "no head"},
                           DeployMeasureResult(), EvaluateOfflineResult())
    assert verdict.result_lines(bare) == "✖ do not deploy: no head"  # nothing measured: the decision alone
    assert verdict.verdict({}, DeployMeasureResult(), EvaluateOfflineResult()) is None  # not decided yet


def test_status_prints_the_decision_and_why_and_json_has_them(finished):
    from tests.conftest import cli

    text = cli("status", finished.root, env={"COLUMNS": "80"})
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert f"decision: {DECISION}" in lines
    assert "  tau 1.74; speedup x0.73 at c=1, x0.75 at c=4; pays from tau 2.63; lossless yes" in lines
    assert any(line.startswith("why: a decode step with the head costs 9.8 ms") for line in lines)
    # within the terminal, but for a path longer than it: whole, to copy
    assert max(len(line) for line in lines if str(finished.root) not in line) <= 80, lines
    data = json.loads(cli("status", finished.root, "--json").stdout)["decision"]
    assert data["deploy"] is False and data["reason"] == DECISION.split(": ", 1)[1] and data["tau"] == 1.74
    assert data["speedup"] == {"1": 0.729, "4": 0.75} and data["break_even_tau"] == 2.63 and data["lossless"] is True
    assert data["step_ms"] == 9.78 and data["why"].startswith("a decode step")


def test_the_stage_cursor_stays_where_the_operator_put_it_when_the_table_is_laid_out_again(finished):
    """A narrower terminal lays the table out with other columns; clearing it put the cursor back on row 0,
    which also decided, on a loaded machine, whether the tab's first frame showed the running stage."""
    async def check(app, pilot):
        await pilot.press("tab", "up", "up", "up")  # from the stage whose log is shown (row 11) to train
        await pilot.pause(0.2)
        stages = app.run_tab.stages
        assert stages.cursor_row == 8
        before = stages._columns
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.3)
        assert stages._columns != before and stages.cursor_row == 8  # laid out again, the cursor kept

    run_app(ConsoleApp(finished.root, readonly=True), check, size=(160, 48))
