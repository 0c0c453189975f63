"""`exporter`: runs and GPUs as Prometheus metrics, until SIGINT, SIGTERM or SIGHUP."""
from __future__ import annotations

from pathlib import Path

from pipeline.cli.base import CliError, Command


class Exporter(Command):
    name, help = "exporter", "runs and GPUs as Prometheus metrics (docs/grafana-eagle3.json)"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
        p.add_argument("--runs-dir", help="also every run under this directory, as they appear")
        p.add_argument("--port", type=int, default=9401, help="default 9401; 0 picks a free one")
        p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this host only)")
        return p

    def cmd(self, args) -> int:
        import signal
        import threading

        from prometheus_client import start_http_server

        from pipeline.layout.rundir import RunDir
        from pipeline.run import exporter

        runs = [RunDir.open(Path(p)).root for p in args.run_dirs]
        if args.runs_dir and not Path(args.runs_dir).is_dir():
            raise CliError(f"--runs-dir {args.runs_dir}: not a directory")
        if not 0 <= args.port <= 65535:
            raise CliError(f"--port {args.port}: not a port (0-65535; 0 picks a free one)")
        try:
            httpd, _ = start_http_server(args.port, addr=args.host, registry=exporter.registry(
                runs, Path(args.runs_dir) if args.runs_dir else None))
        except (OSError, ValueError) as exc:  # in use, an address this host does not have
            raise CliError(f"exporter on {args.host}:{args.port}: {getattr(exc, 'strerror', None) or exc}") from exc
        watched = [str(r) for r in runs] + ([f"every run under {Path(args.runs_dir).resolve()}"]
                                            if args.runs_dir else [])
        print(f"metrics on http://{args.host}:{httpd.server_port}/metrics: {', '.join(watched) or 'the GPUs only'}"
              + ("" if args.host in ("127.0.0.1", "localhost", "::1") else
                 f" (on {args.host}: anyone who reaches it reads the runs' paths and figures)"), flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        httpd.shutdown()
        return 0
