"""Crash-safe file writes: write-then-rename with fsync, and fsync'd JSON-lines appends.

Every file the pipeline records goes through here, so a SIGKILL at any moment leaves
either the old complete file or the new complete file, never a torn one.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

from pipeline.layout import tail


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_rendered(path: Path, render) -> None:
    """Write `render()`'s bytes to `path`, its temp file created first: a destination that cannot be
    written fails before anything is rendered (an export's plots, say). No directory is created."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(render())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_rendered(path, text.encode)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_write_with(path: Path, writer) -> None:
    """Let `writer(tmp_path)` produce the file (for libraries that only write to a path)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        writer(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line and fsync. A torn last line left by a crash is sealed off
    with a newline first, so it stays one unreadable line instead of corrupting this one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    with open(path, "ab+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
        fh.write(line.encode())
        fh.flush()
        os.fsync(fh.fileno())


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable (a reader that can do without it)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_jsonl_from(path: Path, offset: int) -> tuple[list, int]:
    """The records appended since byte `offset`, and where the next read starts: complete lines only (a
    torn tail waits for the next poll), unreadable ones skipped; nothing while the file is missing."""
    records: list = []
    for raw in tail.lines_from(path, offset):
        offset += len(raw)
        with suppress(json.JSONDecodeError):
            records.append(json.loads(raw))
    return records, offset


def read_jsonl(path: Path) -> list:
    """Complete records only: a torn line (crash mid-append) is skipped, never raised."""
    return read_jsonl_from(path, 0)[0]
