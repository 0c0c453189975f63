"""The pipeline's train stage vs `speculators train` run directly with the identical flags, on a
synthetic 8B-class workload (hidden 4096, vocab 128256 -> draft vocab 32000; random weights and states,
which is fine for throughput). Prints steady-state step time and tokens/s of each, their ratio, wall
times, and peak GPU memory (NVML); writes a JSON summary.

    python bench/gpu/train_ratio.py --work DIR [--mode both|stage|direct] [--nproc N] [--fsdp]
        [--samples 64] [--seq 2048] [--epochs 3] [--total-seq-len 8192] [--loss auto|fused|eager]
        [--small]   # a CPU-sized smoke run of the same code (hidden 64, vocab 1000)

Run on a GPU box after bench/gpu/setup.sh; `--mode stage --nproc 2 [--fsdp]` for the scaling runs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import ROOT, llama_config, write_prepared, write_verifier_stub

from pipeline.compat.speculators_compat import metrics_record
from pipeline.host import gpu, procs
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.run.runner import run_stages
from pipeline.stages.train import build_command


def steady(step_ms: list[float], per_epoch: int) -> float:
    """Median step time, leaving out each epoch's first step (compile, loader refill)."""
    kept = [ms for i, ms in enumerate(step_ms) if per_epoch <= 1 or i % per_epoch != 0] or step_ms
    return statistics.median(kept)


def step_times(log: Path) -> list[float]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = metrics_record(line) or {}
        if "profile/step_ms" in m and any(k.startswith("train/") for k in m):
            out.append(m["profile/step_ms"])
    return out


class PeakMemory:
    """Peak NVML memory in use on any GPU during a block, above what was in use before it."""

    def __enter__(self):
        snap = gpu.sample()
        self.base = {g.index: g.mem_used or 0 for g in snap.gpus}
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self):
        while not self.stop.wait(0.5):
            for g in gpu.sample().gpus:
                self.peak = max(self.peak, (g.mem_used or 0) - self.base.get(g.index, 0))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--mode", choices=["both", "stage", "direct"], default="both")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--total-seq-len", type=int, default=8192)
    ap.add_argument("--loss", default="auto")
    ap.add_argument("--attn", default="auto")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work = a.work.resolve()  # profile paths resolve against the profile's folder, not the cwd

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 1000} if a.small else {}
    config = llama_config(**sizes)
    a.work.mkdir(parents=True, exist_ok=True)
    stub = a.work / "verifier"
    if not (stub / "model.safetensors").exists():
        t = time.perf_counter()
        write_verifier_stub(stub, config)
        print(f"verifier stub written in {time.perf_counter() - t:.1f} s", flush=True)
    tag = a.tag or f"n{a.nproc}{'-fsdp' if a.fsdp else ''}"
    overrides = {"target.model_path": str(stub), "target.config": "",
                 "run.runs_dir": str(a.work / "runs"), "run.cache_dir": str(a.work / "cache"),
                 "train.epochs": a.epochs, "train.total_seq_len": a.total_seq_len, "train.nproc_per_node": a.nproc,
                 "train.fsdp": a.fsdp, "train.loss_implementation": a.loss, "train.draft_attn_impl": a.attn,
                 "vocab.draft_vocab_size": 256 if a.small else 32000, "data.seq_length": a.seq,
                 "data.max_samples": a.samples, "data.mean_sample_tokens": a.seq, "hardware.min_free_disk_gib": 1.0}
    profile = load_profile(ROOT / "bench/gpu/train-8b.toml", overrides)
    # One synthetic dataset per size, shared by every run of this work directory (runs link to it).
    data_dir = a.work / f"data-{a.samples}x{a.seq}"
    data = RunDir.create(profile, data_dir) if not data_dir.exists() else RunDir.open(data_dir)
    if not (data.prepared_dir / "token_freq.pt").exists():
        t = time.perf_counter()
        write_prepared(data, config, a.samples, a.seq, n_states=4)
        print(f"{a.samples} samples x {a.seq} tokens of synthetic data in {time.perf_counter() - t:.1f} s", flush=True)
    tokens = a.samples * a.seq
    run = RunDir.create(profile, a.work / f"run-{tag}-{int(time.time())}")
    run.data_dir.mkdir(parents=True, exist_ok=True)
    run.prepared_dir.symlink_to(data.prepared_dir.resolve())
    run_stages(run, start="vocab", until="vocab")

    per_epoch = max(1, round(0.9 * tokens / (a.total_seq_len * a.nproc)))
    results = {"tag": tag, "tokens_per_epoch": tokens, "total_seq_len": a.total_seq_len, "nproc": a.nproc,
               "fsdp": a.fsdp}
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(a.work / "inductor"), "HF_HUB_OFFLINE": "1"}
    os.environ.update(env)

    def report(name: str, log: Path, wall: float, peak: int) -> None:
        ms = step_times(log)
        if not ms:
            print(f"{name}: no step times in {log}", flush=True)
            results[name] = {"wall_s": round(wall, 1), "steps": 0}
            return
        s = steady(ms, per_epoch)
        tps = a.total_seq_len * a.nproc / (s / 1000)
        results[name] = {"wall_s": round(wall, 1), "steps": len(ms), "first_step_ms": ms[0],
                         "steady_step_ms": round(s, 1), "tokens_per_s": round(tps),
                         "peak_gpu_mem_gib": round(peak / 2**30, 2)}
        print(f"{name}: {len(ms)} steps, first {ms[0]:.0f} ms, steady {s:.1f} ms/step = {tps:,.0f} tok/s "
              f"(x{a.nproc} ranks x {a.total_seq_len}), wall {wall:.1f} s, peak GPU memory {peak / 2**30:.2f} GiB",
              flush=True)

    # both: direct first (it pays the cold compile), the stage, then direct again with the same warm
    # caches, so that the wall-clock ratio compares like with like
    order = ["direct", "stage", "direct-warm"] if a.mode == "both" else [a.mode]
    for name in order:
        if name == "stage":
            t = time.perf_counter()
            with PeakMemory() as pm:
                run_stages(run, start="train", until="train")
            report("stage", run.log_path("train"), time.perf_counter() - t, pm.peak)
        else:
            import logging

            from pipeline.stages.base import StageContext
            ctx = StageContext(run=run, profile=profile, log=logging.getLogger("bench"))
            cmd = build_command(ctx)
            i = cmd.index("pipeline.training.launch")
            cmd[i - 1:i + 1] = ["-m", "speculators"]  # the same flags, straight into speculators' CLI
            save = cmd.index("--save-path")
            cmd[save + 1] = str(a.work / f"{name}-{tag}")
            log = a.work / f"{name}-{tag}.log"
            print("direct:", " ".join(cmd), flush=True)
            t = time.perf_counter()
            with PeakMemory() as pm:
                rc = procs.run_logged(cmd, log, env=procs.child_env(run.cache_root), cwd=run.root)
            report(name, log, time.perf_counter() - t, pm.peak)
            results[name]["rc"] = rc
            if rc != 0:
                print(f"direct run failed ({rc}): {procs.last_error_line(log)}", flush=True)
    if "stage" in results and "direct" in results and results["direct"].get("steps") and results["stage"].get("steps"):
        r = results["stage"]["tokens_per_s"] / results["direct"]["tokens_per_s"]
        w = results["direct"]["wall_s"] / results["stage"]["wall_s"]
        results["ratio_steady_tokens_per_s"] = round(r, 4)
        results["ratio_wall"] = round(w, 4)
        print(f"train stage / direct speculators train: steady tok/s ratio {r:.4f}, wall-clock ratio {w:.4f} "
              f"(direct ran first, cold caches)", flush=True)
        if results.get("direct-warm", {}).get("steps"):
            w2 = results["direct-warm"]["wall_s"] / results["stage"]["wall_s"]
            r2 = results["stage"]["tokens_per_s"] / results["direct-warm"]["tokens_per_s"]
            results["ratio_wall_warm"], results["ratio_steady_tokens_per_s_warm"] = round(w2, 4), round(r2, 4)
            print(f"train stage / direct again (same warm caches): steady tok/s ratio {r2:.4f}, "
                  f"wall-clock ratio {w2:.4f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
