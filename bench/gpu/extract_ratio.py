"""Extraction through the pipeline's transformers backend (`pipeline.stages.extract.extract`: forward
with hidden states, pre-norm last layer, pinned host staging, safetensors writes in threads) vs a bare
forward pass of the same model over the same batches. Random 8B-class Llama weights in bf16 (fine for
throughput). Runs are interleaved (bare, backend, bare, backend, …); medians and their ratio printed.

    python bench/gpu/extract_ratio.py --out DIR [--samples 64] [--seq 2048] [--batch 8] [--repeats 3]
        [--writer-threads 8] [--small]

DIR receives the hidden-state files (use a fast local disk or a RAM filesystem, as vLLM's docs say for
its own connector); it is emptied between repeats.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import llama_config

from pipeline.data.target import default_layer_ids
from pipeline.stages.extract import extract, plan_batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    from pipeline.stages.prepare import dataset_features

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 1000, "num_hidden_layers": 4} if a.small else {}
    config = llama_config(**sizes)
    t = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"random Llama {params / 1e9:.2f} B params, {dtype}, on {dev}, built in {time.perf_counter() - t:.1f} s",
          flush=True)
    layer_ids = default_layer_ids(config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, config.vocab_size, (a.seq,), generator=g).tolist() for _ in range(a.samples)]
    ds = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * a.seq] * a.samples, "seq_len": [a.seq] * a.samples},
                           features=dataset_features())
    batches = plan_batches(dict(enumerate([a.seq] * a.samples)), a.batch, a.batch * a.seq)
    tokens = a.samples * a.seq

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def bare() -> float:
        sync()
        t0 = time.perf_counter()
        for batch in batches:
            ids = torch.tensor([rows[i] for i in batch], device=dev)
            model(input_ids=ids, use_cache=False).logits.float().sum().item()  # item: the work is done
        sync()
        return time.perf_counter() - t0

    def backend() -> float:
        shutil.rmtree(a.out, ignore_errors=True)
        sync()
        t0 = time.perf_counter()
        figures = extract(model, ds, a.out, layer_ids, a.batch, a.batch * a.seq, a.writer_threads)
        sync()
        assert figures["extracted"] == a.samples, figures
        return time.perf_counter() - t0

    bare()  # warm-up: kernels, allocator
    backend()
    b_times, e_times = [], []
    for _ in range(a.repeats):
        b_times.append(bare())
        e_times.append(backend())
    b, e = statistics.median(b_times), statistics.median(e_times)
    size = sum(f.stat().st_size for f in a.out.glob("hs_*.safetensors"))
    print(f"{a.samples} samples x {a.seq} tokens, batches of {a.batch}, layer ids {layer_ids}, "
          f"{size / 2**30:.2f} GiB of hidden states per pass to {a.out}")
    print(f"bare forward: {tokens / b:,.0f} tok/s (median of {a.repeats}: {[round(x, 2) for x in b_times]} s)")
    print(f"extract backend: {tokens / e:,.0f} tok/s (median of {a.repeats}: {[round(x, 2) for x in e_times]} s)")
    print(f"ratio backend / bare forward: {b / e:.3f}")
    if dev == "cuda":
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    shutil.rmtree(a.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
