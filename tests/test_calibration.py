"""A slice's measured rates carried to the whole target on a box (pipeline/planning/calibration.py) and the plans that
use them: measured where the box is what measured, extrapolated (and said so) elsewhere, the profile's guess
beside, an earlier run's measurement still first, one line for every bad file or missing box figure."""
from pathlib import Path

import pytest
import tomli_w

from pipeline.planning import calibration, history, plan, rates
from pipeline.profile import ProfileError, load_profile
from tests.conftest import cli

# A slice whose times follow fixed + per_layer × layers exactly, so the extrapolation can be checked by hand:
# prefill 20 µs + 50 µs a layer a token, extraction 40 + 50, decode steps 3 ms + 1 ms a layer at c = 1 and
# 5 + 2.5 at c = 64, with the head 4.2 + 1.1.
PREFILL, EXTRACT = (20e-6, 50e-6), (40e-6, 50e-6)
STEP = {1: (3e-3, 1e-3), 64: (5e-3, 2.5e-3)}
HEAD = (4.2e-3, 1.1e-3)


def depth(layers: int) -> dict:
    return {"layers": layers,
            "prefill_tokens_per_s": 1 / (PREFILL[0] + PREFILL[1] * layers),
            "extract_tokens_per_s": 1 / (EXTRACT[0] + EXTRACT[1] * layers),
            "decode_tokens_per_s": {str(c): c / (a + b * layers) for c, (a, b) in STEP.items()},
            "step_ms": 1e3 * (STEP[1][0] + STEP[1][1] * layers),
            "step_ms_with_head": 1e3 * (HEAD[0] + HEAD[1] * layers)}


def calibration_file(tmp_path, **changes):
    data = {"target": "kimi-k2.5", "gpu_name": "H200", "gpu_bf16_tflops": 989.0, "gpu_memory_tb_s": 4.8,
            "vllm": "0.26.0", "date": "2026-12-02", "command": "bash bench/gpu/kimi_slice_on_h200.sh",
            "row_tokens": 2048, "k": 3, "hidden": 7168, "depths": [depth(4), depth(8)], **changes}
    path = tmp_path / "slice.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def box(**changes):
    fields = {"gpu_name": "RTX PRO 6000", "layers": 61, "tp": 8, "bf16_tflops": 500.0, "memory_tb_s": 1.792,
              "interconnect_gb_s": 50.0, "allreduce_us": 40.0, **changes}
    return calibration.Box(**fields)


def test_fit_separates_the_fixed_part_from_the_per_layer_part():
    assert calibration.fit([(4, 0.7), (8, 1.1)]) == pytest.approx((0.3, 0.1))
    assert calibration.fit([(4, 0.2), (8, 1.0)]) == pytest.approx((0.0, 1.2 / 12))  # fixed < 0: all per layer
    assert calibration.fit([(4, 1.0), (8, 0.9)]) == pytest.approx((0.95, 0.0))  # per layer < 0: all fixed


def test_the_measuring_gpu_at_a_measured_depth_is_measured(tmp_path):
    cal = calibration.load(calibration_file(tmp_path))
    here = box(gpu_name="H200", layers=8, tp=1, bf16_tflops=989.0, memory_tb_s=4.8)
    fig = calibration.extract_rate(cal, here)
    assert fig.how == "measured" and fig.value == pytest.approx(depth(8)["extract_tokens_per_s"])
    assert calibration.decode_rate(cal, here, 64).value == pytest.approx(depth(8)["decode_tokens_per_s"]["64"])
    tau = depth(8)["step_ms_with_head"] / depth(8)["step_ms"]
    assert calibration.break_even_tau(cal, here).value == pytest.approx(tau)


def test_the_whole_target_on_a_box_is_carried_by_the_stated_ratios(tmp_path):
    cal = calibration.load(calibration_file(tmp_path))
    b = box()
    comm = 61 * 2 * 7168 * 2 * 2 * 7 / 8 / 50e9  # ring all-reduces of one token over PCIe
    t = EXTRACT[0] + EXTRACT[1] * 61 * (989 / 500) / 8 + comm
    fig = calibration.extract_rate(cal, b)
    assert fig.how == "extrapolated" and fig.value == pytest.approx(1 / t)
    assert "61 layers, TP 8 on RTX PRO 6000" in fig.why and "compute × 1.98" in fig.why
    step = STEP[64][0] + STEP[64][1] * 61 * (4.8 / 1.792) / 8 + 61 * 2 * 40e-6
    assert calibration.decode_rate(cal, b, 64).value == pytest.approx(64 / step)
    plain = STEP[1][0] + STEP[1][1] * 61 * (4.8 / 1.792) / 8 + 61 * 2 * 40e-6
    with_head = HEAD[0] + HEAD[1] * 61 * (4.8 / 1.792) / 8 + 61 * 2 * 40e-6
    assert calibration.break_even_tau(cal, b).value == pytest.approx(with_head / plain)
    # a faster interconnect is a faster prefill; one GPU has no all-reduce at all
    assert calibration.extract_rate(cal, box(interconnect_gb_s=900.0)).value > fig.value
    assert calibration.extract_rate(cal, box(tp=1)).value == pytest.approx(
        1 / (EXTRACT[0] + EXTRACT[1] * 61 * 989 / 500))


def test_decode_is_not_carried_above_the_concurrencies_measured(tmp_path):
    cal = calibration.load(calibration_file(tmp_path))
    at_256 = calibration.decode_rate(cal, box(), 256)
    assert at_256.value == pytest.approx(calibration.decode_rate(cal, box(), 64).value)
    assert "concurrency 64 measured, 256 asked" in at_256.why
    assert calibration.decode_rate(cal, box(), 8).value == pytest.approx(calibration.decode_rate(cal, box(), 1).value)


@pytest.mark.parametrize("changes, says", [
    ({"depths": [depth(4)]}, "key 'depths': needs two depths or more (layers) to separate the per-layer cost, "
                             "got [4]"),
    ({"depths": [depth(4), {**depth(8), "decode_tokens_per_s": {"many": 1.0}}]},
     "key 'depths.1.decode_tokens_per_s': keys must be concurrencies"),
    ({"depths": [depth(4), {**depth(8), "decode_tokens_per_s": {"1": 10.0}}]}, "the same concurrencies"),
    ({"gpu_bf16_tflops": 0.0}, "key 'gpu_bf16_tflops'"),
    ({"depths": [depth(4), {**depth(8), "step_ms": -1.0}]}, "key 'depths.1.step_ms'"),
])
def test_a_bad_calibration_is_one_line_naming_file_and_key(tmp_path, changes, says):
    path = calibration_file(tmp_path, **changes)
    with pytest.raises(calibration.CalibrationError) as err:
        calibration.load(path)
    assert str(path) in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
    path.write_text("depths = [")
    with pytest.raises(calibration.CalibrationError, match="not valid TOML"):
        calibration.load(path)


def test_a_calibrated_profile_needs_the_box_figures_and_the_file(tmp_path):
    path = calibration_file(tmp_path)
    p = load_profile("kimi-k2.5-rtx6000x8-lowered", {"hardware.calibration": str(path)}, check_inputs=False)
    assert p.hardware.calibration == str(path)
    with pytest.raises(ProfileError, match=r"hardware.allreduce_us.*must be > 0 with hardware.calibration"):
        load_profile("kimi-k2.5-rtx6000x8-lowered", {"hardware.calibration": str(path), "hardware.allreduce_us": 0.0},
                     check_inputs=False)
    with pytest.raises(ProfileError, match=r"key 'hardware.calibration': file not found"):
        load_profile("kimi-k2.5-rtx6000x8-lowered", {"hardware.calibration": str(tmp_path / "none.toml")},
                     check_inputs=False)


def test_kimi_plans_carry_the_calibration_and_show_the_guess_beside(tmp_path):
    path = calibration_file(tmp_path)
    names = ("kimi-k2.5-rtx6000x8-lowered", "kimi-k2.5-b300x8-full")
    guessed = [plan.make_plan(load_profile(n, {"hardware.calibration": ""}, check_inputs=False)) for n in names]
    calibrated = [plan.make_plan(load_profile(n, {"hardware.calibration": str(path)}, check_inputs=False))
                  for n in names]
    for before, after in zip(guessed, calibrated, strict=True):
        assert before.extract.source.startswith("estimate") and before.break_even_tau is None
        assert after.extract.source.startswith("calibrated (extrapolated): slice.toml, extraction:")
        assert after.regenerate.rate.source.startswith("calibrated (extrapolated)")
        assert after.guesses["extraction"] == before.extract and after.guesses["regeneration"] == before.regenerate.rate
        assert after.extract_s == pytest.approx(after.tokens / after.extract.tokens_per_s)
        assert after.break_even_tau.how == "extrapolated" and after.break_even_tau.value > 1
    low, full = calibrated
    assert full.extract.tokens_per_s > low.extract.tokens_per_s  # NVLink and 4.5× the compute
    # the online splits generate at the calibration carried to each server size, not per GPU × count
    serve4 = next(s for s in full.online.splits if s.serve == 4)
    serve8 = next(s for s in full.online.splits if s.serve == 8)
    assert serve8.generate_tok_s == pytest.approx(full.extract.tokens_per_s)
    assert serve4.generate_tok_s != pytest.approx(serve8.generate_tok_s / 2)
    text = plan.table(calibrated)
    assert "(extrapolated; guess 3,200)" in text and "break-even τ" in text


def test_the_kimi_profiles_plan_from_the_committed_slice_calibration():
    """profiles/calibration/kimi-k2.5-h200.toml (bench/gpu/kimi_slice_on_h200.sh on one H200) is what both Kimi
    boxes plan from; the extraction figure says how much of a token's time is the stage's own fixed cost."""
    committed = Path(__file__).resolve().parents[1] / "profiles" / "calibration" / "kimi-k2.5-h200.toml"
    cal = calibration.load(committed)
    assert cal.gpu_name == "H200" and sorted(d.layers for d in cal.depths) == [6, 12]
    for name in ("kimi-k2.5-rtx6000x8-lowered", "kimi-k2.5-b300x8-full"):
        p = load_profile(name, check_inputs=False)
        assert Path(p.hardware.calibration) == committed
        made = plan.make_plan(p)
        assert made.extract.source.startswith("calibrated (extrapolated): kimi-k2.5-h200.toml, extraction:")
        assert "µs fixed (as measured)" in made.extract.source and made.break_even_tau.how == "extrapolated"


def test_an_earlier_runs_measurement_still_comes_first(tmp_path, monkeypatch):
    path = calibration_file(tmp_path)
    p = load_profile("kimi-k2.5-rtx6000x8-lowered", {"hardware.calibration": str(path)}, check_inputs=False)
    monkeypatch.setattr(history, "measured", lambda profile, stages, value_of, done=False:
                        (v, tmp_path / "run") if done and (v := value_of({"tokens_per_s": 1234.0})) else None)
    assert plan.make_plan(p).extract == rates.Rate(1234.0, f"measured: {tmp_path / 'run'}", "measured")


def test_plan_cli_with_a_calibration(tmp_path):
    path = calibration_file(tmp_path)
    proc = cli("plan", "kimi-k2.5-b300x8-full", "--set", f'hardware.calibration="{path}"')
    assert proc.returncode == 0, proc.stderr
    assert "extrapolated; guess 20,000" in proc.stdout
    bad = cli("plan", "kimi-k2.5-b300x8-full", "--set", f'hardware.calibration="{tmp_path}/no.toml"')
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "hardware.calibration" in bad.stderr


def test_the_kimi_slice_is_kimis_width_with_fewer_layers_and_calibrate_writes_what_the_planner_reads(tmp_path):
    """bench/gpu/kimi_slice.py without a server: the slice's config and the calibration file from two depths."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.data import targetinfo

    bench = Path(__file__).resolve().parent.parent / "bench" / "gpu"
    sys.path[:0] = [str(bench)]
    try:
        import kimi_slice
    finally:
        del sys.path[0]
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2}))
    text = kimi_slice.write_slice(tmp_path / "slice", 6, tok, small=False)
    p = load_profile("kimi-k2.5-rtx6000x8-lowered", {"target.config": str(tmp_path / "slice" / "config.json")},
                     check_inputs=False)
    info = targetinfo.target_info(p)
    assert (info.hidden, info.layers, info.vocab, info.attention, info.experts) == (7168, 6, 163840, "MLA", 384)
    assert info.int4_group_size == 32 and text["architectures"] == ["DeepseekV3ForCausalLM"]
    results = []
    for layers in (6, 11):
        r = {"layers": layers, "gpu": True, "row_tokens": 2048, "prefill_tokens_per_s": 1e5 / layers,
             "decode_tokens_per_s": {"1": 100.0 / layers, "64": 3000.0 / layers}, "step_ms": 1.0 + layers,
             "step_ms_with_head": 2.0 + layers}
        results.append(tmp_path / f"depth-{layers}.json")
        results[-1].write_text(json.dumps(r))
    out = tmp_path / "kimi.toml"
    script = [sys.executable, str(bench / "kimi_slice.py"), "calibrate", *map(str, results), "-o", str(out)]
    missing = subprocess.run([*script, "--extract", "6=9000"], capture_output=True, text=True)
    assert missing.returncode != 0 and "layers 11: no --extract 11=TOK_S" in missing.stderr and not out.exists()
    done = subprocess.run([*script, "--extract", "6=9000", "11=5000"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cal = calibration.load(out)
    assert [d.layers for d in cal.depths] == [6, 11] and cal.depths[1].extract_tokens_per_s == 5000.0
    assert cal.hidden == 7168 and cal.gpu_name == "H200"


@pytest.mark.integration  # preflight asks vLLM (a probe process: a vLLM import, ~10 s on 2 cores)
def test_a_bad_calibration_file_is_one_line_in_plan_and_a_block_in_preflight(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("depths = [")
    proc = cli("plan", "kimi-k2.5-b300x8-full", "--set", f'hardware.calibration="{bad}"')
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and f"{bad}: not valid TOML" in proc.stderr
    assert "Traceback" not in proc.stderr
    pre = cli("preflight", "kimi-k2.5-b300x8-full", "--set", f'hardware.calibration="{bad}"')
    assert pre.returncode != 0 and "Traceback" not in pre.stderr
    assert f"BLOCK calibration hardware.calibration: {bad}: not valid TOML" in pre.stdout


def test_the_calibration_is_read_again_once_it_changes(tmp_path):
    path = calibration_file(tmp_path)
    assert calibration.load(path).row_tokens == 2048
    path.write_text(path.read_text().replace("row_tokens = 2048", "row_tokens = 1024"))
    import os
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert calibration.load(path).row_tokens == 1024
