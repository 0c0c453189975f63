"""Online training (extract.mode = "online"): the planner's offline/online comparison, the cache slice, the
states watcher, the GPU roles, the multi-node argv. The online run itself, killed in training and resumed,
is tests/test_resume.py::test_sigkill_during_online_training_then_resume."""
import json
import subprocess
import sys

import pytest

from pipeline.layout.rundir import RunDir
from pipeline.planning.plan import disk_verdict, make_plan
from pipeline.profile import ProfileError, load_profile
from pipeline.serving import online_training, vllm_modes
from pipeline.stages.extract import shard
from pipeline.units import GIB
from tests.conftest import TINY, cli

ONLINE = ('extract.backend="vllm"', 'extract.mode="online"', "server.enforce_eager=true",
          "server.max_model_len=1024", 'server.dtype="float32"')


def test_online_needs_the_vllm_backend_and_mooncake_needs_online(tmp_path):
    auto = load_profile(TINY, {"extract.mode": "auto", "extract.backend": "transformers"})
    assert make_plan(auto, free=0).mode == "offline"  # auto cannot go online without a vLLM extraction server
    for sets, says in (({"extract.mode": "online", "extract.backend": "transformers"}, "extract.mode"),
                       ({"extract.transfer": "mooncake"}, "extract.transfer"),
                       ({"extract.backend": "vllm", "extract.mode": "online", "extract.transfer": "mooncake",
                         "extract.cache_gib": 0.5}, "extract.cache_gib"),
                       ({"train.cuda_visible_devices": "0;1"}, "train.cuda_visible_devices")):
        with pytest.raises(ProfileError, match=says):
            load_profile(TINY, sets)


def test_multi_node_argv_uses_hs_connectors_mooncake(tmp_path):
    p = load_profile(TINY, {"extract.backend": "vllm", "extract.mode": "online", "extract.transfer": "mooncake",
                            "extract.mooncake_master": "10.0.0.1:50051", "extract.mooncake_protocol": "rdma",
                            "extract.mooncake_device": "mlx5_0,mlx5_1", "server.cuda_visible_devices": "0,1,2,3"})
    flags = online_training.trainer_flags(p, "http://127.0.0.1:8000/v1", tmp_path)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--on-missing"] == "generate" and pairs["--hidden-states-backend"] == "mooncake"
    assert pairs["--mooncake-master"] == "10.0.0.1:50051" and pairs["--mooncake-protocol"] == "rdma"
    assert pairs["--mooncake-device"] == "mlx5_0,mlx5_1" and "--hidden-states-path" not in pairs
    argv = vllm_modes.server_argv(p, "extraction", tmp_path, layer_ids=[1, 2], storage=tmp_path)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    # hs_connectors' own connector on a GPU, its CPU adaptation without one (compat/vllm_cpu_mooncake_connector)
    gpu = vllm_modes.accelerator_available()
    assert kv["kv_connector"] == ("MooncakeHiddenStatesConnector" if gpu else "CpuMooncakeHiddenStatesConnector")
    assert kv["kv_connector_extra_config"]["mooncake"]["master_server_address"] == "10.0.0.1:50051"
    assert vllm_modes.server_env(p)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # speculators' online dataset checks the served model id against --verifier-name-or-path
    assert argv[argv.index("--served-model-name") + 1] == str(tmp_path)


@pytest.mark.parametrize("total,rows", [(10, 4), (9, 4), (8, 3), (47, 12), (5, 5), (5, 9), (100, 1)])
def test_the_cache_is_a_leading_slice_speculators_can_extract(total, rows):
    world, rank = online_training.leading_slice(total, rows)
    got = shard(total, world, rank)
    assert got.start == 0 and 0 < len(got) <= min(rows, total)


def test_cached_prefix_fits_the_budget():
    lengths = [100, 50, 200, 10]
    assert online_training.cached_prefix(lengths, 8, 0) == 0
    assert online_training.cached_prefix(lengths, 8, 8 * 150) == 2
    assert online_training.cached_prefix(lengths, 8, 8 * 1000) == 4


def test_kimi_full_fits_a_30_tb_node_online_and_the_planner_names_the_split():
    # the profile's per-GPU estimates (the committed calibration carries its own rates per server size:
    # tests/test_calibration.py)
    full = load_profile("kimi-k2.5-b300x8-full", {"hardware.calibration": ""}, check_inputs=False)
    node = int(full.hardware.disk_gib * GIB)
    plan = make_plan(full, free=node)
    assert plan.mode == "online" and "offline does not fit" in plan.mode_why
    assert disk_verdict(plan, full, free=node)[0] and not disk_verdict(plan, full, free=node, mode="offline")[0]
    assert plan.disk_for("offline") > 100e12 > 30e12 > plan.disk_for("online")
    o = plan.online
    assert o.disk_cache == int(full.extract.cache_gib * GIB) and 0 < o.cached_rows < plan.samples
    assert o.generate_tokens == (plan.tokens - int(o.disk_cache / (plan.disk_hidden_states / plan.tokens))) \
        * full.train.epochs
    fitting = [s for s in o.splits if s.fits]
    assert fitting and o.wall_s is not None and o.gpu_hours is not None
    best = min(fitting, key=lambda s: s.wall_s)
    assert (f"{best.serve} GPUs" in o.recommended) if not best.train else (f"serve on {best.serve}" in o.recommended)
    by_serve = {s.serve: s for s in o.splits}
    assert by_serve[4].generate_tok_s == 2 * by_serve[2].generate_tok_s  # estimates scale with the GPUs given
    assert not by_serve[2].fits and "555 GiB" in by_serve[2].why  # 2 × 288 GB cannot hold the INT4 weights


def test_states_in_flight_are_the_requests_open_and_at_most_a_batch_a_worker():
    def in_flight(**sets):
        p = load_profile("kimi-k2.5-b300x8-full", {"hardware.calibration": "", **sets}, check_inputs=False)
        plan = make_plan(p)
        per_token = plan.disk_hidden_states / plan.tokens
        t = p.train
        return plan.online.disk_in_flight / (t.nproc_per_node * t.nnodes * max(1, t.num_workers) * per_token)

    seq = 8192
    assert in_flight(**{"train.requests_per_worker": 1}) == pytest.approx(seq, rel=1e-3)  # one row a worker
    assert in_flight(**{"train.requests_per_worker": 8}) == pytest.approx(seq, rel=1e-3)  # a batch's rows at most
    assert in_flight(**{"train.requests_per_worker": 2, "train.total_seq_len": 4 * seq}) == pytest.approx(2 * seq,
                                                                                                        rel=1e-3)


def test_the_rtx_box_cannot_serve_and_train_at_once():
    low = make_plan(load_profile("kimi-k2.5-rtx6000x8-lowered", check_inputs=False))
    assert low.online.splits and not any(s.fits for s in low.online.splits)
    assert low.online.recommended.startswith("no split fits this box")


def test_plan_cli_shows_offline_and_online_side_by_side():
    out = cli("plan", "kimi-k2.5-rtx6000x8-lowered", "kimi-k2.5-b300x8-full")
    assert out.returncode == 0, out.stderr
    for row in ("disk: total", "online: disk total", "online: wall time", "online: split", "mode"):
        assert row in out.stdout
    assert "serve 4 / train 4" in out.stdout and "serve+train on 8 (shared)" in out.stdout
    data = json.loads(cli("plan", "kimi-k2.5-b300x8-full", "--json").stdout)[0]
    assert data["mode"] == "online" and data["disk_total"] == data["disk_online"] < data["disk_offline"]


def test_states_watch_measures_the_peak_of_files_in_flight(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    watch = online_training.StatesWatch(raw, "http://127.0.0.1:9", lambda **f: None)
    (raw / "a.safetensors").write_bytes(b"x" * 1000)
    (raw / "a.safetensors.lock").write_bytes(b"")
    watch._sample_disk()
    (raw / "a.safetensors").unlink()
    (raw / "b.safetensors").write_bytes(b"x" * 10)
    watch._sample_disk()
    assert watch.peak_bytes == 1000 and watch.peak_files == 2
    with watch:  # no server answers: the rate stays unknown, the disk is still watched
        (raw / "c.safetensors").write_bytes(b"x" * 5000)
    assert watch.peak_bytes == 5010 and watch.generated_tokens == 0


def test_the_gpu_view_knows_which_processes_serve_and_which_train(tmp_path):
    from pipeline.run import jobs
    run = RunDir.create(load_profile(TINY), tmp_path / "run")
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        run.update_stage("train", status="running", child_pgid=trainer.pid)
        roles = jobs.process_roles(run, {"state": "running", "mode": "extraction", "pids": [11, 12]})
        assert roles == {11: "serve (extraction)", 12: "serve (extraction)", trainer.pid: "train"}
        run.update_stage("train", status="done")
        assert trainer.pid not in jobs.process_roles(run, {"state": "none"})
    finally:
        trainer.kill()
        trainer.wait()
