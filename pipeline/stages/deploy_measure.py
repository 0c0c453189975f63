"""deploy-measure: the benchmark matrix through real vLLM. For each method of the profile — baseline
(no speculation), ngram (prompt lookup), existing (a head named in the profile), eagle3 (the head this
run trained) — one server at a time serves the held-out prompts greedily at each concurrency level:
output tokens/s, time per output token, and from /metrics (two scrapes) the mean acceptance length
1 + Δaccepted/Δdrafts and the per-position acceptance; speedup against the baseline at the same
concurrency. Outputs with speculation must equal the baseline's (checked at the lowest concurrency); for
the new head a mismatch fails the stage. A method vLLM refuses becomes a row that says why."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from pipeline import atomicio, box, conversations, online, target
from pipeline.deploy import publish_draft
from pipeline.server import ServerError, explain_failure
from pipeline.stages.base import Stage, StageContext, StageError

MODE = {"baseline": "baseline", "ngram": "ngram", "existing": "speculative", "eagle3": "speculative"}


def send_all(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
             on_done=lambda n: None) -> dict:
    """All prompts at `concurrency` requests in flight; outputs in prompt order."""
    headers: dict = {}  # the measured servers are internal, loopback and keyless (vllm_modes.server_env)
    done = [0]

    def one(ids):
        out = online.complete(base_url, model, ids, max_tokens, headers)
        done[0] += 1
        on_done(done[0])
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    per_token = [r["seconds"] / r["completion_tokens"] for r in results if r["completion_tokens"]]
    return {"outputs": [r["token_ids"] for r in results], "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 2) if seconds else 0.0,
            "tpot_ms": round(1000 * sum(per_token) / len(per_token), 3) if per_token else None}


def measure_method(ctx: StageContext, stage: str, method: str, prompts: list[list[int]], **mode_args) -> dict:
    p = ctx.profile
    mode = MODE[method]
    t0 = time.perf_counter()
    try:
        rec = box.start_mode(p, mode, ctx.target_dir(), ctx.run.log_path(f"server-{method}"),
                             ctx.run.cache_root, ctx.log.info, **mode_args)
    except ServerError as exc:
        box.free_port(p, ctx.log.info)
        return {"method": method, "error": str(exc)}
    row: dict = {"method": method, "server_start_s": round(time.perf_counter() - t0, 1), "levels": {}}
    ctx.emit("server", stage, mode=mode, method=method, pid=rec.pid, port=rec.port, start_s=row["server_start_s"])
    try:
        online.complete(rec.base_url, p.server.served_model_name, prompts[0], 4, {})  # warm-up
        for c in sorted(p.evaluate.concurrency):
            before = online.scrape(rec.base_url)
            level = send_all(rec.base_url, p.server.served_model_name, prompts, p.evaluate.max_new_tokens, c,
                             on_done=partial(ctx.progress, stage, total=len(prompts),
                                             unit=f"prompts ({method}, c={c})"))
            spec = online.scrape(rec.base_url) - before
            if spec.drafts:
                level.update(mean_acceptance_length=round(spec.mean_acceptance_length, 4),
                             acceptance_rate=round(spec.acceptance_rate, 4),
                             acceptance_per_position=[round(x, 4) for x in spec.per_position_rate()],
                             drafts=spec.drafts, accepted=spec.accepted)
            row["levels"][c] = level
    except Exception as exc:  # noqa: BLE001 - a method that fails mid-way is a row, not a crash
        row["error"] = explain_failure(rec, f"{type(exc).__name__}: {exc}")
    finally:
        box.free_port(p, ctx.log.info)
    return row


def decide(eagle: dict | None, baseline_c: int, threshold: float) -> str:
    if not eagle or eagle.get("error") or baseline_c not in eagle.get("levels", {}):
        return "do not deploy: the new head was not measured"
    speedup = eagle["levels"][baseline_c].get("speedup")
    if speedup is None:
        return "do not deploy: no speedup measured"
    verdict, relation = ("deploy", ">=") if speedup >= threshold else ("do not deploy", "<")
    # Three decimals: at two, x1.098 against x1.10 would read "x1.10 (threshold x1.10)".
    return f"{verdict}: speedup x{speedup:.3f} {relation} threshold x{threshold:g} at concurrency {baseline_c}"


class DeployMeasure(Stage):
    name = "deploy-measure"

    def applies(self, profile) -> bool:
        return profile.evaluate.online

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.heldout_prompts]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.run.online_result, ctx.run.draft_dir / "config.json"]

    def run(self, ctx: StageContext) -> dict:
        ev = ctx.profile.evaluate
        tok = target.load_tokenizer(ctx.target_dir())
        rows = [json.loads(line) for line in ctx.run.heldout_prompts.read_text().splitlines()
                if line.strip()][: ev.num_prompts]
        if not rows:
            raise StageError(f"{ctx.run.heldout_prompts}: no held-out prompts")
        prompts = [conversations.render_ids(tok, r["messages"], add_generation_prompt=True) for r in rows]
        draft = publish_draft(ctx.draft_checkpoint(), ctx.run.draft_dir, ctx.target_dir())
        args = {"eagle3": {"draft_dir": draft}, "existing": {"draft_dir": Path(ev.existing_head)}}
        matrix = {m: measure_method(ctx, self.name, m, prompts, **args.get(m, {})) for m in ev.methods}
        base = matrix["baseline"]
        if base.get("error"):
            raise StageError(f"baseline server failed: {base['error']}")
        low = min(ev.concurrency)
        mismatches: dict[str, list[str]] = {}
        for method, row in matrix.items():
            for c, level in row.get("levels", {}).items():
                b = base["levels"].get(c, {})
                level["speedup"] = (round(level["output_tok_s"] / b["output_tok_s"], 3) if b.get("output_tok_s")
                                    else None)
            if method != "baseline" and low in row.get("levels", {}):
                pairs = zip(base["levels"][low]["outputs"], row["levels"][low]["outputs"], strict=True)
                diff = [rows[i]["id"] for i, (a, b) in enumerate(pairs) if a != b]
                row["identical_outputs"] = not diff
                if diff:
                    mismatches[method] = diff
        for row in matrix.values():
            for level in row.get("levels", {}).values():
                level.pop("outputs", None)
        eagle = matrix.get("eagle3")
        offline_tau = ctx.offline_tau()
        result = {"k": ev.k, "prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
                  "concurrency": sorted(ev.concurrency), "matrix": matrix, "mismatches": mismatches,
                  "offline_tau": offline_tau, "decision": decide(eagle, low, ev.deploy_speedup)}
        atomicio.atomic_write_json(ctx.run.online_result, result)
        if eagle is not None:
            if eagle.get("error"):
                raise StageError(f"serving the new head failed: {eagle['error']}")
            if not eagle["levels"][low].get("drafts"):
                raise StageError("the speculative server reported no drafts: is the head loaded? "
                                 f"see {ctx.run.log_path('server-eagle3')}")
            if "eagle3" in mismatches:
                raise StageError(f"outputs with and without the new head differ for {len(mismatches['eagle3'])}/"
                                 f"{len(prompts)} prompts (first: {mismatches['eagle3'][0]}); "
                                 f"see {ctx.run.online_result}")
        figures = {"decision": result["decision"], "offline_tau": offline_tau,
                   "baseline_tok_s": base["levels"][low]["output_tok_s"]}
        if eagle is not None:
            lv = eagle["levels"][low]
            figures.update(mean_acceptance_length=lv["mean_acceptance_length"],
                           acceptance_per_position=lv["acceptance_per_position"], speedup=lv["speedup"],
                           speculative_tok_s=lv["output_tok_s"], identical_outputs=eagle["identical_outputs"])
        ngram = matrix.get("ngram", {})
        if ngram.get("levels", {}).get(low, {}).get("mean_acceptance_length") is not None:
            figures["ngram_tau"] = ngram["levels"][low]["mean_acceptance_length"]
        return figures
