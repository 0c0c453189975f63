"""Rates measured on a slice of the target and carried to the whole target on the box a profile plans for.

A calibration file (`hardware.calibration`, e.g. profiles/calibration/kimi-k2.5-h200.toml, written by
bench/gpu/kimi_slice_on_h200.sh) holds what one GPU measured on the target's real width with fewer layers,
at two depths or more: prefill and extraction tokens/s, decode tokens/s at a few concurrencies, and a
decode step with and without an EAGLE-3 head. Per token (prefill, extraction) and per step (decode) the
time is fitted as `fixed + per_layer × layers` across the depths, then carried to the box by stated ratios:

- compute-bound (prefill, extraction): the per-layer part × the target's layers × (the calibration GPU's
  bf16 TFLOPS / the box GPU's) / TP, plus the all-reduces a token costs over the box's interconnect
  (2 per layer of hidden × 2 bytes, ring: × 2 (TP − 1) / TP);
- memory-bound (decode): the per-layer part × layers × (memory bandwidth ratio) / TP, plus 2 all-reduce
  latencies per layer (hardware.allreduce_us);
- the fixed part (embeddings, lm_head, the server's own per-token or per-step work) is kept as measured.

Every figure says whether it was measured or extrapolated and from what; the planner shows it beside the
profile's guess. What the ratios leave out (TP's other losses, kernels that differ between GPU
generations, overlap of communication with compute) is why an extrapolated figure is not a measurement.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, model_validator

from pipeline.profile import Positive, ProfileError, Section, rule

PositiveFloat = Annotated[float, Field(gt=0)]


class CalibrationError(ProfileError):
    """A calibration file that cannot be used (a profile's input, hardware.calibration): the message is one line
    naming the file and key, reported wherever a bad profile is."""


class Depth(Section):
    """One slice, measured."""
    layers: Positive
    prefill_tokens_per_s: PositiveFloat
    """A bare prefill (one output token) of rows of `row_tokens` through vLLM."""
    extract_tokens_per_s: PositiveFloat
    """The extract stage on the same rows: hidden states to files through speculators' client."""
    decode_tokens_per_s: dict[str, PositiveFloat]
    """Concurrency (as a TOML key) → generated tokens/s, greedy, fixed-length answers."""
    step_ms: PositiveFloat
    """A decode step at concurrency 1 without a draft."""
    step_ms_with_head: PositiveFloat
    """A decode step at concurrency 1 with an EAGLE-3 head proposing k tokens (its acceptance synthetic)."""

    @model_validator(mode="after")
    def _concurrencies(self) -> Depth:
        if not self.decode_tokens_per_s or not all(k.isdigit() and int(k) >= 1 for k in self.decode_tokens_per_s):
            raise rule("decode_tokens_per_s", list(self.decode_tokens_per_s), "keys must be concurrencies >= 1")
        return self


class Calibration(Section):
    target: str
    """The geometry measured (profiles/targets/NAME.config.json with fewer layers)."""
    gpu_name: str
    gpu_bf16_tflops: PositiveFloat
    """The measuring GPU's dense bf16 peak (its datasheet): the compute ratio's denominator."""
    gpu_memory_tb_s: PositiveFloat
    vllm: str
    date: str
    command: str
    row_tokens: Positive
    k: Positive = 3
    hidden: Positive
    """The target's hidden size: what an all-reduce carries per token and layer."""
    depths: list[Depth]

    @model_validator(mode="after")
    def _two_depths(self) -> Calibration:
        if len({d.layers for d in self.depths}) < 2:
            raise rule("depths", [d.layers for d in self.depths],
                       "needs two depths or more (layers) to separate the per-layer cost")
        concurrencies = [set(d.decode_tokens_per_s) for d in self.depths]
        if any(c != concurrencies[0] for c in concurrencies):
            raise rule("depths", [sorted(c) for c in concurrencies], "every depth must measure the same concurrencies")
        return self


def load(path: Path) -> Calibration:
    """The file as the planner reads it; read once while it is unchanged (a plan asks for it per rate)."""
    try:
        return _load(path, path.stat().st_mtime_ns)
    except OSError as exc:
        raise CalibrationError(f"{path}: {exc.strerror or exc}") from None


@lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> Calibration:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))  # an OSError is load's
    except tomllib.TOMLDecodeError as exc:
        raise CalibrationError(f"{path}: not valid TOML: {exc}") from None
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = [str(p) for p in err["loc"]]
        ctx = err.get("ctx") or {}
        if "key" in ctx:  # a rule between fields: its own key, under the model that declared it
            where.append(ctx["key"])
            raise CalibrationError(f"{path}: key '{'.'.join(where)}': {ctx['why']}, got {ctx['value']!r}") from None
        raise CalibrationError(f"{path}: key '{'.'.join(where)}': {err['msg']}") from None


@dataclass(frozen=True)
class Box:
    """The server the plan is for: the target's whole depth on `tp` GPUs of the profile's box."""
    gpu_name: str
    layers: int
    tp: int
    bf16_tflops: float
    memory_tb_s: float
    interconnect_gb_s: float
    allreduce_us: float


@dataclass(frozen=True)
class Figure:
    value: float
    how: str  # "measured" / "extrapolated"
    why: str


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `fixed + per_layer × layers` over (layers, seconds); neither below zero (a noisy pair
    could make the fixed part negative: then all of it is per layer)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    fixed = my - slope * mx
    if slope < 0:
        return my, 0.0
    if fixed < 0:
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    return fixed, slope


def _ratios(cal: Calibration, box: Box) -> str:
    return (f"{cal.gpu_name} at layers {sorted({d.layers for d in cal.depths})} → {box.layers} layers, TP {box.tp} "
            f"on {box.gpu_name}: compute × {cal.gpu_bf16_tflops / box.bf16_tflops:.2f}, memory × "
            f"{cal.gpu_memory_tb_s / box.memory_tb_s:.2f}, interconnect {box.interconnect_gb_s:g} GB/s, "
            f"all-reduce {box.allreduce_us:g} µs")


def _here(cal: Calibration, box: Box) -> Depth | None:
    """The depth the box is, where it is the measuring GPU alone at a measured depth: its figures are
    measured, not carried."""
    if box.tp == 1 and box.gpu_name == cal.gpu_name:
        return next((d for d in cal.depths if d.layers == box.layers), None)
    return None


def _compute_bound(cal: Calibration, box: Box, rate_of, what: str) -> Figure:
    if (depth := _here(cal, box)):
        return Figure(rate_of(depth), "measured", f"{what}: {cal.gpu_name}, {box.layers} layers ({cal.date})")
    fixed, per_layer = fit([(d.layers, 1 / rate_of(d)) for d in cal.depths])
    layers = per_layer * box.layers * (cal.gpu_bf16_tflops / box.bf16_tflops) / box.tp
    # the all-reduces a token costs (the module's docstring)
    comm = (box.layers * 2 * cal.hidden * 2 * 2 * (box.tp - 1) / box.tp / (box.interconnect_gb_s * 1e9)
            if box.tp > 1 else 0.0)
    return Figure(1 / (fixed + layers + comm), "extrapolated",
                  f"{what}: {_ratios(cal, box)}; a token {fixed * 1e6:.1f} µs fixed (as measured) + "
                  f"{layers * 1e6:.1f} µs its layers + {comm * 1e6:.1f} µs all-reduce")


def extract_rate(cal: Calibration, box: Box) -> Figure:
    return _compute_bound(cal, box, lambda d: d.extract_tokens_per_s, "extraction")


def _memory_bound_step(cal: Calibration, box: Box, step_of) -> float:
    fixed, per_layer = fit([(d.layers, step_of(d)) for d in cal.depths])
    latency = box.layers * 2 * box.allreduce_us * 1e-6 if box.tp > 1 else 0.0
    return fixed + per_layer * box.layers * (cal.gpu_memory_tb_s / box.memory_tb_s) / box.tp + latency


def decode_rate(cal: Calibration, box: Box, concurrency: int) -> Figure:
    # the highest concurrency measured at or below the one asked (the lowest if none is): a larger batch
    # yields more tokens a step, which the slice did not measure, so the rate is not carried above it
    measured = [int(c) for c in cal.depths[0].decode_tokens_per_s]
    c = max((m for m in measured if m <= concurrency), default=min(measured))
    asked = "" if c == concurrency else f" (concurrency {c} measured, {concurrency} asked: {c}'s rate)"
    if (depth := _here(cal, box)):
        return Figure(depth.decode_tokens_per_s[str(c)], "measured",
                      f"decode: {cal.gpu_name}, {box.layers} layers ({cal.date}){asked}")
    step = _memory_bound_step(cal, box, lambda d: c / d.decode_tokens_per_s[str(c)])
    return Figure(c / step, "extrapolated", f"decode at concurrency {c}: {_ratios(cal, box)}{asked}")


def break_even_tau(cal: Calibration, box: Box) -> Figure:
    """τ at which a step with the head (k = cal.k, concurrency 1) yields as much as a plain step: their
    ratio, each carried to the box as a decode step is."""
    if (depth := _here(cal, box)):
        return Figure(depth.step_ms_with_head / depth.step_ms, "measured",
                      f"break-even τ (k = {cal.k}): {cal.gpu_name}, {box.layers} layers")
    plain = _memory_bound_step(cal, box, lambda d: d.step_ms / 1e3)
    with_head = _memory_bound_step(cal, box, lambda d: d.step_ms_with_head / 1e3)
    return Figure(with_head / plain, "extrapolated", f"break-even τ (k = {cal.k}): {_ratios(cal, box)}")
