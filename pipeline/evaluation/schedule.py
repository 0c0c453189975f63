"""From a measured matrix to what is deployed: the draft length k per batch size, decided on the operator's
traffic with the noise beside every figure.

A served figure is never one number here: each level is measured in rounds (evaluate.rounds), and a figure is
their median with the min–max beside it (`Spread`). A speedup's interval is the head's worst over the
baseline's best and the reverse — of a lone server's rounds, or of each server's median round where a side was
measured on several (`server_samples`): the noise a decision stands in.

The sweep (`sweep`): the head served at some k (evaluate.ks) at each concurrency; a k not served is predicted
from what was: its tokens per step from the per-position acceptance a longer draft measured (a chain's
position i is accepted or not whatever follows it, so τ(k) = 1 + Σ_{i ≤ k} p_i), its step cost relative to a
plain step by linear interpolation between the served k (k = 0 is the baseline, cost 1). Every served k with
served neighbours on both sides is also predicted from them, and the error is shown: how far to trust the
predicted ones.

The schedule (`choose_schedule`): at each measured level the k of most tokens/s whose speedup's lower bound
still reaches `floor`, else 0 (no speculation: the head loses there, or cannot be shown not to); between
levels the boundary is their geometric mean; above twice the largest level measured, 0 — nothing was
measured there and speculation only costs more as the batch grows. vLLM's form: inclusive batch-size ranges
with their k (`num_speculative_tokens_per_batch_size`, compat/vllm_dynamic_k.py).

The traffic (`traffic_weights`, `mix`): how production's load spreads over the measured levels — sampled from
its /metrics (vllm:num_requests_running), or declared (evaluate.traffic) — and the expected speedup under it
with its interval."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Spread:
    """A figure measured in rounds: the median and the extremes."""
    median: float
    lo: float
    hi: float
    n: int = 1

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        values = [float(v) for v in values if v is not None]
        if not values:
            raise ValueError("no rounds measured")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, fmt: str = ".1f") -> str:
        if self.n == 1 or self.lo == self.hi:
            return f"{self.median:{fmt}}"
        return f"{self.median:{fmt}} ({self.lo:{fmt}}–{self.hi:{fmt}}, {self.n} rounds)"


def level_rounds(level: dict) -> list[float]:
    """A measured level's tok/s per round (a one-round level: its one figure)."""
    return [float(x) for x in (level.get("rounds_tok_s") or [level["output_tok_s"]])]


def middle_round(level: dict) -> float:
    """A server's figure at one level: its median round (the lower middle of an even count, a round that was
    measured, as served.median_round picks); 0 where a round stalled (no speed), which decide refuses."""
    rounds = sorted(level_rounds(level))
    return 0.0 if rounds[0] <= 0 else rounds[(len(rounds) - 1) // 2]


def server_samples(levels: list[dict]) -> list[float]:
    """What one side of a comparison (the head's servers, or the target alone's) stands on at one level: a lone
    server's rounds, or each server at its median round where several were measured. An instance keeps its
    speed and two of one argv land up to x1.8 apart (NOTES.md "The noise between instances"); a round that is
    off is not kept where its server has others beside it: pooled as rounds, every server added could only widen
    the interval (on one H100, 2026-12-07, a head x1.23-x1.51 above the target alone's fastest server at every
    level read x1.076 on the slowest first round of one server against the fastest round of another). A lone
    server's rounds are all the noise known of its side, so adding a server can narrow the interval too."""
    if len(levels) == 1:
        return level_rounds(levels[0])
    return [middle_round(level) for level in levels]


def speedup_interval(head: list[float], base: list[float]) -> tuple[float, float, float]:
    """(median, low, high) of the head's speedup over the baseline from their rounds: median over median, the
    head's worst over the baseline's best, and the reverse."""
    h, b = Spread.of(head), Spread.of(base)
    return h.median / b.median, h.lo / b.hi, h.hi / b.lo


@dataclass
class Point:
    """One (k, concurrency) of the sweep."""
    k: int
    c: int
    tok_s: float
    speedup: float
    lo: float
    hi: float
    tau: float | None
    measured: bool
    rounds: list[float] = field(default_factory=list)
    error: float | None = None
    """A served k predicted from its served neighbours: (predicted − measured) / measured tok/s."""

    def to_dict(self) -> dict:
        return {key: (round(v, 4) if isinstance(v, float) else v) for key, v in asdict(self).items()
                if v is not None and v != []}


def sweep_ks(profile) -> list[int]:
    """The draft lengths the head is weighed at: evaluate.ks, else 1 … train.ttt_steps + 1."""
    return sorted(set(profile.evaluate.ks) or set(range(1, profile.train.ttt_steps + 2)))


def served_ks(profile, ks: list[int]) -> list[int]:
    """The k served (the rest predicted): every k, or the ends and evaluate.k; evaluate.k alone without a
    schedule."""
    ev = profile.evaluate
    if ev.schedule == "off":
        return [ev.k]
    return sorted({*ks, ev.k} if ev.k_sweep == "measure" else {min(ks), max(ks), ev.k})


def head_rows(profile, head: str) -> list[str]:
    """A head's rows beside its own at evaluate.k: each other k served, and (at most) its schedule."""
    ev = profile.evaluate
    rows = [f"{head}-k{k}" for k in served_ks(profile, sweep_ks(profile)) if k != ev.k]
    return rows + ([f"{head}-schedule"] if ev.schedule == "auto" else [])


def matrix_rows(profile) -> list[str]:
    """deploy-measure's rows as it will serve them: the methods, the baseline's other instances, the head at
    each other served k, and (at most) its schedule."""
    ev = profile.evaluate
    rows = list(ev.methods) + [f"baseline-{i}" for i in range(2, ev.baseline_instances + 1)]
    return rows + (head_rows(profile, "eagle3") if "eagle3" in ev.methods else [])


def noise_rows(profile) -> list[str]:
    """The servers deploy-measure adds only where two instances of the target alone (the baseline's, production
    before the run) measure further apart than evaluate.instance_spread: one more baseline instance, and the
    deployed head's second server (stages.benchmark.settled_noise, layout.matrix.second_instance)."""
    ev = profile.evaluate
    if ev.baseline_instances < 2 and not ev.production_before_after:
        return []  # one instance of the target alone: nothing to disagree
    heads = [m for m in ev.methods if m == "eagle3"] + (["existing"] if ev.existing_head else [])
    return [f"baseline-{ev.baseline_instances + 1}"] + (["the deployed head's second server"] if heads else [])


def tau_at(per_position: list[float], k: int) -> float:
    """Tokens per step of a chain of k drafts from the per-position acceptance a chain of ≥ k measured."""
    return 1.0 + sum(per_position[:k])


def sweep(served: dict[int, dict], baseline: dict, ks: list[int]) -> dict[int, dict[int, Point]]:
    """Every k of `ks` (and 0, the baseline) at every concurrency the baseline was measured at.
    `served`: k → the head's matrix row at that k; `baseline`: the baseline's row (`baseline_rounds`: its
    rounds, or each instance's median round where several were measured: server_samples). A row's levels are
    keyed by concurrency (int or str)."""
    out: dict[int, dict[int, Point]] = {}
    for c_key, base_level in (baseline.get("levels") or {}).items():
        c = int(c_key)
        base_rounds = [float(x) for x in base_level.get("baseline_rounds") or level_rounds(base_level)]
        base_tok = Spread.of(base_rounds).median
        points: dict[int, Point] = {0: Point(0, c, base_tok, 1.0, *speedup_interval(base_rounds, base_rounds)[1:],
                                             tau=1.0, measured=True, rounds=base_rounds)}
        cost: dict[int, float] = {0: 1.0}  # a step's cost relative to a plain one
        taus: dict[int, float] = {}
        longest: list[float] = []
        for k in sorted(served):
            level = _level(served[k], c)
            if not level or not level.get("output_tok_s"):
                continue
            rounds = level_rounds(level)
            med, lo, hi = speedup_interval(rounds, base_rounds)
            tau = level.get("tokens_per_step") or level.get("mean_acceptance_length")
            points[k] = Point(k, c, Spread.of(rounds).median, med, lo, hi, tau, True, rounds)
            if tau:
                taus[k] = float(tau)
                cost[k] = float(tau) / med
            if level.get("acceptance_per_position") and len(level["acceptance_per_position"]) >= len(longest):
                longest = [float(x) for x in level["acceptance_per_position"]]
        for k in sorted(set(ks) - set(points)):
            if (p := _predict(k, cost, taus, longest, base_tok)) is not None:
                width = _relative_width(points, k)
                points[k] = Point(k, c, p * base_tok, p, p * width[0], p * width[1], tau_at(longest, k), False)
        for k in sorted(cost):  # leave-one-out: each served k between two others, predicted from them
            if k == 0:
                continue
            others = {j: v for j, v in cost.items() if j != k}
            if min(others) < k < max(others) and longest and k <= len(longest):
                p = _predict(k, others, {j: t for j, t in taus.items() if j != k}, longest, base_tok)
                if p is not None and points[k].speedup:
                    points[k].error = (p - points[k].speedup) / points[k].speedup
        out[c] = points
    return out


def _level(row: dict, c: int) -> dict:
    return {str(key): v for key, v in (row.get("levels") or {}).items()}.get(str(c)) or {}


def _predict(k: int, cost: dict[int, float], taus: dict[int, float], per_position: list[float],
             base_tok: float) -> float | None:
    """The predicted speedup at k: τ(k) over the step cost interpolated between the served k around it;
    None outside the served range or past the positions measured."""
    below = [j for j in cost if j < k]
    above = [j for j in cost if j > k]
    if not below or not above or k > len(per_position) or base_tok <= 0:
        return None
    a, b = max(below), min(above)
    step = cost[a] + (cost[b] - cost[a]) * (k - a) / (b - a)
    return tau_at(per_position, k) / step


def _relative_width(points: dict[int, Point], k: int) -> tuple[float, float]:
    """The interval of a predicted point, as wide (relative to its median) as its nearest served neighbour's."""
    served = [p for j, p in points.items() if j != 0 and p.measured]
    if not served:
        return 1.0, 1.0
    near = min(served, key=lambda p: abs(p.k - k))
    return (near.lo / near.speedup, near.hi / near.speedup) if near.speedup else (1.0, 1.0)


@dataclass(frozen=True)
class Schedule:
    """k per inclusive batch-size range, as vLLM's num_speculative_tokens_per_batch_size takes it."""
    ranges: tuple[tuple[int, int, int], ...]
    per_level: tuple[tuple[int, int], ...]
    """(concurrency, k) as chosen at each measured level."""

    @property
    def max_k(self) -> int:
        return max((k for _, _, k in self.ranges), default=0)

    @property
    def speculates(self) -> bool:
        return self.max_k > 0

    @property
    def single_k(self) -> int | None:
        """The one k used at every batch size (no schedule needed), or None."""
        ks = {k for _, _, k in self.ranges}
        return ks.pop() if len(ks) == 1 else None

    def as_vllm(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]

    def text(self) -> str:
        return ", ".join(f"{a}–{b}: k={k}" if a != b else f"{a}: k={k}" for a, b, k in self.ranges)


def choose_schedule(points: dict[int, dict[int, Point]], max_batch: int, floor: float = 0.97) -> Schedule:
    """At each level the k of most tok/s among those whose speedup's lower bound reaches `floor` and whose
    median gains; 0 where none does. Ranges split at the geometric mean of neighbouring levels; the last
    measured level's k holds to twice that level, 0 above (not measured)."""
    levels = sorted(points)
    chosen = []
    for c in levels:
        ok = [p for k, p in points[c].items() if k > 0 and p.speedup > 1.0 and p.lo >= floor]
        best = max(ok, key=lambda p: (p.tok_s, -p.k), default=None)
        chosen.append((c, best.k if best else 0))
    ranges: list[list[int]] = []
    start = 1
    for i, (c, k) in enumerate(chosen):
        end = (math.isqrt(c * levels[i + 1]) if i + 1 < len(levels) else 2 * c)
        end = max(start, min(end, max_batch))
        ranges.append([start, end, k])
        start = end + 1
        if start > max_batch:
            break
    if start <= max_batch:
        ranges.append([start, max_batch, 0])
    merged: list[list[int]] = []
    for r in ranges:
        if merged and merged[-1][2] == r[2]:
            merged[-1][1] = r[1]
        else:
            merged.append(r)
    return Schedule(tuple((a, b, k) for a, b, k in merged), tuple(chosen))


def best_mix(points: dict[int, dict[int, Point]], weights: dict[int, float],
             served: set[int]) -> tuple[int, Mix] | None:
    """The one served k whose traffic-weighted speedup's lower bound is highest, with its mix (None where no
    k > 0 is measured at every weighed level): what falls back from a schedule, gaining or not."""
    mixes = single_k_mixes(points, weights, served)
    return max(mixes.items(), key=lambda km: km[1].lo, default=None)


def single_k_mixes(points: dict[int, dict[int, Point]], weights: dict[int, float], served: set[int]) -> dict[int, Mix]:
    """Each served k > 0 at every load, under the traffic: {k: Mix} (a k missing at a weighed level left out)."""
    out = {}
    for k in sorted(k for k in served if k > 0):
        if (m := mix({c: (pts[k].speedup, pts[k].lo, pts[k].hi) for c, pts in points.items() if k in pts},
                     weights)) is not None:
            out[k] = m
    return out


def traffic_weights(samples: list[float], levels: list[int]) -> dict[int, float]:
    """Running-request counts sampled from production, each given to the measured level nearest it on a log
    scale (between 1 and 8 the boundary is √8 ≈ 2.8: 3 running counts for 8); idle samples (none running)
    count for nothing. {} when every sample was idle."""
    counts = {c: 0 for c in levels}
    for s in samples:
        if s < 0.5:
            continue
        counts[min(levels, key=lambda c: abs(math.log(c) - math.log(s)))] += 1
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items() if n} if total else {}


def share_above(samples: list[float], levels: list[int]) -> float:
    """The share of busy samples above twice the largest measured level: load no row measured, which
    traffic_weights gives to that level and a schedule serves with k = 0."""
    busy = [s for s in samples if s >= 0.5]
    return sum(s > 2 * max(levels) for s in busy) / len(busy) if busy and levels else 0.0


def above_text(share: float, most: float, levels: list[int]) -> str:
    return (f"{share:.0%} of it above c = {2 * max(levels)} (up to {most:g} running), where nothing was measured: "
            f"weighed as c = {max(levels)}'s (a level for it in evaluate.concurrency measures it)")


def normalized(weights: dict, levels: list[int]) -> dict[int, float]:
    """Declared weights keyed by level (strings from TOML), normalised; levels not named weigh 0."""
    w = {int(c): float(v) for c, v in weights.items() if int(c) in levels and float(v) > 0}
    total = sum(w.values())
    return {c: v / total for c, v in w.items()} if total else {}


@dataclass(frozen=True)
class Mix:
    expected: float
    lo: float
    hi: float
    weights: dict[int, float]

    def text(self) -> str:
        return f"x{self.expected:.3f} (x{self.lo:.3f}–x{self.hi:.3f})"


def mix(levels: dict[int, tuple[float, float, float]], weights: dict[int, float]) -> Mix | None:
    """The expected speedup under the traffic: the same work served in 1 / Σ w_c / s_c of the time, w_c the
    share of production's time at level c (the weighted harmonic mean: an arithmetic mean of the speedups
    leans towards the levels where the head wins — x1.5 at c = 1 and x0.7 at c = 32, half the time each, is
    x0.955, not x1.1). Monotone in each s_c, so the levels' low and high figures bound it. None when a level
    the traffic needs was not measured or measured no speed."""
    if not weights or any(c not in levels or min(levels[c]) <= 0 for c in weights):
        return None
    total = sum(weights.values())
    parts = [total / sum(w / levels[c][i] for c, w in weights.items()) for i in range(3)]
    return Mix(parts[0], parts[1], parts[2], dict(weights))


def instance_spread(figures: list[float]) -> float:
    """How far apart instances of one configuration measured: max / min − 1 (0 for one instance); of three
    or more, the closest two (an instance measured once more because two were apart tells which one was
    off: over the whole set the spread could never shrink)."""
    figures = sorted(f for f in figures if f)
    if len(figures) < 2:
        return 0.0
    if len(figures) == 2:
        return figures[1] / figures[0] - 1
    return min(b / a - 1 for a, b in zip(figures, figures[1:], strict=False))
