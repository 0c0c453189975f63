"""The way hidden states leave vLLM's engine, replayed without a server (issue 26, item 4). Per finished
request, vLLM's connector gathers the request's slots from the hidden-state KV cache, copies them to host
memory on a copy stream and hands `save_file` to its writer threads; what it does on the engine's own thread
stalls the next forward. This drives the real `_submit_async_write` of vLLM's ExampleHiddenStatesConnector
(`stock`) and of pipeline/compat/vllm_hidden_states_connector.py (`staged`) at Kimi's width, one request
after each emulated forward (a GPU sleep of --forward-ms on the default stream, then the engine's
synchronize), and prints per mode and pass: the engine thread's time a request, the ratio of forward time to
wall time (what extraction keeps of a bare prefill; the forwards timed as they ran, the GPU's sleep
being only roughly --forward-ms), and the host bytes' rate until every file is written.

    python bench/gpu/connector_path.py --dirs /tmp/cp-disk /dev/shm/cp [--rows 96] [--tokens 2048]
        [--layers 4] [--hidden 7168] [--forward-ms 28] [--threads 8] [--passes 2]

--forward-ms 28: a 2,048-token row of the 6-layer Kimi slice at its bare prefill (72,793 tok/s,
bench/results/h200/kimi-slice/). Needs vLLM (the connectors are imported from it). The second pass of a
mode runs with torch's pinned-memory cache warm, the first is a short run's warm-up.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def make(cls, kv, a):
    from pipeline.compat.vllm_hidden_states_connector import SlabPool
    c = cls.__new__(cls)  # the worker side only: what register_kv_caches and __init__ would have set
    c._is_tp_rank_zero, c._kv_cache, c._block_size, c._copy_stream = True, kv, kv.shape[1], None
    c._executor, c._lock_fds, c._req_futures, c._req_copy_events = ThreadPoolExecutor(a.threads), {}, {}, {}
    c.use_lock, c._slabs = False, SlabPool(a.slabs, a.tokens, pin=True)
    return c


def run(cls, out: Path, a, kv, torch, cycles_per_ms: float) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import PendingSave
    c = make(cls, kv, a)
    out.mkdir(parents=True, exist_ok=True)
    stalls, forward = [], 0.0
    t0 = time.perf_counter()
    for i in range(a.rows):
        t = time.perf_counter()
        torch.cuda._sleep(int(a.forward_ms * cycles_per_ms))  # the forward that computed the row
        torch.cuda.current_stream().synchronize()  # the engine waits for its sampled tokens each step
        forward += time.perf_counter() - t
        ids = torch.randperm(kv.shape[0])[: a.tokens // kv.shape[1]].tolist()
        pending = PendingSave(f"r{i}", str(out / f"hs_{i}.safetensors"), torch.zeros(a.tokens, dtype=torch.long), ids)
        t = time.perf_counter()
        c._submit_async_write(pending)
        stalls.append(time.perf_counter() - t)
    forwards = time.perf_counter() - t0
    for f in list(c._req_futures.values()):
        f.result()
    c._executor.shutdown(wait=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    nbytes = a.rows * a.tokens * a.layers * a.hidden * kv.element_size()
    slabs = getattr(c, "_slabs", None)
    return {"stall_ms": round(statistics.mean(stalls) * 1e3, 2), "stall_ms_max": round(max(stalls) * 1e3, 1),
            "forward_ms": round(forward / a.rows * 1e3, 1), "kept": round(forward / forwards, 3),
            "kept_to_last_write": round(forward / wall, 3), "write_gb_s": round(nbytes / wall / 1e9, 2),
            "slabs_made": slabs.made, "fresh": slabs.fresh}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", type=Path, nargs="+", required=True)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--forward-ms", type=float, default=28.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--slabs", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    from pipeline.compat.vllm_hidden_states_connector import StagedHiddenStatesConnector
    block = 16
    # vLLM 0.26.0's hidden-state cache view: [blocks, block size, layers, hidden] (0.32: layers before block size)
    kv = torch.randn((a.rows * a.tokens // block + 64, block, a.layers, a.hidden), dtype=torch.bfloat16, device="cuda")
    t = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    cycles_per_ms = 10**8 / ((time.perf_counter() - t) * 1e3)
    print(f"{a.rows} rows × {a.tokens} tokens × {a.layers} × {a.hidden} bf16 "
          f"({a.tokens * a.layers * a.hidden * 2 / 2**20:.0f} MiB a row), a {a.forward_ms} ms forward before each, "
          f"{a.threads} writer threads", flush=True)
    for d in a.dirs:
        for name, cls in (("stock", ExampleHiddenStatesConnector), ("staged", StagedHiddenStatesConnector)):
            for p in range(a.passes):
                r = run(cls, d / f"{name}-{p}", a, kv, torch, cycles_per_ms)
                print(f"{name:6s} {str(d):14s} pass {p + 1}: {r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
