"""speculators 0.9.0 logs through loguru, whose default sink is this process's stderr: while a stage
runs speculators code in-process (evaluate-offline loading the draft, vocab), its INFO/WARNING lines
would land in the operator's headless progress output. Here they go to the stage's own log instead.
Applies to speculators 0.9.0 (tests/test_compat.py fails if its modules stop logging through loguru).

Its `speculators train` subprocess logs metrics through rich (`setup_root_logger`'s RichHandler), which
wraps a line at the console's width, 80 columns when stderr is a pipe: the "key=value" metric pairs the
train stage parses would be split over lines. Its environment gets COLUMNS (RICH_COLUMNS) wide enough for
one line (pipeline/procs.py child_env). speculators 0.9.0 with rich as installed;
tests/test_compat_adaptations.py fails when the trainer stops logging through a RichHandler or rich stops
taking its width from COLUMNS."""
from __future__ import annotations

import contextlib
import logging
import sys

RICH_COLUMNS = "1000"  # COLUMNS for speculators' subprocesses: one metrics line stays one line


@contextlib.contextmanager
def into(log: logging.Logger):
    """Route loguru's records to `log` for the duration; stderr gets loguru's default sink back after."""
    try:
        from loguru import logger
    except ImportError:  # no loguru: nothing logs through it
        yield
        return
    logger.remove()
    sink = logger.add(lambda m: log.log(m.record["level"].no, "%s: %s", m.record["name"], m.record["message"]),
                      level="INFO", format="{message}")
    try:
        yield
    finally:
        logger.remove(sink)
        logger.add(sys.stderr)
