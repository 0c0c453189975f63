"""The CPU demo over several training seeds: τ of the deployed head (the best checkpoint, pick-checkpoint),
τ per epoch, how often the last epoch was not the best, and the head against n-gram's tokens per step —
the spread a newcomer can expect, side by side in one table (NOTES.md "The demo").

    .venv/bin/python bench/demo_seeds.py                # seeds 0..4, the demo without its vLLM servers
    .venv/bin/python bench/demo_seeds.py --seeds 0 1 2 3 4 5 6 7 --work DIR

The target is built once (cached by its spec); each seed trains the draft again (train.seed), from the
same regenerated conversations, and is measured offline (evaluate-offline replays vLLM's n-gram proposer).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ('extract.backend="transformers"', "evaluate.online=false", 'evaluate.checkpoints="each"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_seed(work: Path, seed: int) -> dict:
    run_dir = work / f"seed-{seed}"
    sets = [*OFFLINE, f"train.seed={seed}", f'run.cache_dir="{work / "cache"}"', f"server.port={free_port()}"]
    args = [sys.executable, "-m", "pipeline", "run", "demo", "--no-tui", "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    proc = subprocess.run(args + [a for s in sets for a in ("--set", s)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: the demo failed: {proc.stdout[-800:]}{proc.stderr[-800:]}")
    offline = json.loads((run_dir / "eval" / "offline.json").read_text())
    picked = json.loads((run_dir / "eval" / "checkpoints.json").read_text())
    taus = [e["tau"] for e in picked["checkpoints"]]
    return {"seed": seed, "seconds": round(time.monotonic() - t0, 1), "tau": offline["tau"],
            "per_position": offline["acceptance_per_position"], "ngram": offline["ngram"]["tokens_per_step"],
            "taus": taus, "chosen": picked["chosen"]["label"], "last_best": picked["chosen"]["label"] ==
            picked["checkpoints"][-1]["label"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--work", type=Path, default=None, help="runs and the target cache (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="demo-seeds-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'seed':>4} {'τ':>6}  {'per position':<18} {'n-gram':>6} {'head/ngram':>10}  {'best':>4}  "
          f"τ per epoch{'':<30} seconds", flush=True)
    for seed in args.seeds:
        r = run_seed(work, seed)
        rows.append(r)
        pos = " / ".join(f"{a:.2f}" for a in r["per_position"])
        print(f"{r['seed']:>4} {r['tau']:>6.3f}  {pos:<18} {r['ngram']:>6.3f} {r['tau'] / r['ngram']:>9.2f}x  "
              f"{r['chosen']:>4}  {' '.join(f'{t:.2f}' for t in r['taus']):<41} {r['seconds']}", flush=True)
    taus = [r["tau"] for r in rows]
    ratios = [r["tau"] / r["ngram"] for r in rows]
    print(f"τ: min {min(taus):.3f}, median {statistics.median(taus):.3f}, max {max(taus):.3f}; head / n-gram tokens "
          f"per step: min x{min(ratios):.2f}, max x{max(ratios):.2f}; the last epoch was not the best in "
          f"{sum(not r['last_best'] for r in rows)} of {len(rows)} seeds")
    (work / "demo-seeds.json").write_text(json.dumps(rows, indent=1))
    print(f"rows: {work / 'demo-seeds.json'}")


if __name__ == "__main__":
    main()
