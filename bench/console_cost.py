"""Console cost: CPU time per wall second and resident memory while attached to a run, with 8
synthetic GPUs sampled at 1 Hz, and log ingestion in lines/s.

    .venv/bin/python bench/console_cost.py [--seconds 30] [--lines 50000]

Runs the real ConsoleApp headless (Textual's test driver renders every frame as for a terminal) over
a synthetic run; the GPUs come from the tests' NVML stand-in, since this machine has none.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_run(tmp: Path):
    from pipeline.layout.rundir import RunDir
    from pipeline.profile import load_profile

    profile = load_profile(ROOT / "tests/profiles/tiny.toml", {"run.runs_dir": str(tmp / "runs"), "server.port": 1})
    run = RunDir.create(profile, tmp / "run")
    me = psutil.Process()  # the run's runner, as far as liveness goes: train reads "running", its log is tailed
    run.update_state(runner={"pid": me.pid, "since": me.create_time()})
    run.update_stage("train", status="running")
    run.emit("train", "start")
    run.emit("train", "progress", done=3, total=20, unit="epochs")
    run.logs_dir.mkdir(exist_ok=True)
    run.log_path("train").write_text("")
    return run


async def measure(seconds: float, lines: int) -> None:
    from console.app import ConsoleApp
    from pipeline.host import gpu
    from tests.fake_nvml import FakeNvml, h200

    fake = FakeNvml([h200(i, procs=[(1000 + i, 10 << 30)]) for i in range(8)])

    tick = [0]

    def sampler():  # values move every second, as real GPUs' do
        tick[0] += 1
        for i, g in enumerate(fake.gpus):
            g["util"] = (tick[0] * 7 + i * 13) % 100
            g["used"] = (20 + (tick[0] + i) % 50) << 30
            g["power_mw"] = 200_000 + 5_000 * ((tick[0] + i) % 40)
        gpu.use_nvml(fake)
        return gpu.sample()

    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp))
        app = ConsoleApp(run.root, interval=1.0, sampler=sampler)
        me = psutil.Process()
        async with app.run_test(size=(200, 50)) as pilot:
            for key, shown in (("2", "GPU tab shown (8 rows + sparklines redrawn)"),
                               ("1", "Run tab shown (GPUs sampled, not drawn)")):
                await pilot.press(key)
                await pilot.pause(3)
                cpu0, t0 = me.cpu_times(), time.perf_counter()
                await asyncio.sleep(seconds)
                cpu1, t1 = me.cpu_times(), time.perf_counter()
                rss = me.memory_info().rss
                used = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
                print(f"attached, 8 GPUs at 1 Hz, {t1 - t0:.0f} s, {shown}: CPU {100 * used / (t1 - t0):.2f} % "
                      f"of one core, RSS {rss / 2**20:.0f} MiB")
            await pilot.press("1")
            log = app.run_tab.lines
            base = log.line_count
            with open(run.log_path("train"), "a") as fh:
                fh.writelines(f"step {i} train/loss=0.{i % 1000:03d} profile/step_ms=215.0\n" for i in range(lines))
            t2 = time.perf_counter()
            while log.line_count < min(base + lines, 10_000) and time.perf_counter() - t2 < 120:
                await asyncio.sleep(0.05)
            t3 = time.perf_counter()
            print(f"log ingestion: {lines} lines appended at once, shown after {t3 - t2:.2f} s "
                  f"-> {lines / (t3 - t2):,.0f} lines/s (Log keeps the last 10,000)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--lines", type=int, default=50_000)
    args = ap.parse_args()
    asyncio.run(measure(args.seconds, args.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
