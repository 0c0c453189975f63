"""Regeneration through the stage against the same requests sent by a bare client to the same server.

    python bench/regenerate_ratio.py PROFILE --work DIR [--concurrency 16 64] [--set KEY=VALUE ...]

For each concurrency: a run of PROFILE up to build-target (its target and conversations), the regenerate
server started through the pipeline's own controller (`ports.start_mode`, as `server start --mode
regenerate`), a bare asyncio client replaying every training conversation turn by turn with the stage's own
request (greedy, the answer cap, the regenerated history), then the stage itself (`run --until regenerate`:
speculators' regenerate-responses), which reuses that server and stops it. Printed side by side: generated
tokens/s of the bare client, of the stage from its client's first request, and of the stage with its
client's start (imports, tokenizer); the ratios. A second bare pass after the stage shows what vLLM's prefix
cache gave the later passes. Results as JSON in --work/regenerate-ratio.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def overrides(pairs: list[str]) -> list[str]:
    return [a for kv in pairs for a in ("--set", kv)]


def cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, text=True, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"eagle3-console {' '.join(args[:2])} failed: {proc.stderr.strip()[-800:]}")
    return proc


async def bare(base_url: str, model: str, convs: list[dict], concurrency: int, seq_length: int,
               sampling: dict) -> dict:
    """Each conversation's user turns in order, the target's answer put back into the history as
    speculators does (an answer's text; earlier thinking stays for the template to strip)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    tokens, requests = [0], [0]

    async def one(session, conv):
        prefix: list[dict] = []
        async with sem:
            for turn in conv["messages"]:
                if turn["role"] == "assistant":
                    continue
                prefix.append({"role": turn["role"], "content": turn["content"]})
                if turn["role"] != "user":
                    continue
                body = {**sampling, "model": model, "messages": prefix, "max_tokens": seq_length,
                        "return_token_ids": True}
                async with session.post(f"{base_url}/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                requests[0] += 1
                tokens[0] += data["usage"]["completion_tokens"]
                prefix.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})
                if data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"] > seq_length:
                    break

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, c) for c in convs))
        seconds = time.perf_counter() - t0
    return {"requests": requests[0], "tokens": tokens[0], "seconds": round(seconds, 2),
            "tok_s": round(tokens[0] / seconds, 1)}


def level(profile_arg: str, work: Path, c: int, sets: list[str], again_pass: bool = True) -> dict:
    from pipeline.compat import vllm_flags
    from pipeline.compat.speculators_rows import unique_ids
    from pipeline.data import conversations
    from pipeline.layout.rundir import RunDir
    from pipeline.serving import ports

    run_dir = work / f"c{c}"
    if not (run_dir / "profile.toml").is_file():
        cli("run", profile_arg, "--no-tui", "--until", "build-target", "--run-dir", str(run_dir),
            *overrides([f"data.regenerate_concurrency={c}", 'data.regenerate_backend="vllm"', *sets]))
    run = RunDir.open(run_dir)
    profile = run.profile()
    target = run.target_dir(profile)
    loaded = conversations.load(run.demo_conversations if profile.data.conversations == "demo"
                                else Path(str(profile.data.conversations)))
    train, _ = conversations.split_heldout(loaded.conversations, profile.data.heldout)
    convs = unique_ids(train)
    t0 = time.perf_counter()
    rec = ports.start_mode(profile, "regenerate", target, log_path=run.log_path("server-regenerate"), say=print)
    start_s = time.perf_counter() - t0
    d = profile.data
    _, sampling = vllm_flags.regenerate_limits(d.seq_length, d.regenerate_max_tokens, d.regenerate_sampling)
    try:
        asyncio.run(bare(rec.base_url, str(target), convs[:8], c, d.seq_length, sampling))  # warm-up
        first = asyncio.run(bare(rec.base_url, str(target), convs, c, d.seq_length, sampling))
        print(f"c={c}: bare client {first}", flush=True)
        t1 = time.perf_counter()
        cli("run", "--resume", str(run_dir), "--no-tui", "--until", "regenerate")
        stage_wall = time.perf_counter() - t1
        figures = run.stage_state("regenerate")["figures"]
        print(f"c={c}: stage {figures}", flush=True)
        again = None
        if again_pass:
            rec = ports.start_mode(profile, "regenerate", target, log_path=run.log_path("server-regenerate"),
                                   say=print)
            again = asyncio.run(bare(rec.base_url, str(target), convs, c, d.seq_length, sampling))
            print(f"c={c}: bare client again {again}", flush=True)
    finally:
        ports.stop_server_on_port(profile, print)
    stage_tok = figures.get("generated_tok_s") or 0.0
    return {"concurrency": c, "conversations": len(convs), "server_start_s": round(start_s, 1), "bare": first,
            "bare_again": again, "stage": {k: figures.get(k) for k in (
                "generated_tokens", "generated_tok_s", "generated_tok_s_with_client_start", "client_start_s",
                "generate_seconds", "rows", "failed_conversations")}, "stage_cli_wall_s": round(stage_wall, 1),
            "ratio": round(stage_tok / first["tok_s"], 3) if first["tok_s"] else None,
            "ratio_with_client_start": round((figures.get("generated_tok_s_with_client_start") or 0) / first["tok_s"],
                                             3) if first["tok_s"] else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--work", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-again", action="store_true", help="skip the second bare pass (one server start less)")
    a = ap.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "regenerate-ratio.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    for c in a.concurrency:
        if str(c) in results:
            continue
        results[str(c)] = level(a.profile, work, c, a.set, again_pass=not a.no_again)
        out.write_text(json.dumps(results, indent=1))
    print(f"{'c':>5} {'bare tok/s':>11} {'stage tok/s':>12} {'ratio':>6} {'with client start':>18} {'ratio':>6} "
          f"{'client start s':>15} {'bare again':>11}")
    for c, r in sorted(results.items(), key=lambda kv: int(kv[0])):
        print(f"{c:>5} {r['bare']['tok_s']:>11,.0f} {r['stage']['generated_tok_s'] or 0:>12,.0f} {r['ratio']:>6} "
              f"{r['stage']['generated_tok_s_with_client_start'] or 0:>18,.0f} {r['ratio_with_client_start']:>6} "
              f"{r['stage']['client_start_s'] or 0:>15} {(r['bare_again'] or {}).get('tok_s', 0):>11,.0f}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
