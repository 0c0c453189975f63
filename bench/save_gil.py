"""How much a hidden-states writer stalls the process that serves (issue 26, item 4).

vLLM's ExampleHiddenStatesConnector writes each request's states with safetensors' save_file from a pool
of threads inside the engine process; vLLM warns that "safetensors < 0.8.0 holds the GIL during
save_file". A GIL held for the length of a 117 MB write (one 2,048-token row × 4 layers × hidden 7168,
bf16) stops the engine's own Python — the scheduler that feeds the GPU — for as long. This measures it
with the installed safetensors (run it once per version, e.g. PYTHONPATH=DIR with another one):

    python bench/save_gil.py [--files 8] [--threads 4] [--tokens 2048] [--hidden 7168] [--dir /tmp]

It prints the main thread's loop rate alone and while the writers run (the ratio is the share of the
main thread's time the writes leave it), and the writes' own MB/s.
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors
import torch
from safetensors.torch import save_file


def spin(stop: threading.Event) -> int:
    """Pure-Python work standing for the engine's scheduler loop: iterations until `stop`."""
    n = 0
    while not stop.is_set():
        n += 1
    return n


def loops_per_s(seconds: float) -> float:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    t0 = time.perf_counter()
    n = spin(stop)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    a = ap.parse_args()
    states = torch.randn(a.tokens, a.layers, a.hidden).to(torch.bfloat16)
    ids = torch.arange(a.tokens)
    mb = states.numel() * 2 / 1e6
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        alone = loops_per_s(1.0)
        stop = threading.Event()
        counted: list[int] = []
        main_loop = threading.Thread(target=lambda: counted.append(spin(stop)))
        t0 = time.perf_counter()
        main_loop.start()
        with ThreadPoolExecutor(a.threads) as pool:
            list(pool.map(lambda i: save_file({"hidden_states": states, "token_ids": ids}, f"{tmp}/hs_{i}.safetensors"),
                          range(a.files)))
        stop.set()
        main_loop.join()
        seconds = time.perf_counter() - t0
    during = counted[0] / seconds
    print(f"safetensors {safetensors.__version__}: {a.files} files of {mb:.0f} MB by {a.threads} threads in "
          f"{seconds:.2f} s ({a.files * mb / seconds:.0f} MB/s); the main thread's loop {during / alone:.2f} of its "
          f"rate alone ({alone / 1e6:.1f} M/s alone, {during / 1e6:.1f} M/s during the writes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
