"""speculators 0.9.0 logs through loguru, whose default sink is this process's stderr: while a stage
runs speculators code in-process (evaluate-offline loading the draft, vocab), its INFO/WARNING lines
would land in the operator's headless progress output. Here they go to the stage's own log instead.
Applies to speculators 0.9.0 (tests/test_compat.py fails if its modules stop logging through loguru).
(The `speculators train` subprocess's metrics do not come through here, nor through its rich console
lines: speculators_compat forwards its metric records as JSON lines.)"""
from __future__ import annotations

import contextlib
import logging
import sys


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
