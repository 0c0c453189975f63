"""Online against offline training, side by side in one invocation: the train stage of a finished run
again through the pipeline's own runner — offline on the run's extracted states, then online with them
deleted (the extraction server generates each sample while the draft trains) at each
train.requests_per_worker given (1 = speculators 0.9.0 as released) — each followed by the offline
evaluation. Prints each side's stage time, training tokens/s and its ratio to offline, the trainer's
data-wait share, the generation rate, the states' disk (offline on disk vs online peak in flight) and τ.

    .venv/bin/python bench/online_train.py --run-dir RUN [--requests 1 8] [--work DIR] [--set KEY=VALUE ...]
RUN: a finished run (demo or tiny, any backend). With --work, each side's figures are kept in DIR and a
second invocation runs only the sides still missing (a device call's time limit).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train_once(src: Path, dest: Path, mode: str, requests: int, more: list[str]) -> dict:
    """The train stage (and evaluate-offline) again in `mode`, in a new run copied from the finished one
    (`run --copy-of`): offline from its states; online from extract on, which then extracts nothing
    (extract.cache_gib = 0), so that every state is generated while the draft trains."""
    from pipeline.layout.rundir import RunDir

    sets = [f'extract.mode="{mode}"', 'extract.backend="vllm"', "extract.cache_gib=0.0",
            f"train.requests_per_worker={requests}", *more]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "--copy-of", str(src), "--run-dir", str(dest),
                           "--from", "train" if mode == "offline" else "extract", "--until", "evaluate-offline",
                           "--no-tui", *(a for kv in sets for a in ("--set", kv))],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"train failed in {dest}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    run = RunDir.open(dest)
    entry = run.stage_state("train")
    server = [e for e in run.events() if e["stage"] == "train" and e["kind"] == "server"]
    return {**entry["figures"], "stage_s": entry["seconds"], "train_s": entry.get("train_seconds"),
            "server_start_s": server[-1].get("start_s") if server else None,
            "tau": run.stage_state("evaluate-offline")["figures"]["tau"]}


ROWS = (("train stage seconds", "stage_s"), ("  of which the trainer", "train_s"),
        ("  server start seconds", "server_start_s"), ("training tokens/s (median step)", "tokens_per_s"),
        ("data-wait share of the steps", "data_wait_share"), ("generation tokens/s", "generate_tok_s"),
        ("generated tokens", "generated_tokens"), ("states peak in flight (bytes)", "states_disk_peak_bytes"),
        ("final train loss", "train_loss"), ("offline evaluation τ (same seed)", "tau"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8], help="online sides' requests per worker")
    parser.add_argument("--work", type=Path, help="keep each side's figures here (default: a temporary directory)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="for every side (e.g. train.num_workers=4)")
    args = parser.parse_args()
    states = sum(f.stat().st_size for f in (args.run_dir / "data" / "prepared" / "hidden_states").glob("hs_*"))
    sides = [("offline", "offline", 1)] + [(f"online r={r}", "online", r) for r in args.requests]
    with tempfile.TemporaryDirectory(prefix="online-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        figures = {}
        for label, mode, requests in sides:
            kept = work / f"{mode}-{requests}.json"
            if not kept.exists():
                run = work / f"run-{mode}-{requests}"
                shutil.rmtree(run, ignore_errors=True)
                kept.write_text(json.dumps(train_once(args.run_dir, run, mode, requests, args.sets)))
                shutil.rmtree(run, ignore_errors=True)
            figures[label] = json.loads(kept.read_text())
    offline = figures["offline"]
    print(f"run: {args.run_dir}; offline states on disk: {states} bytes; every side: {' '.join(args.sets) or '-'}")
    print(f"{'':<34}" + "".join(f"{label:>14}" for label in figures))
    for label, key in ROWS:
        print(f"{label:<34}" + "".join(f"{str(f.get(key) if f.get(key) is not None else '-'):>14}"
                                       for f in figures.values()))
    print(f"{'online / offline training tok/s':<34}" + "".join(
        f"{f['tokens_per_s'] / offline['tokens_per_s']:>14.3f}" if f.get("tokens_per_s") and
        offline.get("tokens_per_s") else f"{'-':>14}" for f in figures.values()))


if __name__ == "__main__":
    main()
