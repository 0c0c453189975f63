"""`status`: a run's state, stages and decision, for a person (the terminal's width) or as JSON."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.cli.base import Command


class Status(Command):
    name, help = "status", "show a run's stages"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        p.add_argument("run_dir")
        p.add_argument("--json", action="store_true")
        return p

    def cmd(self, args) -> int:
        from console import verdict  # the decision as the console's Run tab shows it (no Textual in it)
        from pipeline.layout import atomicio
        from pipeline.layout.rundir import RunDir
        from pipeline.run import jobs

        run = RunDir.open(Path(args.run_dir))
        snap = jobs.snapshot(run)
        decided = verdict.of_snapshot(snap, atomicio.read_json(run.online_result))
        if args.json:
            print(json.dumps({**snap.as_json(), "decision": decided}, indent=2))
            return 0
        hint = jobs.next_step(snap.state, run.root, snap.pid)
        width = max(60, shutil.get_terminal_size((100, 24)).columns)  # a pipe or a file: COLUMNS, else 100
        print(f"run {run.root}  (profile {snap.profile})")
        state = f"state: {snap.state}" + (f" ({hint})" if hint else "")
        # a command in the hint is copied as it is: on its own line rather than wrapped mid-command
        print(state if len(state) <= width or not hint else f"state: {snap.state}\n  {hint}")
        for r in snap.stages:
            secs = f"{r.seconds:>8.1f}s" if r.seconds is not None else " " * 9
            row = f"  {r.name:<18} {r.status:<11} {secs}"
            skipped = r.figures.get("skipped")  # a stage the run did without (evaluate.existing_policy = deploy)
            extra = r.error or (f"skipped: {skipped}" if isinstance(skipped, str) else
                                ", ".join(f"{k}={v}" for k, v in r.figures.items()
                                          if isinstance(v, (int, float)) and not isinstance(v, bool)))
            if len(row) + 2 + len(extra) <= width:
                print(f"{row}  {extra}".rstrip())
            else:  # below the row, the terminal's width: more of them than beside it
                print(f"{row}\n    {wrapped(extra, 4, width, 'status --json has them all')}")
        for peer in snap.peers:
            print(peer.line())
        if decided:
            print(f"decision: {wrapped(decided['line'], 10, width)}")
            if figures := verdict.figures_line(decided, plain=True):
                print("  " + wrapped(figures, 2, width))
            if decided.get("why"):
                print(f"why: {wrapped(decided['why'], 5, width)}")
        return 0


def wrapped(text: str, indent: int, width: int, more: str = "") -> str:
    """`text` wrapped to `width` under a first line that starts at column `indent`; with `more`, at most
    three lines (a stage's figures, an error of 600 characters), the last saying where the rest is. A word
    longer than the line (a path) is left whole."""
    import textwrap
    lines = textwrap.wrap(text, max(20, width - indent), max_lines=3 if more else None,
                          placeholder=f" … ({more})" if more else " […]", break_on_hyphens=False,
                          break_long_words=False)  # a path stays whole, to copy
    return ("\n" + " " * indent).join(lines)
