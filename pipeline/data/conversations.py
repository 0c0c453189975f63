"""Reading the operator's data: chat conversations or pre-tokenized rows, one JSON object per line.

Accepted rows: {"messages": [{"role", "content"}, ...]} (alias "conversations"; roles system/user/
assistant; at least one assistant turn), or {"input_ids": [...], "loss_mask": [...]} of equal length.
A malformed row is skipped and counted, with its line number and reason in the stage log; a file
with no usable row is an error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ROLES = {"system", "user", "assistant"}


@dataclass
class Loaded:
    conversations: list[dict] = field(default_factory=list)  # {"id", "messages"}
    token_rows: list[dict] = field(default_factory=list)  # {"input_ids", "loss_mask"}
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)


def check_messages(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f"turn {i}: needs a string 'content'"
        if m.get("role") not in ROLES:
            return f"turn {i}: role {m.get('role')!r} is not one of system/user/assistant"
        if m["role"] == "assistant" and not m["content"].strip():
            return f"turn {i}: empty assistant turn (only the end-of-turn token would be trained)"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def _check_tokens(row: dict) -> str | None:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        return "'input_ids' must be a list of non-negative integers"
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(v in (0, 1) for v in mask):
        return "'loss_mask' must be a 0/1 list as long as 'input_ids'"
    return None


def load(path: Path) -> Loaded:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: conversations file not found")
    out = Loaded()
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                out.bad.append((lineno, f"not JSON ({exc.msg})"))
                continue
            if not isinstance(row, dict):
                reason: str | None = "not a JSON object"
            elif "input_ids" in row or "loss_mask" in row:
                if (reason := _check_tokens(row)) is None:
                    out.token_rows.append({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]})
            else:
                messages = row.get("messages", row.get("conversations"))
                reason = check_messages(messages) if messages is not None else "no 'messages' or 'input_ids'"
                if reason is None:
                    conv = {"id": str(row.get("id", f"line{lineno}")), "messages": messages}
                    if isinstance(row.get("source"), str):  # a mix's row: which source it came from (sources.py)
                        conv["source"] = row["source"]
                    out.conversations.append(conv)
            if reason is not None:
                out.bad.append((lineno, reason))
    return out


def split_heldout(conversations: list[dict], heldout: int, token_rows: int = 0) -> tuple[list[dict], list[dict]]:
    """The last `heldout` conversations never reach training: they are the evaluation prompts (all of them
    may be, where the file's pre-tokenized rows are the training data). A mix's rows (each with its
    "source") are held out from every source (heldout_shares), each source's last ones, taken in turn so that
    any first n of them (evaluate.num_prompts) span the sources too."""
    if heldout > len(conversations) or (heldout == len(conversations) and not token_rows):
        raise ValueError(f"{len(conversations)} valid conversations leave none for training "
                         f"after holding out {heldout}")
    by_source: dict[str, list[int]] = {}
    for i, c in enumerate(conversations):
        by_source.setdefault(c.get("source", ""), []).append(i)
    if len(by_source) < 2:
        cut = len(conversations) - heldout
        return conversations[:cut], conversations[cut:]
    shares = heldout_shares({s: len(ix) for s, ix in by_source.items()}, heldout)
    picked = {s: by_source[s][len(by_source[s]) - n:] if n else [] for s, n in shares.items()}
    order = [ix[j] for j in range(max(shares.values(), default=0)) for ix in picked.values() if j < len(ix)]
    held = set(order)
    return [c for i, c in enumerate(conversations) if i not in held], [conversations[i] for i in order]


def heldout_shares(sizes: dict[str, int], heldout: int) -> dict[str, int]:
    """How many of `heldout` each source gives: one each first (as far as `heldout` goes, the larger sources
    first), the rest in proportion to the sources' sizes (largest remainders); never a source's last row
    unless the whole split allows it."""
    shares = dict.fromkeys(sizes, 0)
    for s in sorted(sizes, key=lambda s: -sizes[s])[:heldout]:
        shares[s] = 1 if sizes[s] > 1 or heldout >= sum(sizes.values()) else 0
    left = heldout - sum(shares.values())
    total = sum(sizes.values())
    if left > 0:
        want = {s: left * n / total for s, n in sizes.items()}
        add = {s: min(int(w), sizes[s] - shares[s]) for s, w in want.items()}
        for s in add:
            shares[s] += add[s]
        rest = heldout - sum(shares.values())
        for s in sorted(sizes, key=lambda s: -(want[s] - int(want[s]))):
            if rest <= 0:
                break
            room = sizes[s] - shares[s]
            take = min(room, rest)
            shares[s] += take
            rest -= take
    return shares


def first_prompt(messages: list[dict]) -> list[dict]:
    """The turns before the first assistant turn: what an evaluation sends to the model."""
    return messages[:next(i for i, m in enumerate(messages) if m["role"] == "assistant")]


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Held-out prompt rows ({"messages": […]}) rendered as the model is asked: the generation prompt added."""
    return [render_ids(tokenizer, r["messages"], add_generation_prompt=True) for r in rows]


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_rows(tokenizer, messages: list[dict]) -> list[dict]:
    """One row per assistant turn: the history rendered with the chat template, loss on that turn only.
    The mask boundary is the rendered prompt's length, as speculators' prepare-data computes it."""
    rows = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        full = render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(prompt)] != prompt:
            raise ValueError("chat template is not prefix-stable: the rendered prompt is not a prefix "
                             "of the rendered conversation")
        rows.append({"input_ids": full, "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    return rows
