"""The console's server controls name what they touch (issue 43 item 4, the confirmations): each question
names the pids, process group, user, GPUs, host:port and argv it stops, and the argv, host:port, GPUs and
draft it starts; a vLLM that no record names is shown on the tab and stopped only by a question naming it;
the mode picker has every mode the CLI has. The registry is an isolated host-wide one (portlock.ENV)."""
# ruff: noqa: F811 - the console tests' fixtures (run, fake_server) are imported, then named as parameters
import os
import signal
import time

import pytest

from console.app import ConfirmScreen, ConsoleApp
from pipeline.host import portlock, procs
from pipeline.serving import vllm_modes
from tests.test_console import fake_server, question, run, run_app, until  # noqa: F401 - fixtures
from tests.test_host_registry import start_stand_in


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv(portlock.ENV, str(tmp_path / "e3-runtime"))


def built(run, tmp_path):
    """The run as if build-target had run (a target directory recorded; nothing is loaded by a question)."""
    target = tmp_path / "target"
    target.mkdir()
    run.update_stage("build-target", status="done", seconds=1.5, figures={"params": 1, "target_dir": str(target)})
    return target


def test_stop_names_pids_group_user_port_and_argv(run, fake_server):
    async def check(app, pilot):
        await pilot.pause(0.5)
        await until(pilot, lambda: f"user {procs.user_of(os.getpid())}" in str(app.query_one("#server-info").render()))
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        q = question(app)
        port = run.profile().server.port
        for named in (f"PIDs [{fake_server.pid}]", f"process group {fake_server.pid}", f"127.0.0.1:{port}",
                      "argv: sleep 300", f"user {procs.user_of(os.getpid())}", "no GPUs (no NVML)"):
            assert named in q, (named, q)
        await pilot.press("n")

    run_app(ConsoleApp(run.root), check)


def test_an_unrecorded_vllm_is_shown_and_stopped_only_by_a_question_naming_it(run, tmp_path):
    port = run.profile().server.port
    server = start_stand_in(tmp_path, port)
    try:
        async def check(app, pilot):
            info = lambda: str(app.query_one("#server-info").render())  # noqa: E731
            await until(pilot, lambda: "no record names" in info(), seconds=15)
            assert f"pid {server.pid}" in info() and "entrypoints_openai_api_server.py" in info()
            await pilot.press("x")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            q = question(app)
            assert "no record names" in q and f"pid {server.pid} (process group {server.pid})" in q
            assert f"127.0.0.1:{port}" in q and "entrypoints_openai_api_server.py" in q
            await pilot.press("n")
            await pilot.pause(0.5)
            assert server.poll() is None  # declined: nothing stopped
            await pilot.press("x")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
            await until(pilot, lambda: server.poll() is not None, seconds=20)

        run_app(ConsoleApp(run.root), check)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_mode_picker_has_every_cli_mode_and_a_start_names_argv_port_gpus_and_draft(run, fake_server, tmp_path):
    built(run, tmp_path)
    run.draft_dir.mkdir(parents=True, exist_ok=True)
    (run.draft_dir / "config.json").write_text("{}")

    async def check(app, pilot):
        await pilot.pause(0.5)
        await pilot.press("m")
        await pilot.pause(0.3)
        shown = [b.id.removeprefix("mode-") for b in app.screen.query("Button")]
        assert shown == list(vllm_modes.MODES) and "ngram" in shown
        await pilot.click("#mode-speculative")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        q = question(app)
        port = run.profile().server.port
        assert f"Start speculative on 127.0.0.1:{port}" in q and f"draft {run.draft_dir}" in q
        assert "argv: " in q and "vllm.entrypoints.openai.api_server" in q and str(run.draft_dir) in q
        assert "no GPUs (no NVML)" in q
        # what it stops first, named as a stop is
        assert f"Stops first: the baseline vLLM on 127.0.0.1:{port}: PIDs [{fake_server.pid}]" in q
        assert "argv: sleep 300" in q
        await pilot.press("n")
        await pilot.pause(0.3)
        assert fake_server.poll() is None

    run_app(ConsoleApp(run.root), check)


def test_restart_names_what_it_stops_and_starts_not_an_empty_pid_list(run, tmp_path):
    built(run, tmp_path)

    async def check(app, pilot):
        await pilot.pause(0.5)
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        q = question(app)
        assert "PIDs []" not in q and "Stops first" not in q  # nothing serves the port: nothing to stop is said
        assert f"Restart the server as production on {run.profile().server.host}:{run.profile().server.port}" in q
        assert "argv: " in q and "vllm.entrypoints.openai.api_server" in q
        await pilot.press("n")

    run_app(ConsoleApp(run.root), check)


def test_a_server_the_question_did_not_name_is_not_stopped(run, fake_server):
    """The consent is bound to the pid the question named: another server there by then is refused."""
    from console import commands
    with pytest.raises(commands.ports.ServerError, match=f"now served by pid {fake_server.pid}, not pid 1 as asked"):
        commands.serve(run.profile(), run, "stop", None, force=False, expect=1)
    time.sleep(0.2)
    assert fake_server.poll() is None
