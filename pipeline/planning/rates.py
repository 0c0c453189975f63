"""A stage's rate and where it comes from: what an earlier run of the profile measured, else what a slice's
calibration carries to the box (hardware.calibration), else the profile's per-GPU estimate; extraction no
faster than its clients ask; one start of the target's server."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.compat.offline_clients import CLIENT_ROWS_PER_S, extraction_clients
from pipeline.data.targetinfo import target_info
from pipeline.planning import calibration, history
from pipeline.profile import Profile


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float | None
    source: str  # where it comes from, for people: "measured: RUN", "calibrated (extrapolated): …", …
    kind: Literal["measured", "calibrated", "client-bound", "estimate", "unknown", ""] = ""
    how: str = ""  # calibrated: "measured" (the slice's own box and depth) or "extrapolated"


@dataclass(frozen=True)
class TrainerOverhead:
    """What the trainer spends beside its steps: its start-up (to the first logged step: imports, the draft's
    build, the first batch) and each epoch's validation and checkpoint save."""
    startup_s: float
    epoch_s: float
    source: str

    def seconds(self, epochs: int) -> float:
        return self.startup_s + epochs * self.epoch_s


@dataclass(frozen=True)
class ServerStart:
    """One start of the target's vLLM server: how long it takes and where that comes from."""
    seconds: float | None
    source: str
    kind: Literal["measured", "estimate", "unknown"]


def calibrated_box(profile: Profile, tp: int) -> tuple[calibration.Calibration, calibration.Box] | None:
    """hardware.calibration and the server it is carried to: the target's depth on `tp` GPUs of the box."""
    hw = profile.hardware
    if not hw.calibration:
        return None
    info = target_info(profile)
    return calibration.load(Path(hw.calibration)), calibration.Box(
        gpu_name=hw.gpu_name, layers=info.layers, tp=tp, bf16_tflops=hw.gpu_bf16_tflops,
        memory_tb_s=hw.gpu_memory_tb_s, interconnect_gb_s=hw.interconnect_gb_s, allreduce_us=hw.allreduce_us)


def calibrated_rate(profile: Profile, tp: int, figure_of) -> Rate | None:
    if (cb := calibrated_box(profile, tp)) is None:
        return None
    fig = figure_of(*cb)
    return Rate(round(fig.value, 1), f"calibrated ({fig.how}): {Path(profile.hardware.calibration).name}, {fig.why}",
                "calibrated", fig.how)


def _rate(profile: Profile, stage: str, rate_of, hardware_key: str, gpus: int, calibrated=None, done=True) -> Rate:
    """What an earlier run of this profile measured for `stage` (`done`: a finished one), else the calibration's
    figure (`calibrated`: a function of the calibration and the box), else the profile's per-GPU estimate."""
    if (m := history.measured(profile, (stage,), rate_of, done)):
        return Rate(round(m[0], 1), f"measured: {m[1]}", "measured")
    if calibrated is not None and (c := calibrated_rate(profile, gpus, calibrated)):
        return c
    return estimate(profile, hardware_key, gpus)


def estimate(profile: Profile, hardware_key: str, gpus: int) -> Rate:
    per_gpu = getattr(profile.hardware, hardware_key)
    if per_gpu:
        return Rate(per_gpu * gpus, f"estimate: hardware.{hardware_key} {per_gpu:g} × {gpus} GPU(s)", "estimate")
    return Rate(None, f"unknown: no earlier run, no hardware.{hardware_key}", "unknown")


def _extracted(figures: dict) -> float | None:
    if figures.get("tokens_per_s"):
        return float(figures["tokens_per_s"])
    if figures.get("tokens") and figures.get("seconds"):
        return figures["tokens"] / figures["seconds"]
    return None


def extraction_rate(profile: Profile, gpus: int) -> Rate:
    """Prefill tokens/s of the extraction server on `gpus` GPUs (before its clients' ceiling: client_bound)."""
    return _rate(profile, "extract", _extracted, "extract_tokens_per_s", gpus, calibration.extract_rate)


def training_rate(profile: Profile, gpus: int) -> Rate:
    return _rate(profile, "train", lambda f: f.get("tokens_per_s"), "train_tokens_per_s", gpus)


def trainer_overhead(profile: Profile) -> TrainerOverhead | None:
    """The trainer's start-up and per-epoch overhead as an earlier run of this profile measured them; None
    where none did. The steady rate leaves both out: on the H100 flow of 2026-12-07 training took 177 s where
    its 642 k tokens at the measured 159,500 tok/s are 4 s (NOTES "The plan for that flow")."""
    def both(figures: dict) -> tuple[float, float] | None:
        start, epoch = figures.get("startup_s"), figures.get("epoch_overhead_s")
        return (float(start), float(epoch)) if isinstance(start, (int, float)) and isinstance(epoch, (int, float)) \
            else None

    if (m := history.measured(profile, ("train",), both, done=True)) is None:
        return None
    (startup, epoch), run = m
    return TrainerOverhead(startup, epoch, f"measured: {run} (start-up {startup:.0f} s, {epoch:.0f} s an epoch)")


def client_bound(profile: Profile, rate: Rate, mean_tokens: float) -> Rate:
    """A vLLM extraction rate no faster than its clients ask (pipeline/compat/offline_clients.py). A rate
    measured by an earlier run already carries its clients' limit."""
    if (profile.extract.backend != "vllm" or rate.tokens_per_s is None or mean_tokens <= 0
            or rate.kind == "measured"):
        return rate
    clients = extraction_clients(profile)
    ceiling = clients * CLIENT_ROWS_PER_S * mean_tokens
    if ceiling >= rate.tokens_per_s:
        return rate
    return Rate(round(ceiling, 1), f"client-bound: extract.clients {clients} × {CLIENT_ROWS_PER_S:g} rows/s × "
                                   f"{mean_tokens:.0f} tokens a row (the server: {rate.tokens_per_s:,.0f}, "
                                   f"{rate.source})", "client-bound")


def decode_rate(profile: Profile, gpus: int) -> Rate:
    """Batched decode tokens/s of the served target at data.regenerate_concurrency (an earlier regeneration
    through vLLM; the transformers backend's rate says nothing about a server), else the calibration's,
    else the profile's estimate."""
    concurrency = profile.data.regenerate_concurrency
    return _rate(profile, "regenerate", lambda f: f.get("backend") == "vllm" and float(f.get("generated_tok_s") or 0),
                 "decode_tokens_per_s", gpus, lambda cal, box: calibration.decode_rate(cal, box, concurrency), False)


def matrix_rates(profile: Profile) -> tuple[dict[int, float], str] | None:
    """The target alone's tok/s at each concurrency as an earlier run of this profile served it (its matrix's
    baseline: deploy-measure, measure-existing), and where; None where none was measured."""
    def levels(figures: dict) -> dict[int, float] | None:
        got = figures.get("baseline_levels_tok_s") or {}
        return {int(c): float(v) for c, v in got.items() if isinstance(v, (int, float)) and v > 0} or None

    m = history.measured(profile, ("deploy-measure", "measure-existing"), levels)
    return (m[0], f"measured: {m[1]}") if m else None


def server_start_estimate(profile: Profile) -> ServerStart:
    """Seconds of one start of the target's vLLM server: an earlier run's (a real start, not a reuse),
    else hardware.server_start_s, else the checkpoint read at 1 GiB/s plus a minute."""
    def real_start(figures: dict) -> float | None:
        value = figures.get("server_start_s")
        return float(value) if isinstance(value, (int, float)) and value > 5 else None

    if (m := history.measured(profile, ("regenerate", "extract"), real_start)):
        return ServerStart(round(m[0], 1), f"measured: {m[1]}", "measured")
    if profile.hardware.server_start_s:
        return ServerStart(profile.hardware.server_start_s, "estimate: hardware.server_start_s", "estimate")
    if profile.target.weights_gib:
        return ServerStart(profile.target.weights_gib + 60, "estimate: target.weights_gib at 1 GiB/s + 60 s",
                           "estimate")
    return ServerStart(None, "unknown: no earlier run, no hardware.server_start_s or target.weights_gib", "unknown")
