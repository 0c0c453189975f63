"""`run` (a new run, a resume, a copy) and `attach`: the pipeline as a detached job the console watches, or
headless with progress on stdout."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.cli.base import EXIT_FAILED, EXIT_USAGE, CliError, Command, overrides


def add_console_flags(parser) -> None:
    parser.add_argument("--readonly", action="store_true", help="show only: every control disabled")
    parser.add_argument("--interval", type=float, default=1.0, help="GPU sampling period in seconds (>= 0.25)")


class Run(Command):
    name, help = "run", "run (or resume) the pipeline"

    def subparser_init(self, subparsers):
        from pipeline.stages import stage_names

        p = super().subparser_init(subparsers)
        p.add_argument("profile", nargs="?", help="profile TOML file or name in profiles/")
        p.add_argument("--resume", metavar="RUN_DIR", help="finish an existing run")
        p.add_argument("--run-dir", help="where to create the run (default runs/<profile>-<UTC time>)")
        p.add_argument("--copy-of", metavar="RUN_DIR",
                       help="a new run starting from RUN_DIR's stages before --from (linked or copied); "
                            "PROFILE defaults to RUN_DIR's, --set changes it")
        p.add_argument("--from", dest="start", metavar="STAGE", help=f"first stage ({', '.join(stage_names())})")
        p.add_argument("--until", metavar="STAGE", help="last stage")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a profile value, e.g. --set train.epochs=3 (repeatable)")
        p.add_argument("--no-tui", action="store_true", help="headless: progress on stdout")
        add_console_flags(p)
        return p

    def errors(self) -> dict:
        from pipeline.profile import ProfileError
        from pipeline.run.runner import RunnerError
        return {(ProfileError, RunnerError): EXIT_USAGE, **super().errors()}

    def cmd(self, args) -> int:
        from pipeline.layout.rundir import RunDir, RunDirError
        from pipeline.profile import ProfileError, load_profile
        from pipeline.run.progress import ProgressPrinter
        from pipeline.run.runner import Interrupted, RunnerError, run_stages, select

        run = None
        try:
            if args.resume:
                if args.profile:
                    raise CliError("give either PROFILE or --resume RUN_DIR, not both")
                if args.set or args.copy_of:
                    what = f"--set {args.set[0]}" if args.set else f"--copy-of {args.copy_of}"
                    raise CliError(f"{what}: a resumed run keeps the profile and the files it was created with "
                                   f"({Path(args.resume) / 'profile.toml'}); start a new run to change it "
                                   f"(run --copy-of {args.resume} --from STAGE --set ...)")
                run = RunDir.open(Path(args.resume))
                profile = run.profile()
            elif args.copy_of:
                from pipeline.run.runcopy import copy_of
                if not args.start:
                    raise CliError(f"--copy-of {args.copy_of}: say where the new run starts (--from STAGE)")
                source = RunDir.open(Path(args.copy_of))
                profile = load_profile(args.profile or source.profile_path, overrides(args.set),
                                       held=() if args.profile else source.held())
                select(profile, args.start, args.until)
                run, copied = copy_of(source.root, profile, args.start, Path(args.run_dir) if args.run_dir else None)
                print(copied.line(source.root), flush=True)
            else:
                if not args.profile:
                    raise CliError("PROFILE is required (or --resume RUN_DIR)")
                profile = load_profile(args.profile, overrides(args.set))
                select(profile, args.start, args.until)  # validate the range before creating anything
                run = RunDir.create(profile, Path(args.run_dir) if args.run_dir else None)
            os.environ.setdefault("HF_HOME", str(run.cache_root / "hf"))
            print(f"run directory: {run.root}", flush=True)
            if not args.no_tui:
                return detach_and_attach(run, args)
            run_stages(run, args.start, args.until, on_event=ProgressPrinter())
        except (CliError, ProfileError, RunDirError, RunnerError):
            raise  # bad input: one line (errors)
        except (KeyboardInterrupt, Interrupted) as exc:
            why = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
            raise CliError(f"interrupted ({why})" + (f"; resume with: eagle3-console run --resume {run.root}"
                                                     if run else ""),
                           130 if isinstance(exc, KeyboardInterrupt) else 143) from exc
        except Exception as exc:  # the stage already recorded it; one line here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if run is None:
                raise CliError(first, EXIT_FAILED) from exc
            then = (f"resume: eagle3-console run --resume {run.root}" if getattr(exc, "resumable", True) else
                    f"a resume keeps this run's profile ({run.profile_path}): start a new run with it corrected")
            raise CliError(f"{first}\n  logs: {run.logs_dir}  {then}", EXIT_FAILED) from exc
        print_summary(run)
        return 0


class Attach(Command):
    name, help = "attach", "open the console on a running or finished run"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        add_console_flags(p)
        p.add_argument("run_dir")
        return p

    def cmd(self, args) -> int:
        from pipeline.layout.rundir import RunDir
        return attach(RunDir.open(Path(args.run_dir)).root, args.readonly, args.interval)


def detach_and_attach(run, args) -> int:
    """The console's way: the run becomes a detached job (its own session, output to logs/job.log);
    the console only watches it, so quitting or losing the terminal never stops it."""
    from pipeline.run import jobs

    if jobs.job_state(run)["state"] == "running":
        raise CliError(f"{run.root}: a job is already running it; use `eagle3-console attach {run.root}`")
    pid = jobs.start_detached(run, args.start, args.until)
    print(f"job started (pid {pid}); it keeps running if this console closes. "
          f"Re-attach with: eagle3-console attach {run.root}", flush=True)
    return attach(run.root, args.readonly, args.interval)


def attach(run_dir: Path, readonly: bool, interval: float) -> int:
    try:
        from console.app import main as console_main
    except ImportError as exc:
        raise CliError(f"the console needs textual ({exc}); use --no-tui") from exc
    if not sys.stdout.isatty():
        raise CliError("the console needs a terminal; use --no-tui, or `status` to read a run")
    return console_main(run_dir, readonly=readonly, interval=interval)


def print_summary(run) -> None:
    from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, HandoverResult
    from pipeline.report import notes
    ev, online, hand = (run.result(EvaluateOfflineResult), run.result(DeployMeasureResult),
                        run.result(HandoverResult))
    if ev.tau is not None:
        acc = " / ".join(f"{a:.2f}" for a in ev.acceptance_per_position)
        print(f"offline evaluation: tau = {ev.tau:.3f} (k={len(ev.acceptance_per_position)}, "
              f"per-position acceptance {acc}), lossless = {ev.lossless}")
    if online.mean_acceptance_length is not None:
        acc = " / ".join(f"{a:.2f}" for a in online.acceptance_per_position)
        print(f"vLLM: mean acceptance length {online.mean_acceptance_length:.3f} (per position {acc}), "
              f"{online.speculative_tok_s:.1f} vs {online.baseline_tok_s:.1f} tok/s baseline "
              f"(x{online.speedup}), outputs identical to baseline = {online.identical_outputs}"
              + (f" ({online.numeric_ties} apart at near-ties of the target's own: numerics, not the head)"
                 if not online.identical_outputs and online.numeric_ties else ""))
    if line := notes.ngram_comparison(ev, online):
        print(line)
    if decision := online.verdict():
        print(f"decision: {decision.line}")
    if why := notes.economics(online):
        print(f"why: {why}")
    if hand.server:
        print(f"serving port after the run: {hand.server} (server.after_run = {hand.after_run})")
    print(f"all stages done: {run.root}")
    if run.profile().name == "demo":
        print(f"next: the report        eagle3-console notes export {run.root} -o report.md\n"
              f"      the console       eagle3-console attach {run.root}\n"
              f"      your own target   copy profiles/base.toml (one GPU) or profiles/kimi-k2.5.toml, set\n"
              f"                        target.model_path, then: eagle3-console preflight YOUR.toml")
