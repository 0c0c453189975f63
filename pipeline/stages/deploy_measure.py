"""deploy-measure: the benchmark matrix through real vLLM. For each method of the profile — baseline
(no speculation), ngram (prompt lookup), existing (a head named in the profile), eagle3 (the head this
run trained) — one server at a time serves the held-out prompts greedily at each concurrency level:
output tokens/s, time per output token, and from /metrics (two scrapes) the mean acceptance length
1 + Δaccepted/Δdrafts and the per-position acceptance; speedup against the baseline at the same
concurrency. Outputs with speculation must equal the baseline's (checked at the lowest concurrency); for
the new head a mismatch fails the stage. A method vLLM refuses becomes a row that says why."""
from __future__ import annotations

import sys
from contextlib import ExitStack, closing
from pathlib import Path

from pipeline import atomicio, box, conversations, diagnose, portlock, procs, schedule, target, vllm_modes
from pipeline.compat import vllm_dynamic_k, vllm_errors
from pipeline.decision import Decision
from pipeline.deploy import publish_draft
from pipeline.matrix import level_of
from pipeline.online import in_threads
from pipeline.results import DeployMeasureResult, EvaluateOfflineResult
from pipeline.server import ServerError, port_in_use, port_owner
from pipeline.stages.base import Stage, StageContext, StageError, argv_for
from pipeline.stages.served import decode_steps, measure_served

MODE = {"baseline": "baseline", "ngram": "ngram", "suffix": "suffix", "existing": "speculative",
        "eagle3": "speculative"}
SCHEDULE_ROW = "eagle3-schedule"
MAX_BATCH = 1024  # the schedule's last range ends here; vLLM caps it at its own max_num_seqs


def mode_of(method: str) -> str:
    """The server mode of a matrix row: baseline-2 is another instance of the baseline, eagle3-k2 and
    eagle3-schedule the head at another k and with a k per batch size."""
    return MODE[method.split("-", 1)[0]]


def is_head(method: str) -> bool:
    return method.split("-", 1)[0] == "eagle3"


def start_method(ctx: StageContext, profile, method: str, **mode_args):
    """Serve `method` on `profile`'s port: (lease, None) or (None, why)."""
    if method == "suffix" and (why := vllm_dynamic_k.suffix_missing(profile.server.python or sys.executable)):
        return None, why
    try:
        return ctx.lease(mode_of(method), profile=profile, name=method, **mode_args), None
    except ServerError as exc:
        box.free_port(profile, ctx.log.info, own_run=str(ctx.run.root))
        return None, str(exc)


def numeric_ties(found: list[dict], max_gap: float) -> list[int]:
    """The prompts whose divergence sits where the target's own top two were within `max_gap` nats."""
    return [d["prompt"] for d in found if d.get("gap") is not None and d["gap"] <= max_gap]


def head_failure(ctx: StageContext, matrix: dict, low: int, failures: dict, prompts: int) -> str | None:
    """Why the new head's rows fail the stage (serving failed, no drafts, outputs that differ beyond numeric
    ties at any k or with the schedule), or None."""
    eagle = matrix.get("eagle3")
    if eagle is None:
        return None
    if eagle.get("error"):
        return f"serving the new head failed: {eagle['error']}"
    if not eagle["levels"][low].get("drafts"):
        return f"the speculative server reported no drafts: is the head loaded? see {ctx.run.log_path('server-eagle3')}"
    for method in (m for m in matrix if is_head(m) and m in failures):
        ties = matrix[method].get("numeric_ties", 0)
        beyond = f" beyond {ties} near-tie(s) of the target's own" if ties else ""
        which = "the new head" if method == "eagle3" else f"the new head ({method})"
        return (f"outputs with and without {which} differ for {len(failures[method])}/{prompts} prompts "
                f"(first: {failures[method][0]}){beyond}; see {ctx.run.online_result}")
    return None


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
            rec = box.controller(variant).record()
            if rec is None or rec.pid != owner.pid or not rec.run or rec.owner_alive():
                return _one_at_a_time(ctx, f"port {variant.server.port} is in use by pid {owner.pid} "
                                           f"({procs.shown_cmdline(owner, 80)})")
            ctx.note(f"port {variant.server.port}: {box.orphan_text(rec)}: stopped")
            box.free_port(variant, ctx.log.info, own_run=str(ctx.run.root))
        elif port_in_use(variant.server.host, variant.server.port):  # a listener this user cannot see
            return _one_at_a_time(ctx, f"port {variant.server.port} is in use by a process this user cannot see")
        profiles.append(variant)
    return profiles


def _one_at_a_time(ctx: StageContext, why: str) -> list:
    ctx.note(f"{why}: the measured servers start one at a time on port {ctx.profile.server.port}", ctx.log.info)
    return [ctx.profile]


def measure_all(ctx: StageContext, methods: list[str], prompts: list[list[int]], args: dict,
                matrix: dict | None = None) -> dict:
    """The matrix: servers started side by side on consecutive ports (as many as evaluate.start_together
    asks and the GPUs' memory allows), so their starts overlap; then measured one at a time while the
    others idle; then stopped. `matrix`: rows measured earlier, extended (their baseline the reference)."""
    count, why = box.side_by_side(ctx.profile, min(ctx.profile.evaluate.start_together, len(methods)))
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
                                      else measure_served(ctx, method, lease.rec, lease.start_s, prompts, reference))
            finally:
                box.free_ports([p for _, p in group], ctx.log.info, own_run=str(ctx.run.root))
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
        missing = sorted(set(weights) - set(levels))
        return Decision(False, f"no speedup measured at concurrency {', '.join(map(str, missing))}")
    deploy = m.lo >= threshold
    rel = ">=" if deploy else "<"
    # Three decimals: at two, x1.098 against x1.10 would read "x1.10 (threshold x1.10)".
    if len(m.weights) == 1 and m.lo == m.hi:  # one level, one round: the figure is its own interval
        (c,) = m.weights
        return Decision(deploy, f"{what + ': ' if what else ''}speedup x{m.expected:.3f} {rel} threshold "
                                f"x{threshold:g} at concurrency {c}")
    return Decision(deploy, f"{what + ': ' if what else ''}expected speedup {m.text()} under {traffic}: "
                            f"lower bound x{m.lo:.3f} {rel} threshold x{threshold:g}")


def pooled_baseline(matrix: dict) -> dict:
    """The baseline's row with every instance's rounds at each level (`baseline_rounds`): the noise of the
    target alone, across servers as well as within one."""
    base = matrix["baseline"]
    levels = {}
    for c, level in base.get("levels", {}).items():
        pooled = [r for m, row in matrix.items()
                  if mode_of(m) == "baseline" and not row.get("error") and c in row.get("levels", {})
                  for r in schedule.level_rounds(row["levels"][c])]
        levels[c] = {**level, "baseline_rounds": pooled}
    return {**base, "levels": levels}


def instance_check(ctx: StageContext, matrix: dict) -> dict:
    """How far instances of the target alone measured apart at each level: the matrix's baseline
    instances, and production before the run (measure-production) where it was measured."""
    ev = ctx.profile.evaluate
    out: dict = {"bound": ev.instance_spread, "levels": {}}
    before = (atomicio.read_json(ctx.run.production_before) or {}).get("row") or {}
    for c, level in matrix["baseline"].get("levels", {}).items():
        medians = {m: row["levels"][c]["output_tok_s"] for m, row in matrix.items()
                   if mode_of(m) == "baseline" and not row.get("error") and c in row.get("levels", {})}
        entry: dict = {"baseline_instances": medians,
                       "spread": round(schedule.instance_spread(list(medians.values())), 4)}
        if (prod := level_of(before, c).get("output_tok_s")) is not None:
            entry["production_before"] = prod
            entry["production_vs_baseline"] = round(prod / level["output_tok_s"] - 1, 4)
        out["levels"][str(c)] = entry
    spreads = [e["spread"] for e in out["levels"].values()]
    out["spread"] = max(spreads, default=0.0)
    out["decides"] = out["spread"] <= ev.instance_spread
    return out


def noise_line(check: dict) -> str:
    """What the instance comparison says, one line."""
    parts = []
    for c, e in check["levels"].items():
        if len(e["baseline_instances"]) > 1:
            parts.append(f"c={c} baseline instances {e['spread']:.0%} apart")
        if "production_vs_baseline" in e:
            parts.append(f"c={c} production before vs baseline {e['production_vs_baseline']:+.0%}")
    return "; ".join(parts) or "one baseline instance (evaluate.baseline_instances = 2 measures the spread)"


def traffic_of(ctx: StageContext, levels: list[int]) -> tuple[dict[int, float], str]:
    """The traffic's weight per level and where it comes from: production's own load sampled by
    measure-production, else evaluate.traffic, else every level alike."""
    sampled = ((atomicio.read_json(ctx.run.production_before) or {}).get("traffic") or {})
    weights = schedule.normalized(sampled.get("weights") or {}, levels)
    if weights:
        return weights, f"production's load ({sampled.get('samples')} samples of vllm:num_requests_running)"
    weights = schedule.normalized(dict(ctx.profile.evaluate.traffic), levels)
    if weights:
        return weights, "the declared traffic (evaluate.traffic)"
    return {c: 1 / len(levels) for c in levels}, "every level alike (no traffic declared or sampled)"


def traffic_text(weights: dict[int, float], how: str) -> str:
    return ", ".join(f"c={c} {w:.0%}" for c, w in sorted(weights.items())) + f" ({how})"


def row_levels(row: dict, base: dict) -> dict[int, tuple[float, float, float]]:
    """A measured row's speedup per level as (median, low, high) against the pooled baseline's rounds."""
    out = {}
    for c, level in (row.get("levels") or {}).items():
        b = level_of(base, c)
        if level.get("output_tok_s") and b.get("baseline_rounds"):
            out[int(c)] = schedule.speedup_interval(schedule.level_rounds(level), b["baseline_rounds"])
    return out


class DeployMeasure(Stage):
    name = "deploy-measure"

    def applies(self, profile) -> bool:
        return profile.train.first_node and profile.evaluate.online

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir / "config.json"]

    def fresh_paths(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir]

    def server_argv(self, ctx: StageContext) -> list[str] | None:
        return argv_for(ctx, "baseline")  # the matrix starts with the baseline on the serving port

    def run(self, ctx: StageContext) -> DeployMeasureResult:
        ev = ctx.profile.evaluate
        rows = ctx.heldout_rows()
        prompts = conversations.prompt_ids(target.load_tokenizer(ctx.target_dir()), rows)
        draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
        args: dict = {"eagle3": {"draft_dir": draft}, "existing": {"draft_dir": Path(ev.existing_head)}}
        ks = schedule.sweep_ks(ctx.profile)
        methods = list(ev.methods) + [f"baseline-{i}" for i in range(2, ev.baseline_instances + 1)]
        if "eagle3" in methods:
            for k in schedule.served_ks(ctx.profile, ks):
                if k != ev.k:
                    methods.append(f"eagle3-k{k}")
                    args[f"eagle3-k{k}"] = {"draft_dir": draft, "k": k}
        matrix = measure_all(ctx, methods, prompts, args)
        if matrix["baseline"].get("error"):
            raise StageError(f"baseline server failed: {matrix['baseline']['error']}")
        noise = instance_check(ctx, matrix)
        if not noise["decides"] or any(abs(e.get("production_vs_baseline", 0)) > ev.instance_spread
                                       for e in noise["levels"].values()):
            # two instances of one configuration further apart than the bound: one more baseline instance
            again = f"baseline-{ev.baseline_instances + 1}"
            ctx.note(f"instances apart beyond evaluate.instance_spread = {ev.instance_spread:g} "
                     f"({noise_line(noise)}): the baseline measured once more ({again})", ctx.log.warning)
            measure_all(ctx, [again], prompts, args, matrix)
            noise = instance_check(ctx, matrix)
        base = pooled_baseline(matrix)
        weights, how = traffic_of(ctx, sorted(ev.concurrency))
        weighed = weigh(ctx, matrix, base, ks, weights)
        if weighed.get("schedule_row"):
            measure_all(ctx, [SCHEDULE_ROW], prompts, {SCHEDULE_ROW: {"draft_dir": draft, **weighed["schedule_row"]}},
                        matrix)
            weighed = settle(ctx, matrix, base, weighed, weights)
        low = min(ev.concurrency)
        mismatches: dict[str, list[str]] = {}
        failures: dict[str, list[str]] = {}  # mismatches that are not near-ties of the target's own
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
                    mismatches[method] = [rows[i]["id"] for i in differ]
                    ties = set(numeric_ties(row.get("divergences", []), ev.tie_logprob_gap))
                    row["numeric_ties"] = len(ties)
                    if real := [rows[i]["id"] for i in differ if i not in ties]:
                        failures[method] = real
        base_low = matrix["baseline"]["levels"][low]
        baseline_outputs = base_low["outputs"]
        for row in matrix.values():
            for level in row.get("levels", {}).values():
                level.pop("outputs", None)
        eagle = matrix.get("eagle3")
        offline_tau = ctx.run.result(EvaluateOfflineResult).tau
        failure = head_failure(ctx, matrix, low, failures, len(prompts))
        deployed = weighed.get("deployed")
        if failure is not None:  # a head that failed its own checks is not deployed, whatever its speed
            decision = Decision(False, failure)
        elif not noise["decides"]:
            decision = Decision(False, f"the figures cannot decide: instances of the target alone measured "
                                       f"{noise['spread']:.0%} apart (> evaluate.instance_spread = "
                                       f"{ev.instance_spread:g}): {noise_line(noise)}")
        elif deployed is None:
            decision = Decision(False, weighed["why"])
        else:
            decision = decide(row_levels(matrix[deployed["row"]], base), weights, ev.deploy_speedup,
                              deployed["what"], traffic_text(weights, how))
        verdict = {"decision": decision.line, "deploy": decision.deploy, "reason": decision.reason}
        m = schedule.mix(row_levels(matrix[deployed["row"]], base), weights) if deployed else None
        atomicio.atomic_write_json(ctx.run.online_result, {
            "k": ev.k, "prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
            "min_new_tokens": ev.min_new_tokens, "rounds": ev.rounds,
            "concurrency": sorted(ev.concurrency), "matrix": matrix, "mismatches": mismatches,
            "mismatches_beyond_ties": failures, "tie_logprob_gap": ev.tie_logprob_gap,
            "offline_tau": offline_tau, "sweep": weighed.get("sweep", {}), "schedule": weighed.get("schedule"),
            "deployed": deployed if decision.deploy else None, "considered": deployed,
            "traffic": {"weights": {str(c): round(w, 4) for c, w in weights.items()}, "from": how},
            "expected_speedup": m and {"median": round(m.expected, 4), "lo": round(m.lo, 4), "hi": round(m.hi, 4)},
            "instances": noise, **verdict})
        if failure is not None:
            raise StageError(failure)
        figures = {**verdict, "offline_tau": offline_tau, "baseline_tok_s": base_low["output_tok_s"],
                   "instance_spread": noise["spread"], "traffic": traffic_text(weights, how)}
        if m is not None:
            figures.update(expected_speedup=round(m.expected, 4), expected_speedup_lo=round(m.lo, 4),
                           expected_speedup_hi=round(m.hi, 4))
        if deployed is not None:
            figures.update(deployed_k=deployed["k"], schedule=deployed.get("schedule"))
        errors: list[float] = [p.error for pts in weighed.get("points", {}).values() for p in pts.values()
                               if p.error is not None]
        if errors:
            worst: float = max(errors, key=abs)  # the largest either way
            figures["prediction_error"] = round(worst, 4)
        if eagle is not None and not eagle.get("error"):
            lv = eagle["levels"][low]
            figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                           acceptance_per_position=lv["acceptance_per_position"], speedup=lv["speedup"],
                           speculative_tok_s=lv["output_tok_s"], identical_outputs=eagle["identical_outputs"],
                           tokens_per_step=lv["tokens_per_step"],
                           **step_economics(base_low, lv, ev.deploy_speedup),
                           **streamed_split(base_low, lv))
            if offline_tau is None:  # the offline evaluator did not compare it with training already
                figures |= diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), lv["acceptance_per_position"],
                                                     "through vLLM", baseline_outputs)
        ngram = matrix.get("ngram", {}).get("levels", {}).get(low, {})
        if ngram.get("mean_acceptance_length") is not None:
            steps = decode_steps(ngram["output_tokens"] - ngram.get("requests", len(prompts)), ngram["accepted"],
                                 ngram["drafts"])
            figures.update(ngram_tau=ngram["mean_acceptance_length"], ngram_tokens_per_step=ngram["tokens_per_step"],
                           ngram_draft_share=round(ngram["drafts"] / steps, 4) if steps > 0 else 1.0)
        return DeployMeasureResult.of(figures)


def served_head_rows(matrix: dict, k: int) -> dict[int, str]:
    """The new head's measured rows by their k: eagle3 at evaluate.k, eagle3-kN at N (a row that failed left out)."""
    return {(k if m == "eagle3" else int(m.removeprefix("eagle3-k"))): m for m, row in matrix.items()
            if (m == "eagle3" or m.startswith("eagle3-k")) and not row.get("error")}


def weigh(ctx: StageContext, matrix: dict, base: dict, ks: list[int], weights: dict[int, float]) -> dict:
    """The sweep over k, and what it leads to: a schedule to serve and measure (`schedule_row`: its
    server's k and ranges), or the one k to deploy (`deployed`), or why nothing (`why`)."""
    ev = ctx.profile.evaluate
    row_of = served_head_rows(matrix, ev.k)
    head = {k: matrix[m] for k, m in row_of.items()}
    if not head:
        return {"why": "the new head was not measured" if "eagle3" in matrix else "no eagle3 row in evaluate.methods"}
    points = schedule.sweep(head, base, ks)
    out: dict = {"points": points, "sweep": {str(c): {str(k): p.to_dict() for k, p in sorted(pts.items())}
                                             for c, pts in points.items()}}
    errors = [(p.k, c, p.error) for c, pts in points.items() for p in pts.values() if p.error is not None]
    if errors:
        ctx.note("the sweep's prediction against served k: " + ", ".join(
            f"k={k} c={c} {e:+.1%}" for k, c, e in errors), ctx.log.info)
    if ev.schedule == "off":
        return out | {"deployed": {"row": "eagle3", "k": ev.k, "what": f"k={ev.k}"}}
    chosen = schedule.choose_schedule(points, MAX_BATCH, ev.schedule_floor)
    out["schedule"] = {"ranges": chosen.as_vllm(), "per_level": {str(c): k for c, k in chosen.per_level},
                       "text": chosen.text()}
    ctx.note(f"k per level (most tok/s whose speedup's lower bound reaches x{ev.schedule_floor:g}): "
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
    k = schedule.best_single_k(points, weights, set(row_of))
    ctx.note(f"no k per batch size ({why}): one k for every load, the best for the traffic: "
             + (f"k={k}" if k else "none gains"), ctx.log.warning)
    if not k:
        return {"why": f"no single k gains under the traffic ({why})"}
    return {"deployed": {"row": row_of[k], "k": k, "what": f"k={k} at every batch size (no schedule: {why})"}}


def settle(ctx: StageContext, matrix: dict, base: dict, weighed: dict, weights: dict[int, float]) -> dict:
    """After the schedule was served: deploy it where its server measured, else fall back to one k."""
    row = matrix.get(SCHEDULE_ROW) or {}
    chosen = weighed["chosen"]
    if row.get("error"):
        ctx.note(f"the schedule ({chosen.text()}) did not serve: {row['error']}", ctx.log.warning)
        return weighed | fallback(ctx, weighed["points"], weights, served_head_rows(matrix, ctx.profile.evaluate.k),
                                  f"vLLM refused it: {row['error']}")
    return weighed | {"deployed": {"row": SCHEDULE_ROW, "k": chosen.max_k, "schedule": chosen.as_vllm(),
                                   "what": f"schedule {chosen.text()}"}}


def streamed_split(baseline: dict, eagle: dict) -> dict:
    """Where a request's time goes, streamed: the first token's wait and the decode after it, with the head
    and without. The decode alone is what a draft can speed up; the first token's wait (prefill, the
    request's own overheads) it cannot, so short answers dilute a decode speedup."""
    keys = ("ttft_ms", "decode_tpot_ms", "chunk_ms")
    if any(baseline.get(k) is None or eagle.get(k) is None for k in keys):
        return {}
    out = {k: eagle[k] for k in keys} | {f"baseline_{k}": baseline[k] for k in keys}
    if eagle["decode_tpot_ms"]:
        out["decode_speedup"] = round(baseline["decode_tpot_ms"] / eagle["decode_tpot_ms"], 3)
    return out


def step_economics(baseline: dict, eagle: dict, threshold: float) -> dict:
    """A decode step's cost with the head against a plain one, from the same measurement as the speedup it
    explains: the head's tokens/s over the baseline's is τ × plain step / head step (τ: tokens per step), so a
    step with the head costs τ / speedup plain steps, and the head reaches the deploy threshold from
    τ × threshold / speedup — on the side of τ that the speedup is of the threshold, by construction.
    The plain step is the baseline's time per output token."""
    speedup, tau, plain = eagle.get("speedup"), eagle.get("tokens_per_step"), baseline.get("tpot_ms")
    if not speedup or not tau or not plain:
        return {}
    return {"step_ms": round(plain * tau / speedup, 3), "baseline_step_ms": plain,
            "break_even_tau": round(threshold * tau / speedup, 3), "deploy_speedup": threshold,
            "gpu": vllm_modes.accelerator_available()}
