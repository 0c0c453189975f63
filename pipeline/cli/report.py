"""What a run tells its operator (pipeline/report/): its notes log and the report rendered from it (`notes add`,
`notes export`), and the chosen head handed over with its model card (`publish`)."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.cli.base import EXIT_FAILED, EXIT_USAGE, CliError, Command


class Notes(Command):
    name, help = "notes", "the run's notes log"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        nsub = p.add_subparsers(dest="notes_cmd", required=True)
        na = nsub.add_parser("add", help="append an operator note")
        na.add_argument("run_dir")
        na.add_argument("text")
        ne = nsub.add_parser("export", help="export notes as Markdown or JSON")
        ne.add_argument("run_dir")
        ne.add_argument("--format", choices=["md", "json"], default="md")
        ne.add_argument("-o", "--output")
        return p

    def errors(self) -> dict:
        return {ValueError: EXIT_USAGE, OSError: EXIT_FAILED}  # a RunDirError is a ValueError

    def line(self, exc: BaseException, args) -> str:
        return f"{exc.filename or args.run_dir}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)

    def cmd(self, args) -> int:
        from pipeline.layout.atomicio import atomic_write_rendered
        from pipeline.layout.rundir import RunDir
        from pipeline.report import notes
        from pipeline.run import jobs

        run = RunDir.open(Path(args.run_dir))
        if args.notes_cmd == "add":
            if not args.text.strip():
                raise CliError("note text is empty")
            print(f"noted at {notes.add(run, args.text)['ts']}")
        elif not args.output:
            sys.stdout.write(notes.export(run, args.format, jobs.snapshot(run)))
        else:
            out = Path(args.output)
            notes.check_destination(out)
            try:
                atomic_write_rendered(out, lambda: notes.export(run, args.format, jobs.snapshot(run), out).encode())
            except OSError as exc:
                raise CliError(f"-o {out}: cannot write it: {exc.strerror or exc}", EXIT_FAILED) from exc
            print(f"wrote {out}")
        return 0


class Publish(Command):
    name, help = "publish", "the chosen head with its model card and evaluation, as vLLM loads it"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        p.add_argument("run_dir")
        p.add_argument("out_dir", help="a new or empty directory")
        p.add_argument("--force", action="store_true", help="publish a head whose run did not decide deploy")
        return p

    def errors(self) -> dict:
        from pipeline.report.publish import PublishError
        return {PublishError: EXIT_USAGE, **super().errors()}

    def cmd(self, args) -> int:
        from pipeline.layout.rundir import RunDir
        from pipeline.report.publish import publish

        try:
            out = publish(RunDir.open(Path(args.run_dir)), Path(args.out_dir), force=args.force)
        except OSError as exc:
            raise CliError(f"{args.out_dir}: cannot write it: {exc.strerror or exc}", EXIT_FAILED) from exc
        print(f"published {out}: serve with the --speculative-config in {out / 'README.md'}")
        return 0
