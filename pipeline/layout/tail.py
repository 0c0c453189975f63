"""The one reader of growing files: the complete lines appended since a byte offset (a torn last line waits
for the next read), and the follower of a log that may be replaced or truncated under it (the console's
pager). The run's event and note files and speculators' regenerated rows (`atomicio.read_jsonl_from`) and the
console's logs are read through it; a stopped child's log is read whole (`host/procs.read_log`)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def lines_from(path: Path, offset: int, limit_bytes: int | None = None) -> Iterator[bytes]:
    """The complete lines after byte `offset`, each with its newline; nothing while the file is missing.
    With `limit_bytes` no more than that is read, and a line longer than the limit comes cut at it (a
    follower must move on past it)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        fh.seek(offset)
        if limit_bytes is None:
            for raw in fh:  # one line at a time: a large rows file is never held whole
                if not raw.endswith(b"\n"):
                    return
                yield raw
            return
        data = fh.read(limit_bytes)
    end = data.rfind(b"\n") + 1 or (len(data) if len(data) >= limit_bytes else 0)
    yield from data[:end].splitlines(keepends=True)


class LogTailer:
    """New lines of a growing log since the last call, terminal codes stripped. A new, replaced or truncated
    file starts over, at most `limit_bytes` before its end and at a line's start."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._inode: int | None = None

    def new_lines(self, limit_bytes: int = 1 << 20) -> list[str]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset = st.st_ino, self._line_start(max(0, st.st_size - limit_bytes), limit_bytes)
        lines = list(lines_from(self.path, self._offset, limit_bytes))
        self._offset += sum(map(len, lines))
        return [_ANSI.sub("", line) for line in b"".join(lines).decode(errors="replace").splitlines()]

    def _line_start(self, offset: int, limit_bytes: int) -> int:
        """`offset`, or past the fragment of a line it falls inside (none found within the limit: `offset`)."""
        if offset == 0:
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(offset - 1)
            if fh.read(1) == b"\n":
                return offset
            newline = fh.read(limit_bytes).find(b"\n")
        return offset + newline + 1 if newline >= 0 else offset
