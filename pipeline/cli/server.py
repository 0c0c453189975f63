"""`server start|stop|status|adopt`: the vLLM server of a profile's port, or of a run's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.cli.base import EXIT_FAILED, EXIT_USAGE, Command, overrides


class Server(Command):
    name, help = "server", "start, stop, adopt or inspect the vLLM server of a profile's port"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        ssub = p.add_subparsers(dest="server_cmd", required=True)
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
                from pipeline.serving.vllm_modes import MODES
                sp.add_argument("--mode", choices=MODES, default="production")
                sp.add_argument("--draft", help="published draft directory (speculative / production with draft)")
                sp.add_argument("--storage", help="hidden-state directory (extraction)")
        return p

    def errors(self) -> dict:
        from pipeline.host.portlock import PortTaken
        from pipeline.layout.rundir import NotBuilt
        from pipeline.serving.server import ServerError
        from pipeline.stages.base import StageError
        # ProfileError, RunDirError: ValueErrors; OSError: a registry or log file this user cannot write
        return {(ServerError, StageError, NotBuilt, PortTaken): EXIT_FAILED, ValueError: EXIT_USAGE,
                OSError: EXIT_FAILED}

    def line(self, exc: BaseException, args) -> str:
        return f"{exc.filename or 'server'}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)

    def cmd(self, args) -> int:
        from pipeline.host import portlock
        from pipeline.serving import ports

        run, profile = server_profile(args)
        # records an older version left in this folder move host-wide first, said on stderr
        ports.migrate(profile, lambda line: print(f"eagle3-console: {line}", file=sys.stderr))
        if args.server_cmd == "status":
            status = ports.controller(profile).status()
            holder = portlock.holder(profile)
            if args.json:
                print(json.dumps({**status, **({"held_by": holder} if holder else {})}, indent=2))
            else:
                print(status_text(status, holder))
            return 0
        ports.guard(profile, args.force)  # before anything else: the port may be another run's
        if args.server_cmd == "stop":
            stopped = ports.stop_server_on_port(profile, print, force=args.force, by="eagle3-console server stop")
            print("stopped" if stopped else f"no vLLM server on port {profile.server.port}")
        elif args.server_cmd == "adopt":
            rec = ports.adopt(profile, force=args.force)
            print(f"adopted vLLM pid {rec.pid} (process group {rec.pgid}) on port {rec.port}: {' '.join(rec.argv)}")
        else:
            rec = ports.start_server(profile, run, args.mode, say=print, force=args.force, draft=args.draft,
                                     storage=args.storage, by=f"eagle3-console server start --mode {args.mode}")
            print(f"{args.mode} server healthy: pid {rec.pid}, {rec.base_url}, log {rec.log}")
        return 0


def server_profile(args):
    """The profile a server command acts on. With --run-dir it is the run's own (its port, its
    server); a PROFILE given too must serve the same port."""
    from pipeline.layout.rundir import RunDir
    from pipeline.profile import ProfileError, load_profile

    run = RunDir.open(Path(args.run_dir)) if args.run_dir else None
    if run is None and not args.profile:
        raise ProfileError("give a PROFILE or --run-dir RUN_DIR")
    profile = load_profile(args.profile or run.profile_path, overrides(args.set),
                           held=run.held() if run is not None and not args.profile else ())
    if run is not None and profile.server.port != (port := run.profile().server.port):
        raise ProfileError(f"server.port {profile.server.port} is not the port of run {run.root} ({port}): "
                           f"a server command with --run-dir acts on that run's server")
    return run, profile


def status_text(status: dict, holder: dict | None) -> str:
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
