"""Where a served request's time goes, with the run's head and without it (issue 24): the first token's wait
and the decode after it, at the lengths the run's prompts answer with and at a fixed long decode
(`ignore_eos`, vLLM's own benchmark's way to hold the output length), plus the lines of each server's log
that say how it runs (CUDA graphs, asynchronous scheduling, the attention backend).

    python bench/gpu/decode_steps.py RUN_DIR DRAFT_DIR [--tokens 128] [--concurrency 1 8]

Servers are started and stopped through the pipeline's own controller (`eagle3-console server start`), on
the run's port, one at a time. Prints one line per (server, length, concurrency) and a ratio line."""
from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.data import conversations, target  # noqa: E402
from pipeline.layout.rundir import RunDir  # noqa: E402
from pipeline.serving import client  # noqa: E402
from pipeline.serving.client import in_threads  # noqa: E402
from pipeline.stages.base import StageContext  # noqa: E402

LOG_LINES = re.compile(r"cuda ?graph|Asynchronous scheduling|attention backend|Using .*backend|"
                       r"speculative|drafter|Capturing|compile", re.IGNORECASE)


def cli(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"eagle3-console {' '.join(argv)}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return out.stdout


def measure(base_url: str, prompts: list[list[int]], tokens: int, concurrency: int, ignore_eos: bool) -> dict:
    extra = {"ignore_eos": True} if ignore_eos else None
    before = client.scrape(base_url)
    results = in_threads(lambda ids: client.stream_complete(base_url, "target", ids, tokens, {}, extra=extra),
                         prompts, concurrency)
    spec = client.scrape(base_url) - before
    n = [len(r["token_ids"]) for r in results]
    figures = client.stream_figures(results)
    return {"tokens_mean": round(sum(n) / len(n), 1),
            **{k: figures[k] for k in ("ttft_ms", "decode_tpot_ms", "chunk_ms")},
            "request_ms": round(1000 * sum(r["seconds"] for r in results) / len(results), 3),
            "tok_s": round(sum(n) / sum(r["seconds"] for r in results) * concurrency, 1),
            "tau": round(spec.mean_acceptance_length, 3) if spec.drafts else None}


def found(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if not match:
        sys.exit(f"no {pattern!r} in the controller's answer: {text.strip()[-200:]}")
    return match.group(1)


def ratio(baseline: dict, head: dict, key: str) -> float | None:
    return round(baseline[key] / head[key], 3) if baseline[key] and head[key] else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    run = RunDir.open(args.run_dir)
    ctx = StageContext(run, run.profile(), logging.getLogger("decode_steps"))
    prompts = conversations.prompt_ids(target.load_tokenizer(ctx.target_dir()), ctx.heldout_rows())[: args.prompts]
    rows: dict = {}
    for mode in ("speculative", "baseline"):
        cli("server", "stop", "--run-dir", str(run.root))
        start = ["server", "start", "--run-dir", str(run.root), "--mode", mode]
        text = cli(*start, *(["--draft", str(args.draft)] if mode == "speculative" else []))
        base_url = found(r"(http://[0-9.:]+)", text)
        client.complete(base_url, "target", prompts[0], 4, {})  # warm-up
        for ignore_eos in (False, True):
            for c in args.concurrency:
                r = measure(base_url, prompts, args.tokens, c, ignore_eos)
                rows[(mode, ignore_eos, c)] = r
                print(mode, "fixed" if ignore_eos else "own", f"c={c}", r, flush=True)
        log = Path(found(r"log (\S+)", text))
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if LOG_LINES.search(ln)]
        print(f"# {mode} log ({log.name}):", *(ln[-220:] for ln in lines[-14:]), sep="\n#   ")
        cli("server", "stop", "--run-dir", str(run.root))
    for ignore_eos in (False, True):
        for c in args.concurrency:
            s, b = rows[("speculative", ignore_eos, c)], rows[("baseline", ignore_eos, c)]
            print(f"ratio {'fixed' if ignore_eos else 'own'} c={c}: request x{ratio(b, s, 'request_ms')} "
                  f"decode x{ratio(b, s, 'decode_tpot_ms')} step {s['chunk_ms']} vs {b['chunk_ms']} ms, "
                  f"ttft {s['ttft_ms']} vs {b['ttft_ms']} ms, tokens {s['tokens_mean']}, tau {s['tau']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
