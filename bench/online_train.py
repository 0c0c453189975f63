"""Online against offline training, side by side in one invocation: the train stage of a finished run
twice through the pipeline's own runner — offline on the run's extracted states, then online with
them deleted (the extraction server generates each sample while the draft trains) — each followed by
the offline evaluation. Prints each side's stage time, training tokens/s and their ratio, where the
online time goes (server start, generation, training), the states' disk (offline on disk vs online
peak in flight) and τ of both heads.

    .venv/bin/python bench/online_train.py --run-dir RUN   # a finished run (demo or tiny, any backend)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train_once(src: Path, dest: Path, mode: str) -> dict:
    """The train stage (and evaluate-offline) again in `mode`, in a new run copied from the finished one
    (`run --copy-of`): offline from its states; online from extract on, which then extracts nothing
    (extract.cache_gib = 0), so that every state is generated while the draft trains."""
    from pipeline.rundir import RunDir

    sets = [f'extract.mode="{mode}"', 'extract.backend="vllm"', "extract.cache_gib=0.0"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args()
    states = sum(f.stat().st_size for f in (args.run_dir / "data" / "prepared" / "hidden_states").glob("hs_*"))
    with tempfile.TemporaryDirectory(prefix="online-bench-") as tmp:
        offline = train_once(args.run_dir, Path(tmp) / "offline", "offline")
        online = train_once(args.run_dir, Path(tmp) / "online", "online")
    ratio = online["tokens_per_s"] / offline["tokens_per_s"] if offline.get("tokens_per_s") else None
    print(f"run: {args.run_dir}")
    print(f"{'':<34}{'offline':>14}{'online':>14}")
    for label, key in (("train stage seconds", "stage_s"), ("  of which the trainer", "train_s"),
                       ("training tokens/s (median step)", "tokens_per_s"), ("final train loss", "train_loss"),
                       ("offline evaluation τ (same seed)", "tau")):
        print(f"{label:<34}{offline.get(key) or '-':>14}{online.get(key) or '-':>14}")
    print(f"{'online: server start seconds':<34}{'':>14}{online.get('server_start_s') or '-':>14}")
    print(f"{'online: generated tokens':<34}{'':>14}{online['generated_tokens']:>14}")
    print(f"{'online: generation tokens/s':<34}{'':>14}{online['generate_tok_s'] or '-':>14}")
    print(f"{'states on disk (bytes)':<34}{states:>14}{online['states_disk_peak_bytes']:>14}")
    print(f"online/offline training tokens/s: {ratio:.3f}" if ratio else "ratio: n/a")
    extra = (online["train_s"] or 0) - (offline["train_s"] or 0)
    print(f"where the online time goes: server start {online.get('server_start_s') or 0:.0f} s, trainer "
          f"{online['train_s']:.0f} s of which ≈ {extra:.0f} s waiting for generated states "
          f"(offline trainer {offline['train_s']:.0f} s)")


if __name__ == "__main__":
    main()
