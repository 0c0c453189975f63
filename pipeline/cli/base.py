"""What a subcommand is (Command), a failure in its own words (CliError), `--set` read as profile overrides."""
from __future__ import annotations

import argparse

EXIT_FAILED, EXIT_USAGE = 1, 2


class CliError(Exception):
    """A failure the command words itself: main() prints `eagle3-console: error: MESSAGE` and exits with `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


class Command:
    """A subcommand: `name` and `help` in the parser, the arguments it adds (subparser_init), what it does (cmd,
    returning the exit code), and the errors it names (errors: type → exit code, the first that matches), which
    main() says in one line (line) rather than as a traceback."""
    name = help = ""

    def subparser_init(self, subparsers) -> argparse.ArgumentParser:
        return subparsers.add_parser(self.name, help=self.help)

    def cmd(self, args) -> int:
        raise NotImplementedError

    def errors(self) -> dict:
        """Every command: a RUN_DIR that is not a run is bad input."""
        from pipeline.layout.rundir import RunDirError
        return {RunDirError: EXIT_USAGE}

    def line(self, exc: BaseException, args) -> str:
        return str(exc)


def overrides(pairs: list[str]) -> dict:
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
