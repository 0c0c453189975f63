"""GPU smoke run of the console's GPU panel against real NVML (run it on a GPU machine).

    python bench/gpu_panel_smoke.py --out DIR [--samples 200]

Prints NVML's answer per GPU, the cost of one full sample (median / p90 over --samples), and writes
DIR/gpu_panel.svg (a screenshot of the console's GPU tab, real values) and DIR/gpu_panel.txt.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def screenshot(out: Path) -> None:
    from console.app import ConsoleApp
    from pipeline.layout.rundir import RunDir
    from pipeline.profile import load_profile

    with tempfile.TemporaryDirectory() as tmp:
        profile = load_profile(ROOT / "tests/profiles/tiny.toml", {"run.runs_dir": f"{tmp}/runs", "server.port": 1})
        run = RunDir.create(profile, Path(tmp) / "run")
        app = ConsoleApp(run.root)
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.press("2")
            await pilot.pause(3.5)
            rows = app.gpus.grid.plain.splitlines()
            procs = app.gpus.procs
            rows += ["processes:"] + [" | ".join(str(c) for c in procs.get_row_at(i)) for i in range(procs.row_count)]
            (out / "gpu_panel.txt").write_text("\n".join(rows) + "\n")
            app.save_screenshot(str(out / "gpu_panel.svg"))
            print("\n".join(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from pipeline.host import gpu

    t0 = time.perf_counter()
    first = gpu.sample()
    print(f"first sample (nvmlInit + names): {1000 * (time.perf_counter() - t0):.1f} ms")
    if first.unavailable:
        print(f"no NVML: {first.unavailable}")
        return 1
    for g in first.gpus:
        print(g)
    costs = []
    for _ in range(args.samples):
        t = time.perf_counter()
        gpu.sample()
        costs.append(1000 * (time.perf_counter() - t))
    costs.sort()
    print(f"full sample of {len(first.gpus)} GPU(s) (util, memory, temperature, power, limit, SM clock, "
          f"processes): median {statistics.median(costs):.3f} ms, p90 {costs[int(0.9 * len(costs))]:.3f} ms")
    asyncio.run(screenshot(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
