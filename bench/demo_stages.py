"""Demo benchmark: per-stage wall times of a demo run, and the transformers extraction backend's
throughput against a bare forward pass of the same model over the same batches (ratio, one run).

    .venv/bin/python bench/demo_stages.py                 # runs the demo first
    .venv/bin/python bench/demo_stages.py --run-dir DIR   # reuses a finished run
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stage_times(run) -> None:
    import json

    state = run.read_state()
    total = 0.0
    print(f"{'stage':<18}{'seconds':>10}  key figures")
    for name, entry in state["stages"].items():
        secs = entry.get("seconds") or 0.0
        total += secs
        print(f"{name:<18}{secs:>10.2f}  {_key_figures(name, entry.get('figures') or {})}")
    print(f"{'sum of stages':<18}{total:>10.2f}")
    events = [json.loads(line) for line in run.events_path.read_text().splitlines() if line.strip()]
    starts = [e for e in events if e.get("kind") == "server"]
    if events:
        print(f"{'run wall clock':<18}{events[-1]['t'] - events[0]['t']:>10.2f}  first event to last")
    for e in starts:
        print(f"  server {e.get('method') or e.get('mode'):<10} port {e['port']}: up in {e['start_s']} s")


KEY_FIGURES = {"build-target": ("corpus_steps", "corpus_loss_last", "cached"),
               "regenerate": ("rows", "answer_distinct_tokens", "answer_repeated_trigram_share"),
               "train": ("epochs", "tokens_per_s"),
               "evaluate-offline": ("tau", "ngram_tau", "ngram_tokens_per_step"),
               "deploy-measure": ("mean_acceptance_length", "tokens_per_step", "speedup", "break_even_tau")}


def _key_figures(stage: str, figures: dict) -> str:
    return ", ".join(f"{k}={figures[k]}" for k in KEY_FIGURES.get(stage, ()) if k in figures)


def extraction_ratio(run, repeats: int) -> None:
    import torch
    from datasets import load_from_disk

    from pipeline.data import target
    from pipeline.stages.extract import extract, plan_batches

    profile = run.profile()
    tdir = run.stage_state("build-target")["figures"]["target_dir"] if profile.target.source == "demo" \
        else profile.target.model_path
    model = target.load_model(tdir, profile.target.dtype)
    ds = load_from_disk(str(run.prepared_dir)).with_format(None)
    ex = profile.extract
    lengths = dict(enumerate(ds["seq_len"]))
    batches = plan_batches(lengths, ex.batch_size, ex.batch_tokens)
    rows = ds["input_ids"]
    tokens = sum(lengths.values())
    layer_ids = target.resolve_layer_ids(ex.layer_ids, target.num_layers(model))

    @torch.no_grad()
    def bare() -> float:
        t0 = time.perf_counter()
        for batch in batches:
            width = max(lengths[i] for i in batch)
            ids = torch.tensor([rows[i] + [0] * (width - lengths[i]) for i in batch])
            mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in batch])
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        return time.perf_counter() - t0

    def pipeline_extract() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            extract(model, ds, Path(tmp), layer_ids, ex.batch_size, ex.batch_tokens, ex.writer_threads)
            return time.perf_counter() - t0

    bare(), pipeline_extract()  # warm-up
    b, e = [], []
    for _ in range(repeats):  # interleaved so both see the same machine state
        b.append(bare())
        e.append(pipeline_extract())
    tb, te = statistics.median(b), statistics.median(e)
    print(f"\nextraction over {len(ds)} samples / {tokens} tokens, layer ids {layer_ids}, "
          f"batch {ex.batch_size}, {ex.writer_threads} writer threads, median of {repeats}")
    print(f"  bare forward           {tokens / tb:>10.0f} tok/s")
    print(f"  transformers backend   {tokens / te:>10.0f} tok/s  (hidden states + safetensors writes)")
    print(f"  ratio backend / bare   {tb / te:>10.3f}")


def main() -> int:
    from pipeline.layout.rundir import RunDir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = ROOT / "runs" / f"bench-demo-{int(time.time())}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pipeline", "run", "demo", "--no-tui", "--run-dir", str(run_dir)],
                       cwd=ROOT, check=True)
        print(f"\ndemo wall clock (process): {time.perf_counter() - t0:.1f} s")
    run = RunDir.open(run_dir)
    stage_times(run)
    extraction_ratio(run, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
