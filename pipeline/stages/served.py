"""A served method measured: the held-out prompts at each evaluate.concurrency through one vLLM server, with
its own speculation counters (deploy-measure's matrix rows, production before and after the run)."""
from __future__ import annotations

from functools import partial

from pipeline.serving import client
from pipeline.serving.client import send_all
from pipeline.serving.server import explain_failure
from pipeline.stages.base import StageContext, first_difference


def measure_served(ctx: StageContext, method: str, rec, start_s: float, prompts: list[list[int]],
                   reference: list[list[int]] | None = None, headers: dict | None = None,
                   sources: list[str] | None = None) -> dict:
    """One method's row; with the baseline's outputs (`reference`), every output that differs at the lowest
    concurrency is located and the target's own margin there asked of this server (`divergences`).
    `headers`: production's key (measure-production, handover). `sources`: each prompt's source in a mix: a
    head's τ per source (per_source)."""
    p = ctx.profile
    row: dict = {"method": method, "server_start_s": start_s, "levels": {}}
    try:
        client.complete(rec.base_url, p.server.served_model_name, prompts[0], 4, headers or {})  # warm-up
        ev = p.evaluate
        for c in sorted(ev.concurrency):
            sent = round_requests(prompts, c, ev.waves)
            # one wave at this concurrency first, not measured: over three GPU runs (bench/results, 2026-12-06/07)
            # a level's first round at c >= 8 was its slowest of three in 17 of 30 rows (10 by chance)
            send_all(rec.base_url, p.server.served_model_name, sent[:c], ev.max_new_tokens, c, headers=headers,
                     min_tokens=ev.min_new_tokens)
            rounds = []
            for r in range(ev.rounds):  # each round with its own counters: a level's figures are one round's
                label = f", round {r + 1}/{ev.rounds}" if ev.rounds > 1 else ""
                before = client.scrape(rec.base_url)
                level = send_all(rec.base_url, p.server.served_model_name, sent, ev.max_new_tokens, c,
                                 on_done=partial(ctx.progress, total=len(sent),
                                                 unit=f"prompts ({method}, c={c}{label})"),
                                 headers=headers, min_tokens=ev.min_new_tokens)
                level["outputs"] = level["outputs"][: len(prompts)]  # a prompt sent again answers the same
                level["requests"] = len(sent)
                spec = client.scrape(rec.base_url) - before
                if spec.drafts:
                    level.update(mean_acceptance_length=round(spec.mean_acceptance_length, 4),
                                 acceptance_rate=round(spec.acceptance_rate, 4),
                                 acceptance_per_position=[round(x, 4) for x in spec.per_position_rate()],
                                 drafts=spec.drafts, accepted=spec.accepted)
                level["tokens_per_step"] = tokens_per_step(level, len(sent), int(level.get("accepted", 0)),
                                                           int(level.get("drafts", 0)))
                rounds.append(level)
            row["levels"][c] = median_round(rounds)
        if reference is not None:
            row["divergences"] = divergences(rec, p.server.served_model_name, prompts, reference,
                                             row["levels"][min(ev.concurrency)]["outputs"])
        if sources and len(set(sources)) > 1 and row["levels"][min(ev.concurrency)].get("drafts"):
            row["per_source"] = per_source(rec, p.server.served_model_name, prompts, sources, ev, headers)
    except Exception as exc:  # noqa: BLE001 - a method that fails mid-way is a row, not a crash
        row["error"] = explain_failure(rec, f"{type(exc).__name__}: {exc}")
    return row


def per_source(rec, model: str, prompts: list[list[int]], sources: list[str], ev, headers: dict | None) -> dict:
    """τ and per-position acceptance of each source's prompts: vLLM's /metrics count the server, not a request,
    so each source is sent alone (at the highest concurrency: acceptance does not depend on the batch under
    greedy decoding) between two scrapes."""
    out = {}
    for src in sorted(set(sources)):
        mine = [pr for pr, s in zip(prompts, sources, strict=True) if s == src]
        before = client.scrape(rec.base_url)
        send_all(rec.base_url, model, mine, ev.max_new_tokens, min(max(ev.concurrency), len(mine)),
                 headers=headers, min_tokens=ev.min_new_tokens)
        spec = client.scrape(rec.base_url) - before
        out[src] = {"prompts": len(mine), "tau": round(spec.mean_acceptance_length, 4) if spec.drafts else None,
                    "acceptance_per_position": [round(x, 4) for x in spec.per_position_rate()] if spec.drafts else []}
    return out


def round_requests(prompts: list[list[int]], concurrency: int, waves: int) -> list[list[int]]:
    """A round's requests: the prompts, cycled until `waves` × `concurrency` are sent. A round of one wave
    lasts as long as its slowest answer (32 requests at c = 32 took ≈ 0.4 s on one H200, rounds of one server
    spread 7.4k–10.5k tok/s); three waves measure the server rather than its stragglers."""
    need = max(len(prompts), waves * concurrency)
    return [prompts[i % len(prompts)] for i in range(need)]


def median_round(rounds: list[dict]) -> dict:
    """The round of median tok/s (the lower middle of an even count), the others' tok/s beside it: a level's
    figures are one round's, all consistent with each other, and the spread says how far to trust them."""
    if len(rounds) == 1:
        return rounds[0]
    ranked = sorted(rounds, key=lambda r: r["output_tok_s"])
    level = dict(ranked[(len(ranked) - 1) // 2])
    level["rounds_tok_s"] = [r["output_tok_s"] for r in rounds]
    return level


def divergences(rec, model: str, prompts: list[list[int]], reference: list[list[int]],
                outputs: list[list[int]]) -> list[dict]:
    """Where each output leaves the baseline's, the two tokens, and the target's logprob gap between them
    at that position (asked with the common prefix): a gap within bf16 rounding says numerics (the verify
    step's batch shape differs from a plain decode step's), a clear one says the serving path is wrong."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        if ref == out:
            continue
        at = first_difference(ref, out)
        entry: dict = {"prompt": i, "position": at, "baseline": ref[at: at + 1], "method": out[at: at + 1]}
        try:  # the two tokens that parted, among the target's top five (its end of text may be first where
            # evaluate.min_new_tokens held it back; vLLM's logprobs are the raw model's)
            top = dict(client.top_logprobs(rec.base_url, model, prompts[i] + ref[:at], {}, n=5))
            pair = (top.get(ref[at]) if at < len(ref) else None, top.get(out[at]) if at < len(out) else None)
            if pair[0] is not None and pair[1] is not None:
                entry["gap"] = round(abs(pair[0] - pair[1]), 4)
            else:  # one answer ended there, or a token outside the top five: the target's own top two
                best = sorted(top.values(), reverse=True)
                entry["gap"] = round(best[0] - best[1], 4) if len(best) > 1 else None
        except Exception as exc:  # noqa: BLE001 - an unanswered question leaves the mismatch a failure
            entry["gap"], entry["why"] = None, f"{type(exc).__name__}: {exc}"
        found.append(entry)
    return found


def tokens_per_step(level: dict, requests: int, accepted: int, drafts: int = 0) -> float:
    """Output tokens per target forward after the prefill: each decode step of a request yields its
    accepted draft tokens plus one. It is τ for a method that drafts at every step (EAGLE-3); for
    n-gram, whose τ counts only the steps where it found a match, it is what the speed sees. The steps
    are counted from below twice: decoded − accepted (vLLM also counts drafts accepted past the end of an
    answer, which the answer never keeps: a few per request, many on short answers — the H200 run's
    12-token answers gave 87 steps where 133 drafted) and the drafts (one per step at most); the larger
    is kept. evaluate-offline's replay counts the steps themselves."""
    decoded = level["output_tokens"] - requests  # the first token of each request comes from its prefill
    steps = decode_steps(decoded, accepted, drafts)
    return round(decoded / steps, 4) if steps > 0 else 1.0


def decode_steps(decoded: int, accepted: int, drafts: int) -> int:
    """The decode steps behind `decoded` tokens: the larger of its two lower bounds (tokens_per_step)."""
    return max(decoded - accepted, drafts)
