"""The one polling loop: ask again every `every` seconds until the answer is truthy or `timeout` passes.
A condition may raise to end the wait early (a process that exited while it was waited for)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, every: float = 0.2) -> T:
    """The first truthy answer of `condition`, or its last (falsy) answer once `timeout` seconds passed;
    it is always asked at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        answer = condition()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))
