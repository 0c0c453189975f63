"""The target's next release in miniature (issue 44 item 4): the demo target is the "old" release, the same
target trained further on other conversations (demo_target.next_release_steps) the "new" one. Three runs of
the demo profile (or gpu-demo's, --profile) through the pipeline's own CLI, each to pick-checkpoint: τ at every
epoch from the offline evaluator (the CPU demo) or one vLLM server a checkpoint (gpu-demo); the matrix is not
what this measures:

  old   the old target, a head trained from nothing (its chosen checkpoint is "the old head")
  cold  the new target, a head trained from nothing
  warm  the new target, the old head trained on (train.from_pretrained): a copy of the cold run from vocab on
        (the same rows and hidden states); pick-checkpoint measures the old head on the new target as
        checkpoint "start" before its epochs

Prints, side by side: the old head's τ on the old and the new target (what the release cost it), τ per epoch
of the cold and the warm start, and the training time each needed to reach the cold start's final τ.

    .venv/bin/python bench/next_release.py [--work DIR] [--profile demo] [--steps 200] [--warm-epochs N] [--warm-lr LR]
                                           [--set KEY=VALUE ...] [--warm-set KEY=VALUE ... --warm-tag TAG]

A warm start with its own epochs or learning rate is its own run (warm-e3, warm-e3-lr0.001): a second call
in the same --work measures another warm start against the same old and cold runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(work: Path, name: str, profile: str, sets: list[str], copy_of: Path | None = None) -> Path:
    """One run through pick-checkpoint (τ per epoch is all this measures; the matrix and evaluate-offline
    would only add time). With copy_of: a copy of that run from vocab on, so the warm start trains on the
    cold start's own rows and hidden states (the two differ only in their starting head)."""
    run_dir = work / name
    tail = ["--no-tui", "--until", "pick-checkpoint"]
    if (run_dir / "state.json").is_file():
        args = [sys.executable, "-m", "pipeline", "run", "--resume", str(run_dir), *tail]
    elif copy_of is not None:
        args = [sys.executable, "-m", "pipeline", "run", "--copy-of", str(copy_of), "--from", "vocab",
                "--run-dir", str(run_dir), *tail, *[a for s in sets for a in ("--set", s)]]
    else:
        args = [sys.executable, "-m", "pipeline", "run", profile, "--run-dir", str(run_dir), *tail,
                *[a for s in sets for a in ("--set", s)]]
    print(f"[{name}] {' '.join(args[3:])}", flush=True)
    log = work / f"{name}.log"  # the run's own output, followed by a device call's wait while it runs
    with log.open("a") as out:
        code = subprocess.run(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = [ln for ln in lines if "error:" in ln][-1:] or lines[-1:]
        sys.exit(f"[{name}] failed ({code}): {last} (whole output: {log})")
    return run_dir


def epochs(run_dir: Path) -> dict:
    """τ per checkpoint label (start, 0, 1, …), the train stage's seconds, and each epoch's end in seconds from
    the trainer's start (its events)."""
    from pipeline.layout import atomicio
    from pipeline.layout.rundir import RunDir

    r = RunDir.open(run_dir)
    picked = atomicio.read_json(r.checkpoints_result) or {}
    taus = {e["label"]: e["tau"] for e in picked.get("checkpoints", [])}
    events = [e for e in r.events() if e.get("stage") == "train"]
    t0 = next((e["t"] for e in events if e.get("kind") == "command"), events[0]["t"] if events else 0.0)
    ends: dict[int, float] = {}
    for e in events:
        if "epoch" in e and any(k.startswith("val/") for k in e):
            ends[int(e["epoch"])] = round(e["t"] - t0, 1)
    return {"taus": taus, "train_s": r.stage_state("train").get("seconds"), "epoch_end_s": ends,
            "startup_s": (r.stage_state("train").get("figures") or {}).get("startup_s"),
            "chosen": (picked.get("chosen") or {}).get("label"),
            "chosen_path": next((e["path"] for e in picked.get("checkpoints", [])
                                 if e["label"] == (picked.get("chosen") or {}).get("label")), None)}


def reached(figures: dict, tau: float) -> tuple[float, int] | tuple[None, None]:
    """Training seconds and epochs until the first measured checkpoint at or above `tau` (0, 0 for the starting
    head). The epochs apart from the seconds: both runs' first epoch carries the trainer's start-up (≈ 5 s on
    the CPU demo)."""
    for label, t in figures["taus"].items():
        if t >= tau:
            return (0.0, 0) if label == "start" else (figures["epoch_end_s"].get(int(label)), int(label) + 1)
    return None, None


def after_startup(figures: dict, seconds: float | None) -> float | None:
    """Seconds to the crossing less the trainer's start-up (the train stage's `startup_s`: to its first logged
    step), 0 for the starting head; None where either is unknown."""
    if seconds is None or figures.get("startup_s") is None:
        return None
    return max(0.0, seconds - figures["startup_s"]) if seconds else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="runs and cache here (kept; a second call resumes)")
    ap.add_argument("--profile", default="demo", help="demo (CPU) or gpu-demo (one GPU, τ through vLLM)")
    ap.add_argument("--steps", type=int, default=200, help="demo_target.next_release_steps")
    ap.add_argument("--warm-epochs", type=int, default=None,
                    help="train.epochs of the warm start (default: the cold's)")
    ap.add_argument("--warm-lr", type=float, default=None, help="train.lr of the warm start (default: the cold's)")
    ap.add_argument("--set", action="append", default=[],
                    help="KEY=VALUE for every run (demo_target.next_release_*: the new target's runs only)")
    ap.add_argument("--warm-set", action="append", default=[],
                    help="KEY=VALUE for the warm start only, e.g. train.extra_args=[\"--scheduler-type\",\"none\"]")
    ap.add_argument("--warm-tag", default="", help="the warm run's name suffix for its --warm-set (default: a hash)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="next-release-"))
    work.mkdir(parents=True, exist_ok=True)
    # τ per checkpoint: the offline evaluator where the profile runs it (the CPU demo), else one vLLM server a
    # checkpoint (gpu-demo: evaluate.offline = "off"); every run stops after pick-checkpoint, before the matrix
    # the release's own keys (demo_target.next_release_*) go to the new target's runs only: the old release has
    # none, and a rate without its steps is refused there
    release = [s for s in args.set if s.startswith("demo_target.next_release_")]
    common = ['evaluate.checkpoints="each"', f'run.cache_dir="{work / "cache"}"',
              f'run.runs_dir="{work}"', *[s for s in args.set if s not in release]]
    new = [*common, f"demo_target.next_release_steps={args.steps}", *release]
    old = epochs(run(work, "old", args.profile, common))
    cold = epochs(run(work, "cold", args.profile, new))
    warm_sets = [f'train.from_pretrained="{old["chosen_path"]}"']
    name = "warm"
    if args.warm_epochs:
        warm_sets.append(f"train.epochs={args.warm_epochs}")
        name += f"-e{args.warm_epochs}"
    if args.warm_lr:
        warm_sets.append(f"train.lr={args.warm_lr}")
        name += f"-lr{args.warm_lr:g}"
    if args.warm_set:
        import hashlib

        warm_sets += args.warm_set
        name += "-" + (args.warm_tag or hashlib.sha1("\n".join(args.warm_set).encode()).hexdigest()[:6])
    warm = epochs(run(work, name, args.profile, warm_sets, copy_of=work / "cold"))

    final = cold["taus"][str(max(int(k) for k in cold["taus"] if k.isdigit()))]
    on_old = old["taus"][old["chosen"]]
    on_new = warm["taus"].get("start")
    print(f"\nthe old head (checkpoint {old['chosen']} of the old run): τ {on_old:.3f} on the old target, "
          f"{on_new:.3f} on the new one ({(on_new / on_old - 1) * 100:+.1f} %)")
    labels = sorted({*cold["taus"], *warm["taus"]}, key=lambda s: -1 if s == "start" else int(s))
    print(f"\n{'checkpoint':<11}{'cold τ':>8}{'warm τ':>8}{'cold s':>8}{'warm s':>8}")
    for label in labels:
        def cell(f, key):
            v = f["taus"].get(key)
            return f"{v:>8.3f}" if v is not None else f"{'':>8}"

        def secs(f, key):
            v = 0.0 if key == "start" else f["epoch_end_s"].get(int(key))
            return f"{v:>8.1f}" if v is not None and key in f["taus"] else f"{'':>8}"
        print(f"{label:<11}{cell(cold, label)}{cell(warm, label)}{secs(cold, label)}{secs(warm, label)}")
    (tc, ec), (tw, ew) = reached(cold, final), reached(warm, final)
    print(f"\nthe cold start's final τ {final:.3f}: cold reached it in {tc} s of training ({ec} epochs), warm in "
          f"{tw} s ({ew} epochs)" + (f" (×{tw / tc:.2f} of the cold's time, ×{ew / ec:.2f} of its epochs)"
                                     if tc and tw is not None and ec and ew is not None else "")
          + f"; train stages {cold['train_s']} s (cold) and {warm['train_s']} s (warm)")
    steps_c, steps_w = after_startup(cold, tc), after_startup(warm, tw)
    if steps_c and steps_w is not None:  # the fixed start-up (imports; on a GPU the compile) taken off both
        print(f"after the trainer's start-up ({cold['startup_s']} s cold, {warm['startup_s']} s warm): cold "
              f"{steps_c:.1f} s, warm {steps_w:.1f} s (×{steps_w / steps_c:.2f})")
    (work / f"result-{name}.json").write_text(json.dumps({
        "warm_run": name, "old": old, "cold": cold, "warm": warm, "old_head_tau_old": on_old,
        "old_head_tau_new": on_new, "cold_final_tau": final, "cold_time_s": tc, "warm_time_s": tw,
        "cold_epochs": ec, "warm_epochs": ew, "cold_after_startup_s": steps_c, "warm_after_startup_s": steps_w}))
    print(f"figures: {work / f'result-{name}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
