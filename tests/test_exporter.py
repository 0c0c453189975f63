"""`eagle3-console exporter`: runs and GPUs as Prometheus metrics, scraped over HTTP from the real command
and read back with prometheus_client's own parser (issue 28 item 1)."""
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.host import gpu
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from tests.conftest import stages_until_train_running
from tests.helpers import ROOT, TINY, cli, free_port, spawn_cli


def samples(text: str) -> dict:
    """{(metric, frozenset(labels without host)): value}, every host label this machine's."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("host") == socket.gethostname()
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict, name: str, **labels):
    return got.get((name, frozenset(labels.items())))


@pytest.fixture
def exporter():
    procs = []

    def start(*args):
        proc = spawn_cli("exporter", *args, "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        line = proc.stdout.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line).group(1))
        return proc, f"http://127.0.0.1:{port}/metrics", line
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return samples(resp.read().decode())


def training_run(tmp_path):
    """A run whose train stage is running (this test process stands as its runner), 2 of 48 epochs done
    after 120 s, its trainer's last step 9 % waiting for data."""
    profile = load_profile(TINY, {"run.runs_dir": str(tmp_path / "runs"), "server.port": free_port()})
    run = RunDir.create(profile, tmp_path / "runs" / "busy")
    state = json.loads(run.state_path.read_text())
    state["stages"] = {"preflight": {"status": "done", "seconds": 0.4, "figures": {}}, **stages_until_train_running()}
    state["runner"] = {"pid": os.getpid(), "since": psutil.Process().create_time()}
    run.state_path.write_text(json.dumps(state))
    t0 = time.time() - 180
    events = [{"t": t0, "stage": "train", "kind": "start"},
              {"t": t0 + 120, "stage": "train", "kind": "metric", "step": 143, "train/loss": 0.0125,
               "profile/fetch_frac": 0.09, "profile/tokens_per_s": 4321.0},
              {"t": t0 + 120, "stage": "train", "kind": "progress", "done": 2, "total": 48, "unit": "epochs"}]
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_scrape_parses_with_the_runs_figures_and_the_gpus(exporter, finished_run, tmp_path):
    busy = training_run(tmp_path)
    proc, url, line = exporter(finished_run, "--runs-dir", tmp_path / "runs")
    assert str(finished_run.resolve()) in line and "every run under" in line
    got = scrape(url)
    done = RunDir.open(finished_run).read_state()["stages"]
    fin = finished_run.name
    assert value(got, "eagle3_run_state", run=fin, profile="tiny", state="finished") == 1
    assert value(got, "eagle3_run_state", run=fin, profile="tiny", state="running") == 0
    assert value(got, "eagle3_stage_state", run=fin, stage="train", state="done") == 1
    assert value(got, "eagle3_stage_state", run=fin, stage="deploy-measure", state="n/a") == 1  # tiny: offline only
    train, offline = done["train"]["figures"], done["evaluate-offline"]["figures"]
    assert value(got, "eagle3_tau", run=fin, source="offline") == pytest.approx(offline["tau"])
    assert value(got, "eagle3_train_loss", run=fin, split="val") == pytest.approx(train["val_loss_epoch"])
    assert value(got, "eagle3_train_tokens_per_second", run=fin, stage="train") == pytest.approx(train["tokens_per_s"])
    assert value(got, "eagle3_tau", run=fin, source="vllm") is None  # never measured: no sample, not a zero
    # the running run, found under --runs-dir: live progress, ETA, loss, data wait
    assert value(got, "eagle3_run_state", run="busy", profile="tiny", state="running") == 1
    assert value(got, "eagle3_stage_state", run="busy", stage="train", state="running") == 1
    assert value(got, "eagle3_stage_progress_ratio", run="busy", stage="train") == pytest.approx(2 / 48)
    assert value(got, "eagle3_stage_eta_seconds", run="busy", stage="train") == pytest.approx(46 * 60 - 60, abs=30)
    assert value(got, "eagle3_train_loss", run="busy", split="train") == pytest.approx(0.0125)
    assert value(got, "eagle3_train_data_wait_ratio", run="busy") == pytest.approx(0.09)
    assert value(got, "eagle3_train_tokens_per_second", run="busy", stage="train") == pytest.approx(4321.0)
    # the GPUs through the NVML chokepoint: whatever this machine has
    snap = gpu.sample()
    assert value(got, "eagle3_nvml_up") == (snap.unavailable is None)
    for g in snap.gpus:
        assert value(got, "eagle3_gpu_memory_total_bytes", gpu=str(g.index), name=g.name) == g.mem_total
    # a run that appears under --runs-dir is exported on the next scrape, and one that goes is not
    later = RunDir.create(load_profile(TINY), tmp_path / "runs" / "later")
    assert value(scrape(url), "eagle3_run_state", run="later", profile="tiny", state="not started") == 1
    later.profile_path.unlink()
    assert value(scrape(url), "eagle3_run_state", run="later", profile="tiny", state="not started") is None
    assert busy.root.name == "busy"
    # loopback only, and a stop signal ends it cleanly
    listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == "LISTEN"]
    assert listening == ["127.0.0.1"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "Traceback" not in proc.stderr.read()


def test_bad_inputs_end_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, says in (((tmp_path,), "not a run directory"),
                           (("--runs-dir", tmp_path / "none"), "--runs-dir"),
                           (("--port", "70000"), "--port 70000: not a port"),
                           (("--port", str(port)), f"exporter on 127.0.0.1:{port}: ")):
            proc = cli("exporter", *args, timeout=60)
            assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)
            assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_the_dashboard_asks_for_what_the_exporter_serves():
    """docs/grafana-eagle3.json: every metric its queries name is one the exporter declares (`g.add("name", "doc"`,
    and the per-GPU table's `("gpu_…", "doc"`)."""
    code = (ROOT / "pipeline" / "run" / "exporter.py").read_text()
    declared = {f"eagle3_{n}" for n in re.findall(r'(?:g\.add\(|\()\s*"([a-z_]+)", "', code)}
    dashboard = json.loads((ROOT / "docs" / "grafana-eagle3.json").read_text())
    asked = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"eagle3_\w+", t["expr"])}
    asked |= {m for v in dashboard["templating"]["list"] for m in re.findall(r"eagle3_\w+", v.get("query", ""))}
    assert {"eagle3_gpu_power_watts", "eagle3_run_state"} <= declared
    assert asked and asked <= declared, asked - declared
