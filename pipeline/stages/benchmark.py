"""The benchmark matrix through real vLLM, shared by the stages that measure served heads (deploy-measure,
measure-existing): each method's server started (side by side where the box allows), the held-out prompts
measured at each evaluate.concurrency, the outputs compared with the baseline's at the lowest level, how far
instances of the target alone measured apart, the traffic the levels are weighed by, and the deploy
decision on the lower bound of the expected speedup."""
from __future__ import annotations

import math
import statistics
import sys
from contextlib import ExitStack, closing
from dataclasses import dataclass

from pipeline.compat import vllm_dynamic_k, vllm_errors
from pipeline.evaluation import schedule
from pipeline.host import portlock, procs
from pipeline.layout import atomicio
from pipeline.layout.decision import Decision
from pipeline.layout.matrix import level_of, second_instance
from pipeline.serving import ports, vllm_modes
from pipeline.serving.client import in_threads
from pipeline.serving.server import ServerError, port_in_use, port_owner
from pipeline.stages.base import StageContext, StageError
from pipeline.stages.served import measure_served

MODE = {"baseline": "baseline", "ngram": "ngram", "suffix": "suffix", "existing": "speculative",
        "eagle3": "speculative"}


def mode_of(method: str) -> str:
    """The server mode of a matrix row: baseline-2 is another instance of the baseline, eagle3-k2 and
    eagle3-schedule the head at another k and with a k per batch size."""
    return MODE[method.split("-", 1)[0]]


def start_method(ctx: StageContext, profile, method: str, **mode_args):
    """Serve `method` on `profile`'s port: (lease, None) or (None, why)."""
    if method == "suffix" and (why := vllm_dynamic_k.suffix_missing(profile.server.python or sys.executable)):
        return None, why
    try:
        return ctx.lease(mode_of(method), profile=profile, name=method, **mode_args), None
    except ServerError as exc:
        ports.stop_server_on_port(profile, ctx.log.info, own_run=str(ctx.run.root))
        return None, str(exc)


def numeric_ties(found: list[dict], max_gap: float) -> list[int]:
    """The prompts whose divergence sits where the target's own top two were within `max_gap` nats."""
    return [d["prompt"] for d in found if d.get("gap") is not None and d["gap"] <= max_gap]


def side_by_side_ports(ctx: StageContext, count: int, stack: ExitStack) -> list:
    """`count` profiles on server.port, server.port + 1, …: the run holds the first port; the others are
    taken here (their locks held until the stage ends). A port that a dead run's server still holds is
    named and freed; anything else there (or another run's lock), and the methods fall back to one server
    at a time on the run's own port — said in the notes."""
    base = ctx.profile
    profiles = [base]
    for offset in range(1, count):
        variant = base.with_port(base.server.port + offset)
        try:
            stack.enter_context(closing(portlock.hold(variant, ctx.run.root)))
        except portlock.PortTaken as exc:
            return _one_at_a_time(ctx, f"{exc}")
        if (owner := port_owner(variant.server.host, variant.server.port)) is not None:
            rec = ports.controller(variant).record()
            if rec is None or rec.pid != owner.pid or not rec.run or rec.owner_alive():
                return _one_at_a_time(ctx, f"port {variant.server.port} is in use by pid {owner.pid} "
                                           f"({procs.shown_cmdline(owner, 80)})")
            ctx.note(f"port {variant.server.port}: {ports.orphan_text(rec)}: stopped")
            ports.stop_server_on_port(variant, ctx.log.info, own_run=str(ctx.run.root))
        elif port_in_use(variant.server.host, variant.server.port):  # a listener this user cannot see
            return _one_at_a_time(ctx, f"port {variant.server.port} is in use by a process this user cannot see")
        profiles.append(variant)
    return profiles


def _one_at_a_time(ctx: StageContext, why: str) -> list:
    ctx.note(f"{why}: the measured servers start one at a time on port {ctx.profile.server.port}", ctx.log.info)
    return [ctx.profile]


def measure_all(ctx: StageContext, methods: list[str], prompts: list[list[int]], args: dict,
                matrix: dict | None = None, sources: list[str] | None = None) -> dict:
    """The matrix: servers started side by side on consecutive ports (as many as evaluate.start_together
    asks and the GPUs' memory allows), so their starts overlap; then measured one at a time while the
    others idle; then stopped. `matrix`: rows measured earlier, extended (their baseline the reference).
    `sources`: each prompt's source in a mix (a drafting row's τ per source)."""
    count, why = ports.side_by_side(ctx.profile, min(ctx.profile.evaluate.start_together, len(methods)))
    ctx.log.info("servers: %s", why)
    if count < min(ctx.profile.evaluate.start_together, len(methods)):
        ctx.note(why)
    matrix = {} if matrix is None else matrix
    low = min(ctx.profile.evaluate.concurrency)
    with ExitStack() as stack:
        profiles = side_by_side_ports(ctx, count, stack)
        for first in range(0, len(methods), len(profiles)):
            group = list(zip(methods[first: first + len(profiles)], profiles, strict=False))
            try:
                started = in_threads(lambda mp: start_method(ctx, mp[1], mp[0], **args.get(mp[0], {})), group,
                                     len(group), wait_on_error=True)
                started = [again_alone(ctx, method, profile, args, lease, why) if len(group) > 1 else (lease, why)
                           for (method, profile), (lease, why) in zip(group, started, strict=True)]
                for (method, _), (lease, why) in zip(group, started, strict=True):
                    reference = (None if method == "baseline" else
                                 matrix.get("baseline", {}).get("levels", {}).get(low, {}).get("outputs"))
                    matrix[method] = ({"method": method, "error": why} if lease is None
                                      else measure_served(ctx, method, lease.rec, lease.start_s, prompts, reference,
                                                          sources=sources))
            finally:
                ports.stop_servers_on_ports([p for _, p in group], ctx.log.info, own_run=str(ctx.run.root))
    return matrix


def again_alone(ctx: StageContext, method: str, profile, args: dict, lease, why: str | None):
    """A server that failed its side-by-side start because a neighbour changed the GPU's memory while it
    profiled (compat/vllm_errors.shared_gpu_race) is started once more, now that its neighbours hold their
    memory; said in the notes either way."""
    if lease is not None or why is None or not vllm_errors.shared_gpu_race(why):
        return lease, why
    lease, again = start_method(ctx, profile, method, **args.get(method, {}))
    ctx.note(f"{method}: its side-by-side start failed on vLLM's memory profiling ({why}); started again alone: "
             + ("up" if lease is not None else f"failed again: {again}"), ctx.log.info)
    return lease, again


def decide(levels: dict[int, tuple[float, float, float]] | None, weights: dict[int, float], threshold: float,
           what: str = "", traffic: str = "") -> Decision:
    """Deploy when the lower bound of the expected speedup under the traffic reaches the threshold. `levels`:
    concurrency → (median, low, high) speedup of what would be deployed; `weights`: the traffic's share of
    each level; `what`: the configuration ("k=3", "schedule …"); `traffic`: where the weights come from."""
    if not levels:
        return Decision(False, "the new head was not measured")
    m = schedule.mix(levels, weights)
    if m is None:
        if missing := sorted(set(weights) - set(levels)):
            return Decision(False, f"no speedup measured at concurrency {', '.join(map(str, missing))}")
        stalled = sorted(c for c in weights if min(levels[c]) <= 0)
        return Decision(False, f"a round measured no speed at concurrency {', '.join(map(str, stalled))}")
    deploy = m.lo >= threshold
    rel = ">=" if deploy else "<"
    # Three decimals: at two, x1.098 against x1.10 would read "x1.10 (threshold x1.10)"; a bound below the
    # threshold is cut, not rounded, so that x1.0996 does not read "x1.100 < threshold x1.1".
    lo = f"{m.lo:.3f}" if deploy else f"{math.floor(round(m.lo * 1000, 6)) / 1000:.3f}"  # 1.017 * 1000 = 1016.99…
    if len(m.weights) == 1 and m.lo == m.hi:  # one level, one round: the figure is its own interval
        (c,) = m.weights
        return Decision(deploy, f"{what + ': ' if what else ''}speedup x{lo} {rel} threshold "
                                f"x{threshold:g} at concurrency {c}")
    return Decision(deploy, f"{what + ': ' if what else ''}expected speedup {m.text()} under {traffic}: "
                            f"lower bound x{lo} {rel} threshold x{threshold:g}")


def pooled_baseline(matrix: dict, others: list[dict] | None = None) -> dict:
    """The baseline's row with what every instance measured at each level (`baseline_rounds`: one server's
    rounds, or each server's median round where several were measured — schedule.server_samples): the noise of
    the target alone, across servers as well as within one. `others`: more instances of it measured outside the
    matrix (production before the run, where it is one)."""
    base = matrix["baseline"]
    rows = [row for m, row in matrix.items() if mode_of(m) == "baseline" and not row.get("error")] + (others or [])
    levels = {}
    for c, level in base.get("levels", {}).items():
        pooled = schedule.server_samples([lv for row in rows if (lv := level_of(row, c))])
        levels[c] = {**level, "baseline_rounds": pooled}
    return {**base, "levels": levels}


def production_before(ctx: StageContext) -> tuple[dict, str]:
    """Production's row as measure-production measured it before the run ({} where it did not), and why it
    is no instance of the target alone ("" where it is one: it served no head and carried no load while
    measured; else its gap to the baseline is the head's or the load's)."""
    record = atomicio.read_json(ctx.run.production_before) or {}
    why_not = ("it served a head" if "--speculative-config" in (record.get("argv") or []) else
               "it carried the operator's load while measured" if (record.get("traffic") or {}).get("busy") else "")
    return record.get("row") or {}, why_not


def instance_check(ctx: StageContext, matrix: dict) -> dict:
    """How far instances of the target alone measured apart at each level: the matrix's baseline
    instances, and production before the run (measure-production) where it was measured."""
    ev = ctx.profile.evaluate
    out: dict = {"bound": ev.instance_spread, "levels": {}}
    # production before the run is one more instance of the target alone only where it is one: else said, no veto
    before, why_not = production_before(ctx)
    if before and why_not:
        out["production_not_an_instance"] = why_not
    for c in matrix["baseline"].get("levels", {}):
        medians = {m: row["levels"][c]["output_tok_s"] for m, row in matrix.items()
                   if mode_of(m) == "baseline" and not row.get("error") and c in row.get("levels", {})}
        entry: dict = {"baseline_instances": medians,
                       "spread": round(schedule.instance_spread(list(medians.values())), 4)}
        every = [f for f in medians.values() if f]
        if (prod := level_of(before, c).get("output_tok_s")) is not None and medians:
            entry["production_before"] = prod  # against the instances' median: one more instance can settle it
            entry["production_vs_baseline"] = round(prod / statistics.median(medians.values()) - 1, 4)
            every += [prod] if prod and not why_not else []
        # every instance of the target alone, production before too where it is one: where an extra baseline
        # settled two (the closest two agree), the one apart still was — what decides on one server or two
        entry["span"] = round(max(every) / min(every) - 1, 4) if every else 0.0
        out["levels"][str(c)] = entry
    out["spread"] = max((e["spread"] for e in out["levels"].values()), default=0.0)
    out["span"] = max((e["span"] for e in out["levels"].values()), default=0.0)
    # production before the run is an instance of the target alone too (schema: evaluate.instance_spread)
    out["decides"] = out["spread"] <= ev.instance_spread and (bool(why_not) or all(
        abs(e.get("production_vs_baseline", 0)) <= ev.instance_spread for e in out["levels"].values()))
    return out


def noise_line(check: dict) -> str:
    """What the instance comparison says, one line."""
    parts = []
    for c, e in check["levels"].items():
        if (n := len(e["baseline_instances"])) > 1:
            parts.append(f"c={c} baseline instances {e['spread']:.0%} apart" + (f" (the closest two of {n})"
                                                                                 if n > 2 else ""))
        if "production_vs_baseline" in e:
            parts.append(f"c={c} production before vs baseline {e['production_vs_baseline']:+.0%}")
        if e.get("span", 0) > max(e["spread"], abs(e.get("production_vs_baseline", 0))):
            parts.append(f"c={c} every instance {e['span']:.0%} apart")
    if parts and (why := check.get("production_not_an_instance")):
        parts.append(f"production before is no instance of the target alone ({why})")
    return "; ".join(parts) or "one baseline instance (evaluate.baseline_instances = 2 measures the spread)"


def traffic_of(ctx: StageContext, levels: list[int]) -> tuple[dict[int, float], str]:
    """The traffic's weight per level and where it comes from: production's own load sampled by
    measure-production, else evaluate.traffic, else every level alike."""
    sampled = ((atomicio.read_json(ctx.run.production_before) or {}).get("traffic") or {})
    weights = schedule.normalized(sampled.get("weights") or {}, levels)
    if weights:
        above = f"; {schedule.above_text(sampled['above'], sampled.get('max_running', 0), levels)}" \
            if sampled.get("above") else ""
        return weights, f"production's load ({sampled.get('samples')} samples of vllm:num_requests_running{above})"
    weights = schedule.normalized(dict(ctx.profile.evaluate.traffic), levels)
    if weights:
        return weights, "the declared traffic (evaluate.traffic)"
    return {c: 1 / len(levels) for c in levels}, "every level alike (no traffic declared or sampled)"


def traffic_text(weights: dict[int, float], how: str) -> str:
    return ", ".join(f"c={c} {w:.0%}" for c, w in sorted(weights.items())) + f" ({how})"


def row_levels(row: dict, base: dict) -> dict[int, tuple[float, float, float]]:
    """A measured row's speedup per level as (median, low, high) against the pooled baseline's samples."""
    out = {}
    for c, level in (row.get("levels") or {}).items():
        b = level_of(base, c)
        if level.get("output_tok_s") and b.get("baseline_rounds"):
            out[int(c)] = schedule.speedup_interval(schedule.level_rounds(level), b["baseline_rounds"])
    return out


def compare_rows(matrix: dict, ids: list[str], low: int, tie_gap: float) -> tuple[dict, dict]:
    """Each row's speedup over the baseline at each level, and its outputs against the baseline's at the
    lowest (`identical_outputs`, `numeric_ties` on the row): (mismatches, failures), the prompt ids whose
    outputs differ per method, and those of them that are not near-ties of the target's own."""
    mismatches: dict[str, list[str]] = {}
    failures: dict[str, list[str]] = {}
    for method, row in matrix.items():
        for c, level in row.get("levels", {}).items():
            b = matrix["baseline"]["levels"].get(c, {})
            level["speedup"] = (round(level["output_tok_s"] / b["output_tok_s"], 3) if b.get("output_tok_s")
                                else None)
        if method != "baseline" and low in row.get("levels", {}):
            pairs = zip(matrix["baseline"]["levels"][low]["outputs"], row["levels"][low]["outputs"], strict=True)
            differ = [i for i, (a, b) in enumerate(pairs) if a != b]
            row["identical_outputs"] = not differ
            if differ:
                mismatches[method] = [ids[i] for i in differ]
                ties = set(numeric_ties(row.get("divergences", []), tie_gap))
                row["numeric_ties"] = len(ties)
                if real := [ids[i] for i in differ if i not in ties]:
                    failures[method] = real
    return mismatches, failures


def settled_noise(ctx: StageContext, matrix: dict, prompts: list[list[int]], args: dict) -> dict:
    """The instance check, with the baseline measured once more where two instances of the target alone
    measured further apart than evaluate.instance_spread."""
    ev = ctx.profile.evaluate
    noise = instance_check(ctx, matrix)
    if not noise["decides"]:
        # two instances of one configuration further apart than the bound: one more baseline instance
        again = f"baseline-{ev.baseline_instances + 1}"
        ctx.note(f"instances apart beyond evaluate.instance_spread = {ev.instance_spread:g} "
                 f"({noise_line(noise)}): the baseline measured once more ({again})", ctx.log.warning)
        measure_all(ctx, [again], prompts, args, matrix)
        noise = instance_check(ctx, matrix) | {"measured_again": again}
    return noise


def apart_text(noise: dict) -> str:
    """The widest gap between any two instances of the target alone at one level (instance_check's span:
    the baseline's instances, production before the run where it is one) and where it was measured."""
    return (f"instances of the target alone measured {noise['span']:.0%} apart (> evaluate.instance_spread = "
            f"{noise['bound']:g}): {noise_line(noise)}")


def instances_disagree(noise: dict) -> bool:
    """Any two instances of the target alone further apart than evaluate.instance_spread at one level (an
    extra baseline that settled two included): a head is then decided on two servers of its own."""
    return noise["span"] > noise["bound"]


def pooled_row(matrix: dict, row: str) -> dict:
    """`row` with its second instance at each level (where one was measured): each server at its median round,
    the head's noise across servers, as pooled_baseline's is the target alone's."""
    first, second = matrix[row], matrix.get(second_instance(row)) or {}
    if not second or second.get("error"):
        return first
    levels = {c: {**level, "rounds_tok_s": schedule.server_samples([level, extra])}
              if (extra := (second.get("levels") or {}).get(c)) else level
              for c, level in (first.get("levels") or {}).items()}
    return {**first, "levels": levels}


def at_middle(row: dict) -> dict:
    """`row` with each level at its median round alone: as it will stand beside a second server of its own
    (pooled_row), so that a second server is asked wherever the two could clear the threshold together."""
    return {**row, "levels": {c: {**level, "rounds_tok_s": [schedule.middle_round(level)]}
                              for c, level in (row.get("levels") or {}).items()}}


def through_the_noise(decision: Decision, noise: dict, second: dict | None) -> Decision:
    """Instances of the target alone measured further apart than evaluate.instance_spread: a decision to deploy
    stands only where the head, measured on a second server too (`second`, its row), still clears the
    threshold with its slower server against the target alone's fastest server, each at its median round
    (`decision`, decided on pooled_row and pooled_baseline). Else the figures cannot decide. On one H200
    (2026-12-07) a 25 % gap between two baselines kept out a head at x1.686 (x1.339-x2.044) measured on
    one server: whether its own server was a fast instance is what the second one tells."""
    apart = apart_text(noise)
    if not decision.deploy and second is None:  # not even its one server clears it against every instance
        return Decision(False, f"{decision.reason} ({apart})")
    if second is None or second.get("error"):
        told = f"; the head's second server: {second['error']} (on its first: {decision.reason})" if second else ""
        return Decision(False, f"the figures cannot decide: {apart}{told}")  # the head measured on one server
    return Decision(decision.deploy, f"{decision.reason}, the head measured on two servers ({apart})")


# ---- a head weighed over k: the sweep, the schedule served and measured, or one k (issue 42), for the new head
# (deploy-measure's row "eagle3") and the one that existed (measure-existing's row "existing") alike

MAX_BATCH = 1024  # the schedule's last range ends here; vLLM caps it at its own max_num_seqs


def schedule_row(head: str) -> str:
    """The row of `head` served with its k per batch size."""
    return f"{head}-schedule"


def sweep_rows(profile, head: str, draft) -> tuple[list[str], dict]:
    """`head` at each other k the sweep serves (schedule.served_ks): the rows `head`-kN and their servers' args."""
    ev = profile.evaluate
    rows = [f"{head}-k{k}" for k in schedule.served_ks(profile, schedule.sweep_ks(profile)) if k != ev.k]
    return rows, {row: {"draft_dir": draft, "k": int(row.rsplit("-k", 1)[1])} for row in rows}


def served_head_rows(matrix: dict, k: int, head: str = "eagle3") -> dict[int, str]:
    """A head's measured rows by their k: `head` at evaluate.k, `head`-kN at N (a row that failed left out)."""
    out = {}
    for m, row in matrix.items():
        n = m.removeprefix(f"{head}-k")
        if not row.get("error") and (m == head or (n != m and n.isdigit())):
            out[k if m == head else int(n)] = m
    return out


def weigh(ctx: StageContext, matrix: dict, base: dict, ks: list[int], weights: dict[int, float],
          head: str = "eagle3") -> dict:
    """The sweep over k, and what it leads to: a schedule to serve and measure (`schedule_row`: its
    server's k and ranges), or the one k to deploy (`deployed`), or why nothing (`why`)."""
    ev = ctx.profile.evaluate
    row_of = served_head_rows(matrix, ev.k, head)
    rows = {k: matrix[m] for k, m in row_of.items()}
    if not rows:
        return {"why": f"the {head} head was not measured" if head in matrix else f"no {head} row in the matrix"}
    points = schedule.sweep(rows, base, ks)
    out: dict = {"points": points, "sweep": {str(c): {str(k): p.to_dict() for k, p in sorted(pts.items())}
                                             for c, pts in points.items()}}
    errors = [(p.k, c, p.error) for c, pts in points.items() for p in pts.values() if p.error is not None]
    if errors:
        ctx.note(f"the sweep's prediction against served k ({head}): " + ", ".join(
            f"k={k} c={c} {e:+.1%}" for k, c, e in errors), ctx.log.info)
    if ev.schedule == "off":
        return out | {"deployed": {"row": head, "k": ev.k, "what": f"k={ev.k}"}}
    chosen = schedule.choose_schedule(points, MAX_BATCH, ev.schedule_floor)
    out["schedule"] = {"ranges": chosen.as_vllm(), "per_level": {str(c): k for c, k in chosen.per_level},
                       "text": chosen.text()}
    ctx.note(f"k per level for {head} (most tok/s whose speedup's lower bound reaches x{ev.schedule_floor:g}): "
             + ", ".join(f"c={c} k={k}" for c, k in chosen.per_level) + f"; schedule {chosen.text()}", ctx.log.info)
    if not chosen.speculates:
        best = max((p for pts in points.values() for k, p in pts.items() if k), key=lambda p: p.speedup,
                   default=None)
        return out | {"why": "the head gains at no measured level" + (
            f" (best: k={best.k} x{best.speedup:.3f} at c={best.c}, {'measured' if best.measured else 'predicted'})"
            if best else "")}
    ok, why = vllm_dynamic_k.schedule_support(ctx.profile.server.python, vllm_modes.accelerator_available())
    if ok and chosen.single_k is None:
        return out | {"schedule_row": {"k": chosen.max_k, "schedule": chosen.as_vllm()}, "chosen": chosen}
    if chosen.single_k is not None and chosen.single_k in row_of:
        k = chosen.single_k
        return out | {"deployed": {"row": row_of[k], "k": k, "what": f"k={k} at every batch size"}}
    return out | fallback(ctx, points, weights, row_of, why)


def fallback(ctx: StageContext, points, weights: dict[int, float], row_of: dict[int, str], why: str) -> dict:
    """One k for every load where a schedule cannot be served: the served k best for the traffic."""
    best = schedule.best_mix(points, weights, set(row_of))
    k = best[0] if best and best[1].lo > 1 else 0
    ctx.note(f"no k per batch size ({why}): one k for every load, the best for the traffic: "
             + (f"k={k}" if k else "none gains"), ctx.log.warning)
    if not k:  # what the nearest miss would have given, so the line says by how much nothing gains
        told = f": the best, k={best[0]}, {best[1].text()}" if best else ""
        return {"why": f"no single k gains under the traffic{told} ({why})"}
    return {"deployed": {"row": row_of[k], "k": k, "what": f"k={k} at every batch size (no schedule: {why})"}}


def settle(ctx: StageContext, matrix: dict, base: dict, weighed: dict, weights: dict[int, float],
           head: str = "eagle3") -> dict:
    """After the schedule was served: deploy it where its server measured, else fall back to one k."""
    row = matrix.get(schedule_row(head)) or {}
    chosen = weighed["chosen"]
    if row.get("error"):
        ctx.note(f"the schedule ({chosen.text()}) did not serve: {row['error']}", ctx.log.warning)
        return weighed | fallback(ctx, weighed["points"], weights,
                                  served_head_rows(matrix, ctx.profile.evaluate.k, head),
                                  f"vLLM refused it: {row['error']}")
    # Its figures are measured now, each single k's were before: a schedule chosen level by level from the
    # sweep can still serve worse under the traffic than one k at every load (its ranges switch k between
    # the measured levels, its server is another instance); the higher lower bound is what is weighed.
    row_of = served_head_rows(matrix, ctx.profile.evaluate.k, head)
    own = schedule.mix(row_levels(row, base), weights)
    best = schedule.best_mix(weighed["points"], weights, set(row_of))
    if own is not None and best is not None and best[1].lo > own.lo:
        k, single = best
        ctx.note(f"the schedule ({chosen.text()}) served {own.text()} under the traffic, k={k} at every batch "
                 f"size {single.text()}: k={k} is weighed", ctx.log.warning)
        return weighed | {"deployed": {"row": row_of[k], "k": k,
                                       "what": f"k={k} at every batch size (above the schedule served)"}}
    return weighed | {"deployed": {"row": schedule_row(head), "k": chosen.max_k, "schedule": chosen.as_vllm(),
                                   "what": f"schedule {chosen.text()}"}}


def head_failure(ctx: StageContext, matrix: dict, head: str, label: str, low: int, failures: dict, prompts: int,
                 result) -> str | None:
    """Why a head's rows (`head` at evaluate.k, `head`-kN, its schedule) cannot be deployed whatever their speed:
    serving failed, no drafts, or outputs that differ from the target's beyond numeric ties; None where none.
    `label` names the head for people ("the new head"); `result` is the file with the figures."""
    row = matrix.get(head)
    if row is None:
        return None
    if row.get("error"):
        return f"serving {label} failed: {row['error']}"
    if not row["levels"][low].get("drafts"):
        return (f"the speculative server reported no drafts: is the head loaded? see "
                f"{ctx.run.log_path(f'server-{head}')}")
    for method in (m for m in matrix if m.split("-", 1)[0] == head and m in failures):
        ties = matrix[method].get("numeric_ties", 0)
        beyond = f" beyond {ties} near-tie(s) of the target's own" if ties else ""
        which = label if method == head else f"{label} ({method})"
        return (f"outputs with and without {which} differ for {len(failures[method])}/{prompts} prompts "
                f"(first: {failures[method][0]}){beyond}; see {result}")
    return None


@dataclass
class Weighed:
    """A head's matrix measured and decided (measure_head): what both stages write and report alike."""
    matrix: dict
    base: dict
    noise: dict
    weights: dict[int, float]
    how: str
    weighed: dict
    low: int
    mismatches: dict
    failures: dict
    failure: str | None
    decision: Decision
    baseline_outputs: list

    @property
    def deployed(self) -> dict | None:
        return self.weighed.get("deployed")

    def mix(self) -> schedule.Mix | None:
        """The expected speedup under the traffic of the row the decision weighed (none for a failed head)."""
        d = self.deployed
        if d is None or self.failure is not None:
            return None
        return schedule.mix(row_levels(pooled_row(self.matrix, d["row"]), self.base), self.weights)

    def written(self, ctx: StageContext, prompts: int) -> dict:
        """The keys eval/online.json and eval/existing.json share."""
        ev, m = ctx.profile.evaluate, self.mix()
        return {
            "prompts": prompts, "max_new_tokens": ev.max_new_tokens, "min_new_tokens": ev.min_new_tokens,
            "rounds": ev.rounds, "concurrency": sorted(ev.concurrency), "matrix": self.matrix,
            "mismatches": self.mismatches, "mismatches_beyond_ties": self.failures,
            "tie_logprob_gap": ev.tie_logprob_gap, "sweep": self.weighed.get("sweep", {}),
            "schedule": self.weighed.get("schedule"), "considered": self.deployed,
            "deployed": self.deployed if self.decision.deploy else None,
            "traffic": {"weights": {str(c): round(w, 4) for c, w in self.weights.items()}, "from": self.how},
            "expected_speedup": m and {"median": round(m.expected, 4), "lo": round(m.lo, 4), "hi": round(m.hi, 4)},
            **self.second_server(),
            "instances": self.noise, **self.verdict()}

    def verdict(self) -> dict:
        return {"decision": self.decision.line, "deploy": self.decision.deploy, "reason": self.decision.reason}

    def second_server(self) -> dict:
        """Where the considered row was measured on a second server: its name and the speedup per level the
        decision weighed (both servers, each at its median round), which the sweep's first-server figures are not."""
        d = self.deployed
        if d is None or (again := second_instance(d["row"])) not in self.matrix:
            return {}
        levels = row_levels(pooled_row(self.matrix, d["row"]), self.base)
        return {"second_server": {"row": again, "levels": {
            str(c): [round(x, 4) for x in v] for c, v in sorted(levels.items())}}}

    def figures(self) -> dict:
        """The figures both stages report: the decision, the instances' spread, the traffic, the mix."""
        out = {**self.verdict(), "instance_spread": self.noise["span"],
               "traffic": traffic_text(self.weights, self.how),
               "baseline_tok_s": self.matrix["baseline"]["levels"][self.low]["output_tok_s"],
               # the target alone at each level: what the planner times the next run's matrix by
               "baseline_levels_tok_s": {str(c): lv["output_tok_s"]
                                         for c, lv in self.matrix["baseline"].get("levels", {}).items()}}
        if (m := self.mix()) is not None:
            out.update(expected_speedup=round(m.expected, 4), expected_speedup_lo=round(m.lo, 4),
                       expected_speedup_hi=round(m.hi, 4))
        return out


def measure_head(ctx: StageContext, head: str, draft, label: str, methods: list[str], args: dict,
                 prompts: list[list[int]], ids: list[str], result, sources: list[str],
                 schedule_sources: list[str] | None = None) -> Weighed:
    """The matrix of `methods` with the head's row `head` (served from `draft`) at each k of the sweep, the
    noise settled, the levels weighed by the traffic, the schedule served where one wins, the outputs compared
    at the lowest level and the decision — deploy-measure's for a new head, measure-existing's for one that
    exists. `label` names the head for people, `result` is the file its figures go to."""
    ev = ctx.profile.evaluate
    matrix = measure_all(ctx, methods, prompts, args, sources=sources)
    if matrix["baseline"].get("error"):
        raise StageError(f"baseline server failed: {matrix['baseline']['error']}")
    noise = settled_noise(ctx, matrix, prompts, args)
    # instances of the target alone measured apart (an extra one settling two or not): every one of them is
    # what the head is measured against, production before the run too where it is one
    apart = instances_disagree(noise)
    before, why_not = production_before(ctx)
    base = pooled_baseline(matrix, [before] if apart and before and not why_not else [])
    weights, how = traffic_of(ctx, sorted(ev.concurrency))
    weighed = weigh(ctx, matrix, base, schedule.sweep_ks(ctx.profile), weights, head)
    if weighed.get("schedule_row"):
        row = schedule_row(head)
        measure_all(ctx, [row], prompts, {row: {"draft_dir": draft, **weighed["schedule_row"]}}, matrix,
                    sources=schedule_sources)
        weighed = settle(ctx, matrix, base, weighed, weights, head)
    deployed = weighed.get("deployed")
    low = min(ev.concurrency)
    # failures: mismatches that are not near-ties of the target's own
    mismatches, failures = compare_rows(matrix, ids, low, ev.tie_logprob_gap)
    failure = head_failure(ctx, matrix, head, label, low, failures, len(prompts), result)
    if failure is None and deployed is not None and apart and \
            decide(row_levels(at_middle(matrix[deployed["row"]]), base), weights, ev.deploy_speedup).deploy:
        # the target alone's servers measured apart: whether the head's one server was a fast one is
        # measured, not assumed (a second server of the row, weighed beside the first, its
        # outputs held to the baseline's as the first's are)
        again = second_instance(deployed["row"])
        row_args = ({"draft_dir": draft, **weighed["schedule_row"]} if deployed["row"] == schedule_row(head)
                    else args[deployed["row"]])
        ctx.note(f"instances of the target alone apart beyond evaluate.instance_spread = {ev.instance_spread:g} "
                 f"({noise_line(noise)}): {deployed['row']} measured on a second server ({again})", ctx.log.warning)
        measure_all(ctx, [again], prompts, {again: row_args}, matrix)
        mismatches, failures = compare_rows(matrix, ids, low, ev.tie_logprob_gap)
        failure = head_failure(ctx, matrix, head, label, low, failures, len(prompts), result)
    baseline_outputs = matrix["baseline"]["levels"][low]["outputs"]
    for r in matrix.values():
        for level in r.get("levels", {}).values():
            level.pop("outputs", None)
    if failure is not None:  # a head that failed its own checks is not deployed, whatever its speed
        decision = Decision(False, failure)
    elif deployed is None:
        decision = Decision(False, weighed["why"] + (f" ({apart_text(noise)})" if apart else ""))
    else:
        decision = decide(row_levels(pooled_row(matrix, deployed["row"]), base), weights, ev.deploy_speedup,
                          deployed["what"], traffic_text(weights, how))
        if apart:
            decision = through_the_noise(decision, noise, matrix.get(second_instance(deployed["row"])))
    return Weighed(matrix, base, noise, weights, how, weighed, low, mismatches, failures, failure, decision,
                   baseline_outputs)
