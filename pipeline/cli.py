"""eagle3-console command line. Every bad input is one line on stderr and a non-zero exit."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_FAILED, EXIT_USAGE = 1, 2


def _die(message: str, code: int = EXIT_USAGE) -> int:
    print(f"eagle3-console: error: {message}", file=sys.stderr)
    return code


ENV_DEFAULTS = {
    # No hub at run time: models, tokenizers and data sets come from local paths only.
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Library progress bars would interleave with ours; the stage logs keep the detail.
    "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
}


def cmd_run(args) -> int:
    from pipeline.profile import ProfileError, load_profile
    from pipeline.progress import ProgressPrinter
    from pipeline.rundir import RunDir, RunDirError
    from pipeline.runner import Interrupted, RunnerError, run_stages, select

    run = None
    try:
        if args.resume:
            if args.profile:
                return _die("give either PROFILE or --resume RUN_DIR, not both")
            if args.set or args.copy_of:
                what = f"--set {args.set[0]}" if args.set else f"--copy-of {args.copy_of}"
                return _die(f"{what}: a resumed run keeps the profile and the files it was created with "
                            f"({Path(args.resume) / 'profile.toml'}); start a new run to change it "
                            f"(run --copy-of {args.resume} --from STAGE --set ...)")
            run = RunDir.open(Path(args.resume))
            profile = run.profile()
        elif args.copy_of:
            from pipeline.runcopy import copy_of
            if not args.start:
                return _die(f"--copy-of {args.copy_of}: say where the new run starts (--from STAGE)")
            source = RunDir.open(Path(args.copy_of))
            profile = load_profile(args.profile or source.profile_path, _overrides(args.set))
            select(profile, args.start, args.until)
            run, copied = copy_of(source.root, profile, args.start, Path(args.run_dir) if args.run_dir else None)
            print(copied.line(source.root), flush=True)
        else:
            if not args.profile:
                return _die("PROFILE is required (or --resume RUN_DIR)")
            profile = load_profile(args.profile, _overrides(args.set))
            select(profile, args.start, args.until)  # validate the range before creating anything
            run = RunDir.create(profile, Path(args.run_dir) if args.run_dir else None)
        os.environ.setdefault("HF_HOME", str(run.cache_root / "hf"))
        print(f"run directory: {run.root}", flush=True)
        if not args.no_tui:
            return _detach_and_attach(run, args)
        run_stages(run, args.start, args.until, on_event=ProgressPrinter())
    except (ProfileError, RunDirError, RunnerError) as exc:
        return _die(str(exc))
    except (KeyboardInterrupt, Interrupted) as exc:
        why = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        return _die(f"interrupted ({why})" + (f"; resume with: eagle3-console run --resume {run.root}" if run else ""),
                    130 if isinstance(exc, KeyboardInterrupt) else 143)
    except Exception as exc:  # noqa: BLE001 - the stage already recorded it; one line here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if run is None:
            return _die(first, EXIT_FAILED)
        then = (f"resume: eagle3-console run --resume {run.root}" if getattr(exc, "resumable", True) else
                f"a resume keeps this run's profile ({run.profile_path}): start a new run with it corrected")
        return _die(f"{first}\n  logs: {run.logs_dir}  {then}", EXIT_FAILED)
    _print_summary(run)
    return 0


def _detach_and_attach(run, args) -> int:
    """The console's way: the run becomes a detached job (its own session, output to logs/job.log);
    the console only watches it, so quitting or losing the terminal never stops it."""
    from pipeline import jobs

    if jobs.job_state(run)["state"] == "running":
        return _die(f"{run.root}: a job is already running it; use `eagle3-console attach {run.root}`")
    pid = jobs.start_detached(run, args.start, args.until)
    print(f"job started (pid {pid}); it keeps running if this console closes. "
          f"Re-attach with: eagle3-console attach {run.root}", flush=True)
    return _attach(run.root, args.readonly, args.interval)


def _attach(run_dir: Path, readonly: bool, interval: float) -> int:
    try:
        from console.app import main as console_main
    except ImportError as exc:
        return _die(f"the console needs textual ({exc}); use --no-tui")
    if not sys.stdout.isatty():
        return _die("the console needs a terminal; use --no-tui, or `status` to read a run")
    return console_main(run_dir, readonly=readonly, interval=interval)


def cmd_attach(args) -> int:
    from pipeline.rundir import RunDir
    return _attach(RunDir.open(Path(args.run_dir)).root, args.readonly, args.interval)


def _overrides(pairs: list[str]) -> dict:
    """`--set train.epochs=3`: the value is read as TOML (numbers, booleans, lists), else a string."""
    import tomllib

    from pipeline.profile import ProfileError

    out = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ProfileError(f"--set {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def _print_summary(run) -> None:
    from pipeline import notes
    from pipeline.results import DeployMeasureResult, EvaluateOfflineResult, HandoverResult
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
              f"(x{online.speedup}), outputs identical to baseline = {online.identical_outputs}")
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


def cmd_exporter(args) -> int:
    import signal
    import threading

    from prometheus_client import start_http_server

    from pipeline import exporter
    from pipeline.rundir import RunDir

    runs = [RunDir.open(Path(p)).root for p in args.run_dirs]
    if args.runs_dir and not Path(args.runs_dir).is_dir():
        return _die(f"--runs-dir {args.runs_dir}: not a directory")
    if not 0 <= args.port <= 65535:
        return _die(f"--port {args.port}: not a port (0-65535; 0 picks a free one)")
    try:
        httpd, _ = start_http_server(args.port, addr=args.host,
                                     registry=exporter.registry(runs, Path(args.runs_dir) if args.runs_dir else None))
    except (OSError, ValueError) as exc:  # in use, an address this host does not have
        return _die(f"exporter on {args.host}:{args.port}: {getattr(exc, 'strerror', None) or exc}")
    watched = [str(r) for r in runs] + ([f"every run under {Path(args.runs_dir).resolve()}"] if args.runs_dir else [])
    print(f"metrics on http://{args.host}:{httpd.server_port}/metrics: {', '.join(watched) or 'the GPUs only'}"
          + ("" if args.host in ("127.0.0.1", "localhost", "::1") else
             f" (on {args.host}: anyone who reaches it reads the runs' paths and figures)"), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    httpd.shutdown()
    return 0


def cmd_publish(args) -> int:
    from pipeline.publish import PublishError, publish
    from pipeline.rundir import RunDir

    try:
        out = publish(RunDir.open(Path(args.run_dir)), Path(args.out_dir), force=args.force)
    except PublishError as exc:
        return _die(str(exc))
    except OSError as exc:
        return _die(f"{args.out_dir}: cannot write it: {exc.strerror or exc}", EXIT_FAILED)
    print(f"published {out}: serve with the --speculative-config in {out / 'README.md'}")
    return 0


def cmd_status(args) -> int:
    from console import verdict  # the decision as the console's Run tab shows it (no Textual in it)
    from pipeline import atomicio, jobs
    from pipeline.rundir import RunDir

    run = RunDir.open(Path(args.run_dir))
    snap = jobs.snapshot(run)
    decided = verdict.of_snapshot(snap, atomicio.read_json(run.online_result))
    if args.json:
        print(json.dumps({**snap.as_json(), "decision": decided}, indent=2))
        return 0
    hint = jobs.next_step(snap.state, run.root, snap.pid)
    width = max(60, shutil_columns())
    print(f"run {run.root}  (profile {snap.profile})")
    state = f"state: {snap.state}" + (f" ({hint})" if hint else "")
    # a command in the hint is copied as it is: on its own line rather than wrapped mid-command
    print(state if len(state) <= width or not hint else f"state: {snap.state}\n  {hint}")
    for r in snap.stages:
        secs = f"{r.seconds:>8.1f}s" if r.seconds is not None else " " * 9
        row = f"  {r.name:<18} {r.status:<11} {secs}"
        extra = r.error or ", ".join(f"{k}={v}" for k, v in r.figures.items()
                                     if isinstance(v, (int, float)) and not isinstance(v, bool))
        if len(row) + 2 + len(extra) <= width:
            print(f"{row}  {extra}".rstrip())
        else:  # below the row, the terminal's width: more of them than beside it
            print(f"{row}\n    {_wrapped(extra, 4, width, 'status --json has them all')}")
    for peer in snap.peers:
        print(peer.line())
    if decided:
        print(f"decision: {_wrapped(decided['line'], 10, width)}")
        if figures := verdict.figures_line(decided, plain=True):
            print("  " + _wrapped(figures, 2, width))
        if decided.get("why"):
            print(f"why: {_wrapped(decided['why'], 5, width)}")
    return 0


def shutil_columns() -> int:
    """The terminal's width; a pipe or a file: COLUMNS, else 100."""
    import shutil
    return shutil.get_terminal_size((100, 24)).columns


def _wrapped(text: str, indent: int, width: int, more: str = "") -> str:
    """`text` wrapped to `width` under a first line that starts at column `indent`; with `more`, at most
    three lines (a stage's figures, an error of 600 characters), the last saying where the rest is. A word
    longer than the line (a path) is left whole."""
    import textwrap
    lines = textwrap.wrap(text, max(20, width - indent), max_lines=3 if more else None,
                          placeholder=f" … ({more})" if more else " […]", break_on_hyphens=False,
                          break_long_words=False)  # a path stays whole, to copy
    return ("\n" + " " * indent).join(lines)


def cmd_notes(args) -> int:
    from pipeline import jobs, notes
    from pipeline.atomicio import atomic_write_rendered
    from pipeline.rundir import RunDir

    try:
        run = RunDir.open(Path(args.run_dir))
        if args.notes_cmd == "add":
            if not args.text.strip():
                return _die("note text is empty")
            print(f"noted at {notes.add(run, args.text)['ts']}")
        elif not args.output:
            sys.stdout.write(notes.export(run, args.format, jobs.snapshot(run)))
        else:
            out = Path(args.output)
            notes.check_destination(out)
            try:
                atomic_write_rendered(out, lambda: notes.export(run, args.format, jobs.snapshot(run), out).encode())
            except OSError as exc:
                return _die(f"-o {out}: cannot write it: {exc.strerror or exc}", EXIT_FAILED)
            print(f"wrote {out}")
        return 0
    except ValueError as exc:  # a RunDirError too
        return _die(str(exc))
    except OSError as exc:
        return _die(f"{exc.filename or args.run_dir}: {exc.strerror or exc}", EXIT_FAILED)


def _server_profile(args):
    """The profile a server command acts on. With --run-dir it is the run's own (its port, its
    server); a PROFILE given too must serve the same port."""
    from pipeline.profile import ProfileError, load_profile
    from pipeline.rundir import RunDir

    run = RunDir.open(Path(args.run_dir)) if args.run_dir else None
    if run is None and not args.profile:
        raise ProfileError("give a PROFILE or --run-dir RUN_DIR")
    profile = load_profile(args.profile or run.profile_path, _overrides(args.set))
    if run is not None and profile.server.port != (port := run.profile().server.port):
        raise ProfileError(f"server.port {profile.server.port} is not the port of run {run.root} ({port}): "
                           f"a server command with --run-dir acts on that run's server")
    return run, profile


def _server_status_text(status: dict, holder: dict | None) -> str:
    """`server status` for a person: the state line, then the argv and the run holding the port."""
    shown = " ".join(f"{k}={v}" for k, v in status.items() if k not in ("argv", "held_by"))
    argv = status.get("argv")
    lines = [shown] + ([f"argv: {argv if isinstance(argv, str) else ' '.join(argv)}"] if argv else [])
    if status.get("state") == "unrecorded":
        lines.append("no record names this listener: `server adopt` records it (if it is vLLM), "
                     "`server stop --force` stops it")
    if holder:
        lines.append(f"held by run {holder.get('run', '?')} (pid {holder.get('pid', '?')}, user "
                     f"{holder.get('user', '?')}): its stages use the port")
    return "\n".join(lines)


def cmd_server(args) -> int:
    from pipeline import box, portlock
    from pipeline.rundir import NotBuilt
    from pipeline.server import ServerError
    from pipeline.stages.base import StageError

    try:
        run, profile = _server_profile(args)
        # records an older version left in this folder move host-wide first, said on stderr
        box.migrate(profile, lambda line: print(f"eagle3-console: {line}", file=sys.stderr))
        if args.server_cmd == "status":
            status = box.controller(profile).status()
            holder = portlock.holder(profile)
            if args.json:
                print(json.dumps({**status, **({"held_by": holder} if holder else {})}, indent=2))
            else:
                print(_server_status_text(status, holder))
            return 0
        box.guard(profile, args.force)  # before anything else: the port may be another run's
        if args.server_cmd == "stop":
            print("stopped" if box.free_port(profile, print, force=args.force, by="eagle3-console server stop")
                  else f"no vLLM server on port {profile.server.port}")
        elif args.server_cmd == "adopt":
            rec = box.adopt(profile, force=args.force)
            print(f"adopted vLLM pid {rec.pid} (process group {rec.pgid}) on port {rec.port}: {' '.join(rec.argv)}")
        else:
            target_dir, mode_args = box.mode_inputs(profile, run, args.mode, args.draft, args.storage)
            logs = (run.logs_dir if run else Path(profile.run.runs_dir).resolve() / ".servers")
            rec = box.start_mode(profile, args.mode, target_dir, log_path=logs / f"server-{args.mode}.log",
                                 cache_root=run.cache_root if run else Path(profile.run.cache_dir).resolve() / ".cache",
                                 say=print, force=args.force, by=f"eagle3-console server start --mode {args.mode}",
                                 **mode_args)
            print(f"{args.mode} server healthy: pid {rec.pid}, {rec.base_url}, log {rec.log}")
        return 0
    except (ServerError, StageError, portlock.PortTaken, ValueError) as exc:  # ProfileError, RunDirError: ValueErrors
        failed = (ServerError, StageError, NotBuilt, portlock.PortTaken)
        code = _die(str(exc), EXIT_FAILED if isinstance(exc, failed) else EXIT_USAGE)
        for line in getattr(exc, "tail", []):
            print(f"  | {line}", file=sys.stderr)
        return code
    except OSError as exc:  # a registry or log file this user cannot write
        return _die(f"{exc.filename or 'server'}: {exc.strerror or exc}", EXIT_FAILED)


def cmd_plan(args) -> int:
    from pipeline import plan
    from pipeline.profile import ProfileError, load_profile
    from pipeline.targetinfo import TargetInfoError
    try:
        profiles = [load_profile(p, _overrides(args.set), check_inputs=False) for p in args.profiles]
        # planned for the box each profile is written for (its disk), not for this machine
        plans = [plan.make_plan(p, free=int(p.hardware.disk_gib * plan.GIB) if p.hardware.disk_gib else None)
                 for p in profiles]
    except (ProfileError, TargetInfoError) as exc:
        return _die(str(exc))
    print(json.dumps([p.to_dict() for p in plans], indent=1) if args.json else plan.table(plans))
    return 0


def cmd_preflight(args) -> int:
    from pipeline import preflight
    from pipeline.profile import ProfileError, load_profile
    try:
        profile = load_profile(args.profile, _overrides(args.set), check_inputs=False)
    except ProfileError as exc:
        return _die(str(exc))
    findings = preflight.preflight(profile)
    print(preflight.to_json(findings) if args.json else "\n".join(f.line() for f in findings))
    blocked = preflight.blocking(findings)
    if blocked and not args.json:
        print(f"{len(blocked)} blocking finding(s): a run of this profile would stop here", file=sys.stderr)
    return EXIT_FAILED if blocked else 0


def build_parser() -> argparse.ArgumentParser:
    from pipeline.stages import stage_names

    parser = argparse.ArgumentParser(prog="eagle3-console",
                                     description="Train, deploy and measure an EAGLE-3 draft head for a served target.")
    sub = parser.add_subparsers(dest="cmd", required=True)  # the command NAME runs cmd_NAME
    run = sub.add_parser("run", help="run (or resume) the pipeline")
    run.add_argument("profile", nargs="?", help="profile TOML file or name in profiles/")
    run.add_argument("--resume", metavar="RUN_DIR", help="finish an existing run")
    run.add_argument("--run-dir", help="where to create the run (default runs/<profile>-<UTC time>)")
    run.add_argument("--copy-of", metavar="RUN_DIR",
                     help="a new run starting from RUN_DIR's stages before --from (linked or copied); "
                          "PROFILE defaults to RUN_DIR's, --set changes it")
    run.add_argument("--from", dest="start", metavar="STAGE", help=f"first stage ({', '.join(stage_names())})")
    run.add_argument("--until", metavar="STAGE", help="last stage")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a profile value, e.g. --set train.epochs=3 (repeatable)")
    run.add_argument("--no-tui", action="store_true", help="headless: progress on stdout")
    for p in (run, at := sub.add_parser("attach", help="open the console on a running or finished run")):
        p.add_argument("--readonly", action="store_true", help="show only: every control disabled")
        p.add_argument("--interval", type=float, default=1.0, help="GPU sampling period in seconds (>= 0.25)")
    at.add_argument("run_dir")
    st = sub.add_parser("status", help="show a run's stages")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true")
    nt = sub.add_parser("notes", help="the run's notes log")
    nsub = nt.add_subparsers(dest="notes_cmd", required=True)
    na = nsub.add_parser("add", help="append an operator note")
    na.add_argument("run_dir")
    na.add_argument("text")
    ne = nsub.add_parser("export", help="export notes as Markdown or JSON")
    ne.add_argument("run_dir")
    ne.add_argument("--format", choices=["md", "json"], default="md")
    ne.add_argument("-o", "--output")
    pb = sub.add_parser("publish", help="the chosen head with its model card and evaluation, as vLLM loads it")
    pb.add_argument("run_dir")
    pb.add_argument("out_dir", help="a new or empty directory")
    pb.add_argument("--force", action="store_true", help="publish a head whose run did not decide deploy")
    ex = sub.add_parser("exporter", help="runs and GPUs as Prometheus metrics (docs/grafana-eagle3.json)")
    ex.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    ex.add_argument("--runs-dir", help="also every run under this directory, as they appear")
    ex.add_argument("--port", type=int, default=9401, help="default 9401; 0 picks a free one")
    ex.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this host only)")
    sv = sub.add_parser("server", help="start, stop, adopt or inspect the vLLM server of a profile's port")
    ssub = sv.add_subparsers(dest="server_cmd", required=True)
    for name, text in (("start", "start vLLM in a mode (stops what serves the port first)"),
                       ("stop", "stop the vLLM serving the port (by process group)"),
                       ("status", "state, mode, pids, port, health, uptime"),
                       ("adopt", "take over a vLLM this tool did not start")):
        sp = ssub.add_parser(name, help=text)
        sp.add_argument("profile", nargs="?", help="profile (default: the run's, with --run-dir)")
        sp.add_argument("--run-dir", help="a run: its port, target, draft and log directory")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a profile value")
        if name == "status":
            sp.add_argument("--json", action="store_true")
        else:
            sp.add_argument("--force", action="store_true",
                            help="act even while a run in progress holds the port or owns its server (pulls it "
                                 "from under it), and stop a vLLM that no record names")
        if name == "start":
            from pipeline.vllm_modes import MODES
            sp.add_argument("--mode", choices=MODES, default="production")
            sp.add_argument("--draft", help="published draft directory (speculative / production with draft)")
            sp.add_argument("--storage", help="hidden-state directory (extraction)")
    pl = sub.add_parser("plan", help="disk, GPU memory, time and GPU-hours of profiles, side by side")
    pl.add_argument("profiles", nargs="+", metavar="PROFILE")
    pf = sub.add_parser("preflight", help="check target, versions, GPUs, port and disk before a run")
    pf.add_argument("profile")
    for p in (pl, pf):
        p.add_argument("--json", action="store_true")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a profile value")
    sub.add_parser("schema", help="the profile's JSON schema (for editors; docs/profile.schema.json)")
    return parser


def cmd_schema(args) -> int:
    from pipeline.profile import json_schema
    sys.stdout.write(json_schema())
    return 0


def main(argv: list[str] | None = None) -> int:
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    from pipeline.rundir import RunDirError
    try:
        return globals()[f"cmd_{args.cmd.replace('-', '_')}"](args)
    except RunDirError as exc:  # RUN_DIR is not a run: one line, as any bad input
        return _die(str(exc))
    except BrokenPipeError:  # `status RUN | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
