"""Two nodes on one machine (issue 27 item 2): two runs of one profile, separate run directories as two hosts
would have, node ranks 0 and 1, one c10d rendezvous on 127.0.0.1, each node's own extraction server feeding its
own trainer online, training as one gloo job. Node 1 is lost mid-training (every process of it killed, as a
host that dies), node 0 says so in one line and shows node 1 through node 1's exporter, both resume, and the
head's final loss is the one-node run's with the same world size."""
import json
import socket
import subprocess

import psutil
import pytest

from pipeline.layout.rundir import RunDir
from tests.helpers import TINY, cli, free_port, spawn_cli, wait_for

ONLINE = ('extract.backend="vllm"', 'extract.mode="online"', "server.enforce_eager=true",
          "server.max_model_len=1024", 'server.dtype="float32"', "train.epochs=3")
TOLERANCE = 0.002  # the final train loss; measured equal to 4 decimals (0.0195 both, 2026-12-02)


def node_sets(rank: int, rdzv: int, cache_dir, exporters: list[str]) -> list[str]:
    sets = [*ONLINE, f'run.cache_dir="{cache_dir}"', "train.nnodes=2", f"train.node_rank={rank}",
            f'train.rdzv_endpoint="127.0.0.1:{rdzv}"', "extract.world_size=2", f"extract.rank={rank}",
            f"server.port={free_port()}", f"train.node_exporters={json.dumps(exporters)}"]
    return [a for kv in sets for a in ("--set", kv)]


def popen(*args) -> subprocess.Popen:
    return spawn_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kill_node(run_dir) -> list[int]:
    """Every process that belongs to the node's run (pipeline, extraction server, torchrun, trainer)."""
    killed = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run_dir) in cmd:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.Error:
                pass
    return killed


def wait_file(path, procs, timeout=600):
    def there() -> bool:
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        return path.exists()
    wait_for(there, timeout, f"{path} to appear", poll=0.2)


@pytest.mark.integration
def test_two_nodes_train_as_one_job_and_resume_after_losing_one(tmp_path, cache_dir):
    node0, node1 = tmp_path / "host-a" / "run", tmp_path / "host-b" / "run"
    node1.parent.mkdir(parents=True)
    exp = popen("exporter", "--runs-dir", node1.parent, "--port", "0")  # node 1's exporter, as host b runs it
    url = exp.stdout.readline().split()[2].rstrip(":")
    rdzv = free_port()
    procs = []
    try:
        first = [popen("run", TINY, "--no-tui", "--run-dir", node0, *node_sets(0, rdzv, cache_dir, [url])),
                 popen("run", TINY, "--no-tui", "--run-dir", node1, *node_sets(1, rdzv, cache_dir, []))]
        procs += first
        wait_file(node0 / "checkpoints" / "0" / "training_state.json", first)  # one epoch done, as one job
        # the kill first: a status call (a process's start) can outlast the last two tiny epochs on a loaded
        # box, and node 0 then ends whole (the fresh-clone CI, 2026-12-07)
        assert kill_node(node1)
        seen = cli("status", node0).stdout  # node 1 as its exporter still reports it: its last state
        assert f"node run on {socket.gethostname()}: running; train running" in seen, seen
        out, err = first[0].communicate(timeout=600)
        first[1].wait(timeout=60)
        assert first[0].returncode == 1, out[-2000:] + err[-2000:]
        lines = [line for line in err.strip().splitlines() if line.startswith("eagle3-console: error:")]
        assert len(lines) == 1 and "the training job across 2 nodes lost a node (gloo: connection " \
            in lines[0], err[-2000:]
        assert "Traceback" not in err
        assert "node run on" in (seen := cli("status", node0).stdout) and ": interrupted; train interrupted" in seen
        # both resume; node 0 hands node 1 the epoch it resumes from
        again = [popen("run", "--resume", node, "--no-tui") for node in (node0, node1)]
        procs += again
        for p in again:
            out, err = p.communicate(timeout=900)
            assert p.returncode == 0, out[-2000:] + err[-2000:]
    finally:
        for p in procs + [exp]:
            if p.poll() is None:
                p.kill()
    n0, n1 = RunDir.open(node0).read_state()["stages"], RunDir.open(node1).read_state()["stages"]
    # the epoch node 0 resumes from: 0, or 1 where it finished another before the kill landed
    resumed = n0["train"]["figures"]["resumed_from_epoch"]
    assert resumed in (0, 1)
    assert f"resuming from node 0's epoch {resumed}: received" in (node1 / "logs" / "train.log").read_text()
    assert n1["train"]["figures"]["node_rank"] == 1 and (node1 / "train-node.json").is_file()
    assert not (node1 / "checkpoints" / "2").exists()  # node 0 keeps the job's checkpoints
    assert "evaluate-offline" in n0 and "evaluate-offline" not in n1  # the head is node 0's
    assert n0["train"]["figures"]["generated_tokens"] > 0 and n1["train"]["figures"]["generated_tokens"] > 0
    # the one-node run with the same world size (one node, two processes, states extracted offline)
    one = tmp_path / "one-node"
    proc = cli("run", TINY, "--no-tui", "--run-dir", one, "--until", "train", "--set", f'run.cache_dir="{cache_dir}"',
               "--set", "train.nproc_per_node=2", "--set", "train.epochs=3", "--set", f"server.port={free_port()}",
               timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    single = RunDir.open(one).read_state()["stages"]["train"]["figures"]["train_loss"]
    assert n0["train"]["figures"]["train_loss"] == pytest.approx(single, abs=TOLERANCE)


def test_the_lost_node_wordings_torch_prints():
    """gloo's two lines for the same kill, as torchrun's workers print them (rank prefix, rich's wrapping;
    torch 2.13.0 CPU, 2026-12-02), NCCL's, and a rendezvous that never formed."""
    from pipeline.compat.torch_distributed_errors import node_lost

    closed = ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by \n"
              "[rank0]: peer [127.0.0.1]:27290. This is typically caused by a remote worker crashing.")
    reset = ("[rank0]: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read \n"
             "[rank0]: error [127.0.0.1]:48528: Connection reset by peer. This is typically caused by a")
    assert node_lost(closed) == "gloo: connection closed by peer 127.0.0.1:27290 (a remote worker stopped)"
    assert node_lost(reset) == "gloo: connection reset by peer 127.0.0.1:48528 (a remote worker stopped)"
    assert "NCCL" in node_lost("NCCL error: remote process exited or there was a network error, NCCL version")
    assert "rendezvous" in node_lost("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError")
    assert node_lost("RuntimeError: CUDA out of memory") is None


def test_a_node_that_does_not_answer_is_a_line_not_a_failure(tmp_path):
    from pipeline.profile import ProfileError, load_profile
    from pipeline.run import peers

    dead = f"http://127.0.0.1:{free_port()}/metrics"
    (peer,) = peers.read(dead)
    assert peer.line().startswith(f"node {dead}: unreachable (") and peer.stage is None
    run = RunDir.create(load_profile(TINY, {"train.node_exporters": [dead]}), tmp_path / "run")
    proc = cli("status", run.root)
    assert proc.returncode == 0 and f"node {dead}: unreachable" in proc.stdout
    assert json.loads(cli("status", run.root, "--json").stdout)["peers"][0]["error"].startswith("unreachable")
    with pytest.raises(ProfileError, match="train.node_exporters"):
        load_profile(TINY, {"train.node_exporters": ["host-b:9401"]})


@pytest.mark.integration
def test_nodes_with_different_rows_stop_in_one_line(tmp_path, cache_dir):
    """Offline on both (each node extracts all its own rows), but node 1 prepared other rows: speculators'
    sampler would pack different batches on each; the job stops before its first step, saying so."""
    rdzv = free_port()

    def node(rank, *extra):
        sets = [f'run.cache_dir="{cache_dir}"', "train.nnodes=2", f"train.node_rank={rank}", "train.epochs=1",
                f'train.rdzv_endpoint="127.0.0.1:{rdzv}"', f"server.port={free_port()}", *extra]
        return popen("run", TINY, "--no-tui", "--run-dir", tmp_path / f"node{rank}",
                     *(a for kv in sets for a in ("--set", kv)))
    procs = [node(0), node(1, "data.num_conversations=30")]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 1 and "Traceback" not in err
        line = next(x for x in err.splitlines() if x.startswith("eagle3-console: error:"))
        assert "their prepared rows differ (node 0: " in line and ", node 1: " in line, line
        assert "every node must prepare the same rows" in line
