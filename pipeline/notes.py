"""The per-run notes log: append-only JSON lines, fsync'd on every append, never rewritten."""
from __future__ import annotations

import json
import os
import re

from pipeline import atomicio
from pipeline.rundir import RunDir, now_iso

# Secrets come from the environment; whatever their value, it never reaches a note.
_SECRET_ENV = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD)$")
_SECRET_TEXT = re.compile(r"(hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9-]{8,})")


def redact(text: str) -> str:
    for name, value in os.environ.items():
        if value and len(value) >= 6 and _SECRET_ENV.search(name):
            text = text.replace(value, f"<{name}>")
    return _SECRET_TEXT.sub("<redacted>", text)


def add(run: RunDir, text: str, *, source: str = "operator", stage: str | None = None,
        figures: dict | None = None) -> dict:
    record = {"ts": now_iso(), "source": source, "stage": stage, "text": redact(text)}
    if figures:
        record["figures"] = figures
    atomicio.append_jsonl(run.notes_path, record)
    return record


def read(run: RunDir) -> list[dict]:
    return list(atomicio.read_jsonl(run.notes_path))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def to_markdown(run: RunDir) -> str:
    profile = run.profile()
    state = run.read_state()
    lines = [f"# Run notes: {run.root.name}", "", f"- profile: `{profile.name}` {profile.description}".rstrip(),
             f"- run directory: `{run.root}`", f"- created: {state.get('created', '?')}", ""]
    stages = state.get("stages", {})
    if stages:
        lines += ["## Stages", "", "| stage | status | seconds | key figures |", "|---|---|---|---|"]
        for name, entry in stages.items():
            figs = ", ".join(f"{k}={_fmt(v)}" for k, v in (entry.get("figures") or {}).items())
            secs = entry.get("seconds")
            lines.append(f"| {name} | {entry.get('status', '?')} | {_fmt(secs) if secs is not None else ''} | {figs} |")
        lines.append("")
    lines += ["## Log", ""]
    for note in read(run):
        who = "operator" if note.get("source") == "operator" else (note.get("stage") or "pipeline")
        figs = note.get("figures")
        tail = f" ({', '.join(f'{k}={_fmt(v)}' for k, v in figs.items())})" if figs else ""
        lines.append(f"- `{note['ts']}` **{who}**: {note['text']}{tail}")
    return "\n".join(lines) + "\n"


def export(run: RunDir, fmt: str) -> str:
    if fmt == "md":
        return to_markdown(run)
    if fmt == "json":
        return json.dumps({"run": str(run.root), "state": run.read_state(), "notes": read(run)}, indent=2) + "\n"
    raise ValueError(f"unknown notes format {fmt!r} (md or json)")
