"""Offline evaluator, batched vs one prompt at a time, side by side on a finished run.

    .venv/bin/python bench/offline_eval.py --run-dir RUN [--k 3] [--max-new-tokens 64]

Prints both timings (speculation and the greedy reference), their ratio, and whether outputs, τ and
per-position acceptance are identical.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data import conversations, target
from pipeline.evaluation import offline_decoding
from pipeline.layout.rundir import RunDir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    run = RunDir.open(a.run_dir)
    tdir = run.stage_state("build-target")["figures"]["target_dir"]
    model, tok = target.load_model(tdir, "float32"), target.load_tokenizer(tdir)
    proposer = offline_decoding.DraftProposer(
        offline_decoding.load_draft(run.stage_state("train")["figures"]["checkpoint"]))
    reader = target.HiddenStateReader(model, proposer.aux_ids)
    eos = offline_decoding.eos_ids(model)
    prompts = [conversations.render_ids(tok, json.loads(line)["messages"], add_generation_prompt=True)
               for line in (run.data_dir / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    t0 = time.perf_counter()
    one = [offline_decoding.speculative_generate_batch(reader, proposer, [p], a.k, a.max_new_tokens, eos)[0]
           for p in prompts]
    t1 = time.perf_counter()
    many = offline_decoding.speculative_generate_batch(reader, proposer, prompts, a.k, a.max_new_tokens, eos)
    t2 = time.perf_counter()
    refs1 = [offline_decoding.greedy_reference_batch(model, [p], a.max_new_tokens, eos)[0] for p in prompts]
    t3 = time.perf_counter()
    refsb = offline_decoding.greedy_reference_batch(model, prompts, a.max_new_tokens, eos)
    t4 = time.perf_counter()
    totals = []
    for results in (one, many):
        total = offline_decoding.SpecStats(k=a.k)
        for _, st in results:
            total.merge(st)
        totals.append(total)
    print(f"{len(prompts)} prompts, k={a.k}, {a.max_new_tokens} new tokens")
    print(f"speculation: one at a time {t1 - t0:.2f} s, batched {t2 - t1:.2f} s -> {(t1 - t0) / (t2 - t1):.1f}x")
    print(f"greedy reference: one at a time {t3 - t2:.2f} s, batched {t4 - t3:.2f} s -> {(t3 - t2) / (t4 - t3):.1f}x")
    print(f"stage work: {t1 - t0 + t3 - t2:.2f} s -> {t2 - t1 + t4 - t3:.2f} s")
    print(f"identical outputs {sum(x[0] == y[0] for x, y in zip(one, many, strict=True))}/{len(prompts)}, "
          f"references {sum(x == y for x, y in zip(refs1, refsb, strict=True))}/{len(prompts)}, "
          f"batched speculation == batched reference "
          f"{sum(x[0] == r for x, r in zip(many, refsb, strict=True))}/{len(prompts)}")
    print(f"tau {totals[0].tau:.4f} vs {totals[1].tau:.4f}; "
          f"acceptance {totals[0].acceptance()} vs {totals[1].acceptance()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
