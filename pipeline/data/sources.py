"""Where the conversations come from: the demo generator, local JSONL files, speculators' dataset presets
(read through speculators' own registry and row normalization), or a mix of them with a limit each.

A single local file is read where it is. Anything else is gathered once per run into
`data/conversations.jsonl` (a mix shuffled with data.seed, so that the held-out prompts, the file's last
rows, come from every source), beside `data/conversations.sources.json`, which records the spec it was
gathered for and what each source gave."""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from pipeline.compat import speculators_presets
from pipeline.data import conversations
from pipeline.layout import atomicio
from pipeline.profile import DataSection, DataSource, source_kind

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class SourceError(RuntimeError):
    """A source that cannot be read: the message names it."""


def spec_digest(data: DataSection) -> str:
    blob = json.dumps([s.model_dump() for s in data.sources()] + [data.seed, data.num_conversations], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gathered(data: DataSection) -> bool:
    """Whether the conversations are gathered into the run (not one local file, not the demo alone)."""
    return data.single_file() is None and data.conversations != "demo"


def _preset_rows(src: DataSource) -> Iterator[dict]:
    """The preset's rows as speculators reads them: its registered dataset, split and subset, its filter
    and its normalization (docs/reference.md §9), streamed (only `limit` rows are read)."""
    from datasets import load_dataset

    config = speculators_presets.configs()[src.source]
    dataset = load_dataset(config.hf_path, name=src.subset or config.subset, split=src.split or config.split,
                           streaming=True)
    for row in dataset:
        if config.filter_fn is not None and not config.filter_fn(row):
            continue
        yield {**row, **config.normalize_fn(row)} if config.normalize_fn else row


def _messages(row: dict) -> list[dict] | None:
    """A preset row's conversation in this project's form (role/content), None when it has none or uses
    tools (the trainer's rows here are text turns)."""
    turns = row.get("messages") or row.get("conversations")
    if not isinstance(turns, list) or row.get("tools"):
        return None
    out = []
    for m in turns:
        if not isinstance(m, dict):
            return None
        role = ROLE.get(str(m.get("role") or m.get("from")))
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out


def _row_id(row: dict) -> str:
    """A stable id, as speculators' regenerate-responses keys its resume: id/uuid, else a content hash."""
    for key in ("id", "uuid"):
        if row.get(key) not in (None, ""):
            return str(row[key])
    return "hash_" + hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_source(src: DataSource, demo_file: Path) -> tuple[list[dict], int]:
    """(rows, skipped): up to src.limit rows of one source, conversations as {"id", "messages"} and
    pre-tokenized rows as {"input_ids", "loss_mask"}."""
    kind = source_kind(src.source)
    limit = src.limit or None
    if kind in ("demo", "file"):
        try:
            loaded = conversations.load(demo_file if kind == "demo" else Path(src.source))
        except FileNotFoundError as exc:
            raise SourceError(str(exc)) from None
        rows = [{"id": c["id"], "messages": c["messages"]} for c in loaded.conversations] + loaded.token_rows
        return rows[:limit], len(loaded.bad)
    rows, skipped = [], 0
    try:
        for row in _preset_rows(src):
            messages = _messages(row)
            if messages is None or conversations.check_messages(messages) is not None:
                skipped += 1
                continue
            rows.append({"id": _row_id(row), "messages": messages})
            if limit and len(rows) >= limit:
                break
    except Exception as exc:  # noqa: BLE001 - datasets' offline/hub errors come in many types
        raise SourceError(f"data.conversations: preset {src.source!r} cannot be read: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return rows, skipped


def gather(data: DataSection, demo_file: Path, out: Path, record: Path) -> dict:
    """Write the run's conversations from every source (kept when already gathered for this spec);
    returns what each source gave."""
    digest = spec_digest(data)
    if (done := atomicio.read_json(record)) and done.get("digest") == digest and out.is_file():
        return done["sources"]
    everything, counts = [], {}
    several = len(data.sources()) > 1
    for i, src in enumerate(data.sources()):
        rows, skipped = read_source(src, demo_file)
        name = src.source if source_kind(src.source) != "file" else Path(src.source).name
        for row in rows:
            if several and "id" in row:  # ids stay unique across sources
                row["id"] = f"{i}:{name}:{row['id']}"
            if several:  # held out from every source, τ reported per source (conversations.split_heldout)
                row["source"] = f"{i}:{name}"
        everything += rows
        counts[f"{i}:{name}" if several else name] = {"rows": len(rows), "skipped": skipped}
    if several:
        random.Random(data.seed).shuffle(everything)
    atomicio.atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in everything))
    atomicio.atomic_write_json(record, {"digest": digest, "sources": counts})
    return counts


def offline_problem(src: DataSource) -> str | None:
    """Why a preset cannot be read on this machine now (no network and not cached, …), None when its
    first row reads: preflight asks before any GPU work."""
    if source_kind(src.source) != "preset":
        return None
    try:
        next(iter(_preset_rows(src)), None)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return None
