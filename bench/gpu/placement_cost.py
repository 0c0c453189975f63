"""Is an instance's speed its CPU placement? (issue 42 item 4; NOTES.md "Twelve instances of one argv"). Two
servers of one argv land up to ×1.8 apart and each keeps its speed for life. This moves one running server's
processes (API server, engine core, every thread of each) between CPU sets and measures it under each: if the
speed follows the CPUs, placement is the cause and the argv can pin it; if it stays with the instance, the
cause is inside the process or on the GPU, out of the CPUs' reach.

    python bench/gpu/placement_cost.py --tokenizer DIR [--instances 3] [--placements free 2,3 10,11 2 free]

The target: schedule_cost.py's random-weight Llama (`--load-format dummy`), one server at a time. One line per
(instance, placement): c = 1 and c = 8 tok/s (median of the rounds, min–max), where each process ran (psr)."""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_steps import measure  # noqa: E402
from schedule_cost import Clocks, random_target, server_argv  # noqa: E402
from step_cost import SIZES, server_env  # noqa: E402

from pipeline.serving import client  # noqa: E402
from pipeline.serving.server import ServerController, ServerError  # noqa: E402


def cpus(spec: str) -> set[int]:
    """"free" → every CPU this process may use; "2,3" or "2-5" → those."""
    if spec == "free":
        return set(os.sched_getaffinity(0))
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def place(pid: int, spec: str) -> None:
    """Every thread of every process of the server onto `spec`'s CPUs."""
    want = cpus(spec)
    for proc in tree(pid):
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), want)
            except OSError:  # a thread that ended meanwhile
                pass


def where(pid: int) -> str:
    """name:psr of each busy process of the server (the CPU it last ran on)."""
    return " ".join(f"{p.name()[:12]}:{p.cpu_num()}" for p in tree(pid) if p.cpu_times().user > 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--size", default="0.8b", choices=sorted(SIZES))
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--placements", nargs="+", default=["free", "2,3", "10,11", "2", "free"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--port", type=int, default=8812)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("placement_cost: stopped by SIGTERM"))
    gpu, work, target, vocab = random_target(args, "placement-cost-")
    topo = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, check=False)
    print("cpu,core,socket,node: " + " ".join(ln for ln in topo.stdout.splitlines() if not ln.startswith("#")),
          flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(args.prompts)]
    flags = [] if gpu else ["--enforce-eager"]
    table: dict[tuple[int, str], float] = {}
    for i in range(args.instances):
        ctl = ServerController(work / f"server-{i}.json")
        t0 = time.monotonic()
        try:
            rec = ctl.start(server_argv(target, args.port, None, flags), host="127.0.0.1", port=args.port,
                            mode=f"base{i}", log=work / f"server-{i}.log", env=server_env(work, gpu),
                            health_timeout=300)
        except ServerError as exc:
            print(f"instance {i}: did not start: {str(exc)[:600]}", flush=True)
            continue
        try:
            print(f"instance {i}: up in {time.monotonic() - t0:.0f} s", flush=True)
            client.complete(rec.base_url, "target", prompts[0], 4, {})
            for j, spec in enumerate(args.placements):
                place(rec.pid, spec)
                measure(rec.base_url, prompts[:8], 16, 8, ignore_eos=True)  # settle on the new CPUs
                clocks = Clocks()  # over the c = 1 rounds alone: the GPU's busy share at one request
                clocks.start()
                one = [measure(rec.base_url, prompts, args.tokens, 1, ignore_eos=True)["tok_s"]
                       for _ in range(args.rounds)]
                at_one = clocks.summary()
                eight = [measure(rec.base_url, prompts, args.tokens, 8, ignore_eos=True)["tok_s"]
                         for _ in range(args.rounds)]
                table[(i, f"{j}:{spec}")] = statistics.median(one)
                print(f"instance {i} cpus {spec:>6}: c=1 {statistics.median(one):7.1f} ({min(one):.0f}–{max(one):.0f})"
                      f"  c=8 {statistics.median(eight):7.1f} ({min(eight):.0f}–{max(eight):.0f})  "
                      f"c=1: {at_one}  ran on {where(rec.pid)}", flush=True)
        finally:
            ctl.stop(grace=10)
    for i in sorted({i for i, _ in table}):
        row = {p: v for (n, p), v in table.items() if n == i}
        print(f"instance {i} c=1 by placement: " + ", ".join(f"{p} {v:.0f}" for p, v in row.items())
              + f"  (max/min x{max(row.values()) / min(row.values()):.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
