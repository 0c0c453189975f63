"""Does a connector save what the engine's stream wrote last? (pipeline/compat/vllm_hidden_states_connector.py)
The staged connector gathers a request's states on its own copy stream; that stream must wait for the
engine's default stream, or it copies states the forward has not written yet. Per row this queues a long GPU
sleep and then `kv.fill_(row)` on the default stream, submits the request without a synchronize (the
engine's way: the copy is ordered on the GPU, not by the host), and reads every saved file back: each must
hold only its row's value. Prints, per connector, the rows whose file held anything else (0 is right);
`--control` adds the staged connector with its copy stream's wait taken out, which must show stale rows.

    python bench/gpu/connector_order.py [--rows 24] [--sleep-ms 20] [--control]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--control", action="store_true")
    a = ap.parse_args()
    import torch
    from connector_path import make  # beside this script
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        PendingSave,
    )

    from pipeline.compat.vllm_hidden_states_connector import StagedHiddenStatesConnector
    block, layers, hidden = 16, 4, 1024
    kv = torch.zeros((a.tokens // block + 8, block, layers, hidden), dtype=torch.bfloat16, device="cuda")
    torch.cuda._sleep(10**8)  # cycles per ms, as connector_path.py measures them
    t = torch.cuda.Event(enable_timing=True)
    u = torch.cuda.Event(enable_timing=True)
    t.record()
    torch.cuda._sleep(10**8)
    u.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10**8 / t.elapsed_time(u)
    opts = argparse.Namespace(threads=4, slabs=4, tokens=a.tokens)
    class Unordered(StagedHiddenStatesConnector):  # the negative control: no wait for the default stream
        def _get_copy_stream(self):
            stream = super()._get_copy_stream()
            stream.wait_stream = lambda other: None
            return stream

    kinds = [("stock", ExampleHiddenStatesConnector), ("staged", StagedHiddenStatesConnector)]
    for name, cls in kinds + ([("no-wait", Unordered)] if a.control else []):
        c = make(cls, kv, opts)
        with tempfile.TemporaryDirectory() as out:
            for i in range(a.rows):
                torch.cuda._sleep(int(a.sleep_ms * cycles_per_ms))  # a forward still running ...
                kv.fill_(i + 1)  # ... that writes the states this request saves
                ids = list(range(a.tokens // block))
                c._submit_async_write(PendingSave(f"r{i}", str(Path(out) / f"hs_{i}.safetensors"),
                                                  torch.zeros(a.tokens, dtype=torch.long), ids))
            for f in list(c._req_futures.values()):
                f.result()
            c._executor.shutdown(wait=True)
            wrong = [i for i in range(a.rows)
                     if not bool((load_file(str(Path(out) / f"hs_{i}.safetensors"))["hidden_states"] == i + 1).all())]
        print(f"{name:7s} rows {a.rows}, each after a {a.sleep_ms} ms GPU sleep: rows saved stale {wrong or 0}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
