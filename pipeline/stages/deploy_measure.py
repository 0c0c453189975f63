"""deploy-measure: the benchmark matrix through real vLLM. For each method of the profile — baseline
(no speculation), ngram (prompt lookup), existing (a head named in the profile), eagle3 (the head this
run trained) — one server at a time serves the held-out prompts greedily at each concurrency level:
output tokens/s, time per output token, and from /metrics (two scrapes) the mean acceptance length
1 + Δaccepted/Δdrafts and the per-position acceptance; speedup against the baseline at the same
concurrency. Outputs with speculation must equal the baseline's (checked at the lowest concurrency); for
the new head a mismatch fails the stage. A method vLLM refuses becomes a row that says why."""
from __future__ import annotations

from contextlib import ExitStack, closing
from pathlib import Path

from pipeline import atomicio, box, conversations, diagnose, portlock, procs, target, vllm_modes
from pipeline.compat import vllm_errors
from pipeline.decision import Decision
from pipeline.deploy import publish_draft
from pipeline.matrix import level_of
from pipeline.online import in_threads
from pipeline.results import DeployMeasureResult, EvaluateOfflineResult
from pipeline.server import ServerError, port_in_use, port_owner
from pipeline.stages.base import Stage, StageContext, StageError, argv_for
from pipeline.stages.served import decode_steps, measure_served

MODE = {"baseline": "baseline", "ngram": "ngram", "existing": "speculative", "eagle3": "speculative"}


def start_method(ctx: StageContext, profile, method: str, **mode_args):
    """Serve `method` on `profile`'s port: (lease, None) or (None, why)."""
    try:
        return ctx.lease(MODE[method], profile=profile, name=method, **mode_args), None
    except ServerError as exc:
        box.free_port(profile, ctx.log.info)
        return None, str(exc)


def numeric_ties(found: list[dict], max_gap: float) -> list[int]:
    """The prompts whose divergence sits where the target's own top two were within `max_gap` nats."""
    return [d["prompt"] for d in found if d.get("gap") is not None and d["gap"] <= max_gap]


def head_failure(ctx: StageContext, eagle: dict | None, low: int, failures: dict, prompts: int) -> str | None:
    """Why the new head's row fails the stage (serving failed, no drafts, outputs that differ beyond
    numeric ties), or None."""
    if eagle is None:
        return None
    if eagle.get("error"):
        return f"serving the new head failed: {eagle['error']}"
    if not eagle["levels"][low].get("drafts"):
        return f"the speculative server reported no drafts: is the head loaded? see {ctx.run.log_path('server-eagle3')}"
    if "eagle3" in failures:
        ties = eagle.get("numeric_ties", 0)
        beyond = f" beyond {ties} near-tie(s) of the target's own" if ties else ""
        return (f"outputs with and without the new head differ for {len(failures['eagle3'])}/{prompts} prompts "
                f"(first: {failures['eagle3'][0]}){beyond}; see {ctx.run.online_result}")
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
            box.free_port(variant, ctx.log.info)
        elif port_in_use(variant.server.host, variant.server.port):  # a listener this user cannot see
            return _one_at_a_time(ctx, f"port {variant.server.port} is in use by a process this user cannot see")
        profiles.append(variant)
    return profiles


def _one_at_a_time(ctx: StageContext, why: str) -> list:
    ctx.note(f"{why}: the measured servers start one at a time on port {ctx.profile.server.port}", ctx.log.info)
    return [ctx.profile]


def measure_all(ctx: StageContext, methods: list[str], prompts: list[list[int]], args: dict) -> dict:
    """The matrix: servers started side by side on consecutive ports (as many as evaluate.start_together
    asks and the GPUs' memory allows), so their starts overlap; then measured one at a time while the
    others idle; then stopped."""
    count, why = box.side_by_side(ctx.profile, min(ctx.profile.evaluate.start_together, len(methods)))
    ctx.log.info("servers: %s", why)
    if count < min(ctx.profile.evaluate.start_together, len(methods)):
        ctx.note(why)
    matrix: dict = {}
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
                box.free_ports([p for _, p in group], ctx.log.info)
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


def decide(eagle: dict | None, baseline_c: int, threshold: float) -> Decision:
    if not eagle or eagle.get("error") or not level_of(eagle, baseline_c):
        return Decision(False, "the new head was not measured")
    speedup = level_of(eagle, baseline_c).get("speedup")
    if speedup is None:
        return Decision(False, "no speedup measured")
    deploy = speedup >= threshold
    # Three decimals: at two, x1.098 against x1.10 would read "x1.10 (threshold x1.10)".
    return Decision(deploy, f"speedup x{speedup:.3f} {'>=' if deploy else '<'} threshold x{threshold:g} "
                            f"at concurrency {baseline_c}")


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
        args = {"eagle3": {"draft_dir": draft}, "existing": {"draft_dir": Path(ev.existing_head)}}
        matrix = measure_all(ctx, list(ev.methods), prompts, args)
        base = matrix["baseline"]
        if base.get("error"):
            raise StageError(f"baseline server failed: {base['error']}")
        low = min(ev.concurrency)
        mismatches: dict[str, list[str]] = {}
        failures: dict[str, list[str]] = {}  # mismatches that are not near-ties of the target's own
        for method, row in matrix.items():
            for c, level in row.get("levels", {}).items():
                b = base["levels"].get(c, {})
                level["speedup"] = (round(level["output_tok_s"] / b["output_tok_s"], 3) if b.get("output_tok_s")
                                    else None)
            if method != "baseline" and low in row.get("levels", {}):
                pairs = zip(base["levels"][low]["outputs"], row["levels"][low]["outputs"], strict=True)
                differ = [i for i, (a, b) in enumerate(pairs) if a != b]
                row["identical_outputs"] = not differ
                if differ:
                    mismatches[method] = [rows[i]["id"] for i in differ]
                    ties = set(numeric_ties(row.get("divergences", []), ev.tie_logprob_gap))
                    row["numeric_ties"] = len(ties)
                    if real := [rows[i]["id"] for i in differ if i not in ties]:
                        failures[method] = real
        baseline_outputs = base["levels"][low]["outputs"]
        for row in matrix.values():
            for level in row.get("levels", {}).values():
                level.pop("outputs", None)
        eagle = matrix.get("eagle3")
        offline_tau = ctx.run.result(EvaluateOfflineResult).tau
        failure = head_failure(ctx, eagle, low, failures, len(prompts))
        # a head that failed its own checks is not deployed, whatever its speed: online.json says so too
        decision = decide(eagle, low, ev.deploy_speedup) if failure is None else Decision(False, failure)
        verdict = {"decision": decision.line, "deploy": decision.deploy, "reason": decision.reason}
        atomicio.atomic_write_json(ctx.run.online_result, {
            "k": ev.k, "prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
            "min_new_tokens": ev.min_new_tokens, "rounds": ev.rounds,
            "concurrency": sorted(ev.concurrency), "matrix": matrix, "mismatches": mismatches,
            "mismatches_beyond_ties": failures, "tie_logprob_gap": ev.tie_logprob_gap,
            "offline_tau": offline_tau, **verdict})
        if failure is not None:
            raise StageError(failure)
        figures = {**verdict, "offline_tau": offline_tau,
                   "baseline_tok_s": base["levels"][low]["output_tok_s"]}
        if eagle is not None:
            lv = eagle["levels"][low]
            figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                           acceptance_per_position=lv["acceptance_per_position"], speedup=lv["speedup"],
                           speculative_tok_s=lv["output_tok_s"], identical_outputs=eagle["identical_outputs"],
                           tokens_per_step=lv["tokens_per_step"],
                           **step_economics(base["levels"][low], lv, ev.deploy_speedup),
                           **streamed_split(base["levels"][low], lv))
            if offline_tau is None:  # the offline evaluator did not compare it with training already
                figures |= diagnose.check_acceptance(ctx, ctx.draft_checkpoint(), lv["acceptance_per_position"],
                                                     "through vLLM", baseline_outputs)
        ngram = matrix.get("ngram", {}).get("levels", {}).get(low, {})
        if ngram.get("mean_acceptance_length") is not None:
            steps = decode_steps(ngram["output_tokens"] - len(prompts), ngram["accepted"], ngram["drafts"])
            figures.update(ngram_tau=ngram["mean_acceptance_length"], ngram_tokens_per_step=ngram["tokens_per_step"],
                           ngram_draft_share=round(ngram["drafts"] / steps, 4) if steps > 0 else 1.0)
        return DeployMeasureResult.of(figures)


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
