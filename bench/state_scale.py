"""A run's bookkeeping at full size: a synthetic run whose extract stage wrote N hidden-state files
(500,000 by default, empty files: only the count matters here), recorded two ways side by side — every
file with its size (the manifest before) and one digest record per output directory (now). Prints, for
each: state.json size, recording the outputs, resume's done-check, `status`, and one console tick (the
run watcher reading state and events).

    .venv/bin/python bench/state_scale.py [--files 500000] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stdout
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_file_manifest(run, paths: list[Path]) -> dict[str, int]:
    """The manifest as it was: every file under the outputs with its size."""
    out = {}
    for path in paths:
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            out[str(f.relative_to(run.root))] = f.stat().st_size
    return out


def per_file_intact(run, recorded: dict[str, int]) -> bool:
    return all((run.root / k).stat().st_size == v for k, v in recorded.items())


def quiet_status(cli, root: Path) -> int:
    with redirect_stdout(io.StringIO()):
        return cli.main(["status", str(root)])


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    from pipeline import cli
    from pipeline.layout.rundir import RunDir
    from pipeline.profile import load_profile
    from pipeline.run import runner
    from pipeline.run.runview import RunWatcher
    from pipeline.stages import STAGES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=500_000)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="state-scale-", dir=args.dir))
    try:
        run = RunDir.create(load_profile(ROOT / "tests" / "profiles" / "tiny.toml"), work / "run")
        hs = run.hidden_states_dir
        hs.mkdir(parents=True)
        t0 = time.perf_counter()
        for i in range(args.files):
            (hs / f"hs_{i}.safetensors").touch()
        print(f"{args.files:,} files created in {time.perf_counter() - t0:.1f} s under {work}")
        rows = []
        for label, record, intact in (("per file (before)", per_file_manifest, per_file_intact),
                                      ("digest per directory (now)", runner.manifest, runner.outputs_intact)):
            make_s, recorded = timed(partial(record, run, [hs]), repeats=1)
            run.update_stage("extract", status="done", outputs=recorded, seconds=1.0, figures={})
            size = run.state_path.stat().st_size
            check_s, ok = timed(partial(intact, run, recorded))
            assert ok, "the recorded outputs must read as intact"
            status_s, _ = timed(lambda: quiet_status(cli, run.root), repeats=1)
            tick_s, _ = timed(lambda: RunWatcher(run, [s.name for s in STAGES]).poll())
            rows.append((label, size, make_s, check_s, status_s, tick_s))
        print(f"{'':<28}{'state.json':>14}{'record':>10}{'done-check':>12}{'status':>10}{'tick':>10}")
        for label, size, make_s, check_s, status_s, tick_s in rows:
            print(f"{label:<28}{size:>12,} B{make_s:>9.2f}s{check_s:>11.2f}s{status_s:>9.2f}s{tick_s:>9.3f}s")
        before, now = rows
        print(f"state.json {before[1] / now[1]:,.0f}x smaller; console tick {before[5] / max(now[5], 1e-6):,.0f}x "
              f"faster; done-check {before[3] / max(now[3], 1e-6):.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
