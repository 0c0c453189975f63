"""Can the next server start while this one is measured? (issue 42: the flow's server starts are ≈ 10 of its
25 minutes). Servers of one random-weight Llama (`--load-format dummy`; `SERVERS`: base = the target alone,
kN = with a random EAGLE-3 head at k = N under vLLM's synthetic acceptance, as schedule_cost.py) are started
one after the other; each is measured in three phases, every round at each concurrency in turn:

  idle   beside the previous server, up and idle (then that one is stopped)
  alone  nothing else on the GPU
  start  while the next server starts beside it (rounds until the neighbour is healthy)

An instance keeps its own speed (NOTES.md "Twelve instances of one argv": rounds within ≈ 5 %, instances up
to ×2 apart), so the phases are compared inside one instance: one line per (server, c) with each phase's
median tok/s, min–max and rounds, and the ratios to `alone`. Also each start's time, alone or beside a
server being measured, and whether vLLM's memory profiling refused a start beside a busy neighbour.

    python bench/gpu/overlap_cost.py --tokenizer DIR [--servers base k3 base] [--concurrency 1 8 32]
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_steps import measure  # noqa: E402
from schedule_cost import random_target, server_argv  # noqa: E402
from step_cost import SIZES, server_env  # noqa: E402

from pipeline.serving import client  # noqa: E402
from pipeline.serving.server import ServerController, ServerError  # noqa: E402


class Starter(threading.Thread):
    """One server's start in the background: its record, or the error, and how long it took."""

    def __init__(self, start):
        super().__init__(daemon=True)
        self.start_fn, self.rec, self.error, self.seconds = start, None, None, None

    def run(self):
        t0 = time.monotonic()
        try:
            self.rec = self.start_fn()
        except ServerError as exc:
            self.error = str(exc)[:600]
        self.seconds = round(time.monotonic() - t0, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--size", default="0.8b", choices=sorted(SIZES))
    ap.add_argument("--servers", nargs="+", default=["base", "k3", "base"])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.82, 0.746, 0.598])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3, help="rounds a level in the idle and alone phases")
    ap.add_argument("--waves", type=int, default=3, help="a round sends max(6, waves × c) requests")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8821)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("overlap_cost: stopped by SIGTERM"))
    gpu, work, target, vocab = random_target(args, "overlap-cost-")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(max(6, args.waves * max(args.concurrency)))]

    def starter(i: int) -> Starter:
        name, port = f"{i}-{args.servers[i]}", args.port + i % 2
        k = None if args.servers[i] == "base" else int(args.servers[i].removeprefix("k"))
        spec = None
        if k:
            spec = {"method": "eagle3", "model": str(work / "head"), "num_speculative_tokens": k}
            if gpu:
                spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": args.rates[:k]}
        flags = [] if gpu else ["--enforce-eager"]
        ctl = ServerController(work / f"server-{name}.json")
        s = Starter(lambda: ctl.start(server_argv(target, port, spec, flags), host="127.0.0.1", port=port, mode=name,
                                      log=work / f"server-{name}.log", env=server_env(work, gpu), health_timeout=300))
        s.name, s.ctl = name, ctl
        return s

    def one_round(url: str, c: int) -> float:
        return measure(url, prompts[:max(6, args.waves * c)], args.tokens, c, ignore_eos=True)["tok_s"]

    def fixed(url: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {c: [] for c in args.concurrency}
        for _ in range(args.rounds):
            for c in args.concurrency:
                out[c].append(one_round(url, c))
        return out

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):8.1f} ({min(xs):.1f}–{max(xs):.1f}, n {len(xs)})" if xs else "n/a"

    prev: Starter | None = None
    cur = starter(0)
    cur.run()  # the first start alone, in this thread
    print(f"{cur.name}: up in {cur.seconds} s, alone", flush=True)
    for i in range(len(args.servers)):
        if cur.error:
            print(f"{cur.name}: did not start: {cur.error}", flush=True)
            return 1
        url = cur.rec.base_url
        client.complete(url, "target", prompts[0], 4, {})
        for c in args.concurrency:
            measure(url, prompts[:c], 16, c, ignore_eos=True)  # each shape once before timing
        phases: dict[str, dict[int, list[float]]] = {}
        if prev is not None:
            phases["idle"] = fixed(url)
            prev.ctl.stop(grace=10)
        phases["alone"] = fixed(url)
        nxt = starter(i + 1) if i + 1 < len(args.servers) else None
        if nxt is not None:
            nxt.start()
            during: dict[int, list[float]] = {c: [] for c in args.concurrency}
            while nxt.is_alive():
                for c in args.concurrency:
                    tok = one_round(url, c)
                    if nxt.is_alive():  # the round ended before the neighbour was up
                        during[c].append(tok)
            phases["start"] = during
            print(f"{nxt.name}: up in {nxt.seconds} s beside {cur.name} being measured"
                  + (f" — did not start: {nxt.error}" if nxt.error else ""), flush=True)
        for c in args.concurrency:
            alone = phases["alone"][c]
            ref = statistics.median(alone)
            cells = [f"{ph} {fmt(phases[ph][c])}"
                     + (f" ×{statistics.median(phases[ph][c]) / ref:.3f}" if ph != "alone" and phases[ph][c] else "")
                     for ph in ("alone", "idle", "start") if ph in phases]
            print(f"{cur.name} c={c}: " + " | ".join(cells), flush=True)
        if nxt is None:
            cur.ctl.stop(grace=10)
        prev, cur = cur, nxt if nxt is not None else cur
    return 0


if __name__ == "__main__":
    sys.exit(main())
