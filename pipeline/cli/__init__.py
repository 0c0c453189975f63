"""eagle3-console command line. Every bad input is one line on stderr and a non-zero exit.

A subcommand is an object (base.Command) in a module of this package, its arguments beside its code; COMMANDS
lists them in the order --help shows them. main() runs one and, in one place, turns the errors it names into
`eagle3-console: error: ...` and the exit code."""
from __future__ import annotations

import argparse
import os
import sys

from pipeline.cli.base import CliError, Command
from pipeline.cli.exporter import Exporter
from pipeline.cli.profiles import Plan, Preflight, Schema
from pipeline.cli.report import Notes, Publish
from pipeline.cli.run import Attach, Run
from pipeline.cli.server import Server
from pipeline.cli.status import Status

COMMANDS: list[Command] = [Run(), Attach(), Status(), Notes(), Publish(), Exporter(), Server(), Plan(), Preflight(),
                           Schema()]

ENV_DEFAULTS = {
    # No hub at run time: models, tokenizers and data sets come from local paths only.
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Library progress bars would interleave with ours; the stage logs keep the detail.
    "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-console",
                                     description="Train, deploy and measure an EAGLE-3 draft head for a served target.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.subparser_init(sub).set_defaults(command=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    command: Command = args.command
    try:
        return command.cmd(args)
    except Exception as exc:
        code = exc.code if isinstance(exc, CliError) else next(
            (c for kinds, c in command.errors().items() if isinstance(exc, kinds)), None)
        if code is None and isinstance(exc, BrokenPipeError):  # `status RUN | head`: the reader left, no error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        if code is None:  # not one the command names: a bug, with its traceback
            raise
        print(f"eagle3-console: error: {command.line(exc, args)}", file=sys.stderr)
        for line in getattr(exc, "tail", []):  # a server that did not come up: its log's last lines
            print(f"  | {line}", file=sys.stderr)
        return code
