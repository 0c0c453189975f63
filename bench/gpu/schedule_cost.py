"""A k per batch size on the GPU, and the noise between two servers of one configuration (issue 42): vLLM
serves a random-weight Llama (`--load-format dummy`) alone and with a random EAGLE-3 head whose acceptance
vLLM's synthetic rejection sampler sets (bench/gpu/step_cost.py says why that measures real costs), one
server at a time, alone on the GPU as production is. Each variant is measured in rounds at each
concurrency (streamed, `ignore_eos`); one line per (variant, c) with the median tok/s and the min–max, the
SM clock NVML read during the rounds, then each variant's ratio to the first baseline and the spread between
baseline instances.

    python bench/gpu/schedule_cost.py --tokenizer DIR --variants base base2 k3 sched-pw k3-pw [--rounds 3]

Variants (`VARIANTS`): base / base2 (two instances of the target alone, same argv), k1, k3 (one k), k3-sw (the
head's layer a sliding window, as speculators 0.9.0 trains it by default), sched-*
(k = 3 with a schedule `SCHEDULE` under a serving configuration), k3-* (k = 3 under that configuration
without a schedule: what the configuration itself costs). A server that fails to start is one line with
vLLM's reason (the schedule under CUDA graphs did, on vLLM 0.26.0)."""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_steps import measure  # noqa: E402
from step_cost import SIZES, server_env, write_head, write_target  # noqa: E402

from pipeline.compat import vllm_flags  # noqa: E402
from pipeline.serving import client, vllm_modes  # noqa: E402
from pipeline.serving.server import ServerController, ServerError  # noqa: E402

SCHEDULE = [[1, 2, 3], [3, 16, 1], [17, 1024, 0]]
PIECEWISE = ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
# name → (extra server flags, extra environment)
CONFIGS: dict[str, tuple[list[str], dict]] = {
    "": ([], {}),
    "v1": (PIECEWISE, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),  # the V1 runner: k = 0 skips the draft's steps
    "pw": (PIECEWISE, {}),  # Model Runner V2 (0.26.0's default for a dense target), piecewise graphs
    "eager": (["--enforce-eager"], {}),
    "noasync": (["--no-async-scheduling"], {}),
    "pin": ([], {"SC_PIN": "1-6"}),  # API server and engine core on cores 1-6 (taskset): the CPU placement
    # graphs captured up to 128 tokens a step (vLLM's default: up to 512; NOTES.md "Twelve instances of one argv")
    "cap128": (["--compilation-config", json.dumps({"max_cudagraph_capture_size": 128})], {}),
    # the head as speculators 0.9.0 trains it by default: its layer a sliding window of 2048 (vLLM serves it
    # so: a second KV-cache group beside the target's full attention)
    "sw": ([], {"SC_HEAD": "head-sw"}),
    # that head with one KV-cache group: vLLM turns the window's spec into full attention's (the kernel still
    # windows; at max_model_len ≤ the window nothing changes)
    "swnh": (["--disable-hybrid-kv-cache-manager"], {"SC_HEAD": "head-sw"}),
    "nh": (["--disable-hybrid-kv-cache-manager"], {}),  # the flag alone (one group either way)
}


def variant(name: str) -> tuple[int | None, bool, list[str], dict]:
    """base, base2, k1, k3, sched-CONFIG, k3-CONFIG, base-CONFIG (CONFIGS)."""
    head, _, config = name.partition("-")
    flags, env = CONFIGS[config]
    if head.startswith("base"):
        return None, False, flags, env
    if head == "sched":
        return 3, True, flags, env
    return int(head.removeprefix("k")), False, flags, env


def server_argv(target: Path, port: int, spec: dict | None, flags: list[str]) -> list[str]:
    argv = [sys.executable, "-m", vllm_flags.API_SERVER_MODULE, "--model", str(target), "--served-model-name",
            "target", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16",
            "--load-format", "dummy", "--gpu-memory-utilization", "0.28"]
    return argv + flags + (["--speculative-config", json.dumps(spec)] if spec else [])


def random_target(args, prefix: str) -> tuple[bool, Path, Path, int]:
    """The random-weight target of `args.size` and its random head under `args.work` (a new temporary directory
    without one): (a GPU is here, the work directory, the target's directory, its vocabulary size)."""
    work = args.work or Path(tempfile.mkdtemp(prefix=prefix))
    shape = SIZES[args.size]
    target = work / f"target-{args.size}"
    vocab = write_target(target, shape, args.tokenizer)
    write_head(work / "head", target, shape, vocab, min(4096, vocab))
    write_head(work / "head-sw", target, shape, vocab, min(4096, vocab), sliding_window=2048)
    return vllm_modes.accelerator_available(), work, target, vocab


class Clocks(threading.Thread):
    """The SM clock (MHz) and the GPU's busy share (NVML's utilization: the time a kernel ran) every 0.2 s
    while measuring. A slow instance with the GPU as busy as a fast one's is slow on the GPU; with the GPU
    idler, it waits on its CPU side."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[int] = []
        self.busy: list[int] = []
        self.done = threading.Event()

    def run(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            while not self.done.wait(0.2):
                self.samples.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
                self.busy.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:  # noqa: BLE001 - no NVML: no clock column
            pass

    def summary(self) -> str:
        self.done.set()
        self.join(2)
        s, b = self.samples, self.busy
        return (f"sm {statistics.median(s):.0f} MHz ({min(s)}–{max(s)}), gpu busy {statistics.median(b):.0f} %"
                if s else "sm n/a")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--size", default="0.8b", choices=sorted(SIZES))
    ap.add_argument("--variants", nargs="+", default=["base", "base2", "k3", "sched-", "sched-pw"])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.82, 0.746, 0.598])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--port", type=int, default=8811)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--start-timeout", type=int, default=300)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("schedule_cost: stopped by SIGTERM"))
    gpu, work, target, vocab = random_target(args, "schedule-cost-")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(args.prompts)]
    results: dict = {}
    for i, name in enumerate(args.variants):
        k, sched, flags, extra_env = variant(name)
        spec = None
        if k is not None:
            spec = {"method": "eagle3", "model": str(work / extra_env.get("SC_HEAD", "head")),
                    "num_speculative_tokens": k}
            if gpu:
                spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": args.rates[:k]}
            if sched:
                spec["num_speculative_tokens_per_batch_size"] = SCHEDULE
        if not gpu and "--enforce-eager" not in flags:
            flags = [*flags, "--enforce-eager"]
        ctl = ServerController(work / f"server-{name}.json")
        t0 = time.monotonic()
        try:
            argv = server_argv(target, args.port, spec, flags)
            if extra_env.get("SC_PIN"):
                argv = ["taskset", "-c", extra_env["SC_PIN"], *argv]
            rec = ctl.start(argv, host="127.0.0.1", port=args.port, mode=name,
                            log=work / f"server-{name}.log", env=server_env(work, gpu) | extra_env,
                            health_timeout=args.start_timeout)
        except ServerError as exc:
            print(f"{name}: did not start: {str(exc)[:900]}", flush=True)
            continue
        try:
            log = (work / f"server-{name}.log").read_text(errors="replace")
            runner = "V2" if "Using V2 Model Runner" in log else "V1"
            mode = "PIECEWISE (forced)" if "Overriding cudagraph_mode" in log else ""
            print(f"{name}: up in {time.monotonic() - t0:.0f} s, runner {runner} {mode}", flush=True)
            client.complete(rec.base_url, "target", prompts[0], 4, {})
            for c in args.concurrency:
                measure(rec.base_url, prompts[:c], 16, c, ignore_eos=True)  # each shape once before timing
                clocks = Clocks()
                clocks.start()
                rounds = [measure(rec.base_url, prompts, args.tokens, c, ignore_eos=True) for _ in range(args.rounds)]
                tok = [r["tok_s"] for r in rounds]
                results[(f"{name}#{i}" if args.variants.count(name) > 1 else name, c)] = tok  # each instance
                tau = rounds[0]["tau"]
                print(f"{name} c={c}: {statistics.median(tok):.1f} tok/s ({min(tok):.1f}–{max(tok):.1f}), "
                      f"tau {tau}, chunk {rounds[0]['chunk_ms']} ms, {clocks.summary()}", flush=True)
        finally:
            ctl.stop(grace=10)
    bases = [n for n in dict.fromkeys(n for n, _ in results) if n.startswith("base")]
    for c in args.concurrency:
        ref = results.get((bases[0], c)) if bases else None
        if not ref:
            continue
        for name in dict.fromkeys(n for n, _ in results):
            if (name, c) in results and name != bases[0]:
                mine = results[(name, c)]
                print(f"ratio {name} / {bases[0]} c={c}: x{statistics.median(mine) / statistics.median(ref):.3f} "
                      f"(x{min(mine) / max(ref):.3f}–x{max(mine) / min(ref):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
