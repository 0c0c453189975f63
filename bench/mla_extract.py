"""vLLM extraction vs the transformers backend on a Kimi-class (MLA + MoE) target, in one run: both
backends extract the same prepared rows of a finished run through the pipeline's own extract stage
(copies of the run, `--from extract --until extract`), then the files are compared.

    .venv/bin/python bench/mla_extract.py --run-dir RUN     # a finished demo-mla (or demo-kimi) run

Prints samples/s and tokens/s per backend (vLLM: generate-offline-data against a ready server, the
server start printed apart), their ratio, and max |Δ| of the hidden states per layer id (fp32).
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


def extract_copy(run_dir: Path, work: Path, backend: str):
    """The extract stage again with `backend`, in a new run copied from the finished one (`run --copy-of`)."""
    from pipeline.layout.rundir import RunDir

    copy = work / backend
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "--copy-of", str(run_dir), "--run-dir", str(copy),
                           "--from", "extract", "--until", "extract", "--no-tui",
                           "--set", f'extract.backend="{backend}"'],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{backend} extraction failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    run = RunDir.open(copy)
    entry = run.stage_state("extract")
    if entry["figures"].get("backend", "transformers") != backend:
        sys.exit(f"{copy}: extract ran with {entry['figures'].get('backend')}, not {backend}")
    return run, entry["figures"], entry.get("seconds") or 0.0


def compare(a_run, b_run, n: int, layer_ids: list[int]) -> list[float]:
    import torch
    from safetensors.torch import load_file

    worst = [0.0] * len(layer_ids)
    for i in range(n):
        a = load_file(str(a_run.hidden_states_dir / f"hs_{i}.safetensors"))
        b = load_file(str(b_run.hidden_states_dir / f"hs_{i}.safetensors"))
        assert torch.equal(a["token_ids"], b["token_ids"]), f"token ids differ in hs_{i}"
        diff = (a["hidden_states"].float() - b["hidden_states"].float()).abs().amax(dim=(0, 2))
        worst = [max(w, d) for w, d in zip(worst, diff.tolist(), strict=True)]
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mla-extract-") as tmp:
        work = Path(tmp)
        hf_run, hf, hf_stage = extract_copy(args.run_dir, work, "transformers")
        vl_run, vl, vl_stage = extract_copy(args.run_dir, work, "vllm")
        n, tokens = vl["samples"], vl["tokens"]
        hf_s = hf.get("seconds") or hf_stage
        print(f"rows {n}, tokens {tokens}, layer ids {vl['layer_ids']}")
        print(f"{'backend':<14}{'seconds':>9}{'samples/s':>11}{'tokens/s':>10}  note")
        print(f"{'transformers':<14}{hf_s:>9.2f}{n / hf_s:>11.1f}{tokens / hf_s:>10.0f}  "
              f"stage {hf_stage:.1f} s (model load included)")
        print(f"{'vllm':<14}{vl['seconds']:>9.2f}{n / vl['seconds']:>11.1f}{tokens / vl['seconds']:>10.0f}  "
              f"generate-offline-data (CLI start-up included); server start {vl['server_start_s']} s apart")
        print(f"ratio vllm / transformers (samples/s): {hf_s / vl['seconds']:.2f}")
        worst = compare(vl_run, hf_run, n, vl["layer_ids"])
        print("max |vLLM - transformers| per layer id: " + ", ".join(
            f"{i}: {w:.2e}" for i, w in zip(vl["layer_ids"], worst, strict=True)))


if __name__ == "__main__":
    main()
