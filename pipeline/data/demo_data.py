"""Offline text for the demo: tokenizer training files and conversations, both from Python's stdlib.

No hub, no network: the standard library's own source is text every machine has.
"""
from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Literal

Answers = Literal["docstring", "source"]

QUESTION_TEMPLATES = (
    "What does `{name}` in `{module}` do?",
    "Explain `{module}.{name}` briefly.",
    "How would I use `{name}` from the `{module}` module?",
    "Summarise the purpose of `{module}.{name}`.",
)
SOURCE_TEMPLATES = (
    "Show me the source of `{module}.{name}`.",
    "How is `{name}` in `{module}` written?",
    "Write `{module}.{name}` as the standard library has it.",
    "What is the code of `{name}` from the `{module}` module?",
)
FOLLOW_UPS = ("Can you give an example?", "What should I watch out for?", "Is there an alternative?")
DOC_CHARS = 400
# A GPU target's answers must run long enough that decoding, not the first token, sets a request's time
# (NOTES.md "A win on one GPU"): a definition's own source, cut at a line, is a few hundred tokens.
SOURCE_CHARS = 1600
STDLIB = Path(sysconfig.get_paths()["stdlib"])


class TooFewFunctions(RuntimeError):
    """More demo conversations asked than this Python's standard library has documented functions."""


def stdlib_sources(limit: int) -> list[Path]:
    """The first `limit` stdlib modules by sorted path: deterministic on a given Python."""
    files = sorted(p for p in STDLIB.glob("*.py") if p.stat().st_size > 2000)
    if not files:
        raise RuntimeError(f"no stdlib sources under {STDLIB}")
    return files[:limit]


def stdlib_tree(limit: int) -> list[Path]:
    """The first `limit` .py files of the whole stdlib tree by sorted path (site-packages left out)."""
    files = sorted(p for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return files[:limit]


def _source(text: str, node: ast.FunctionDef | ast.ClassDef) -> str:
    """The definition's source at column 0 (a docstring's own lines left of it stay as they are)."""
    lines = (ast.get_source_segment(text, node) or "").split("\n")
    pad = " " * node.col_offset
    code = "\n".join(lines[:1] + [line.removeprefix(pad) for line in lines[1:]])
    return code if len(code) <= SOURCE_CHARS else code[:code.rfind("\n", 0, SOURCE_CHARS) + 1 or SOURCE_CHARS]


def _documented_functions(path: Path, answers: Answers) -> list[tuple[str, str]]:
    """(name, answer) of each public documented function and class: its docstring on one line, or its
    source. Both styles take the same definitions in the same order (the conversations' ids agree)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                found.append((node.name, " ".join(doc.split())[:DOC_CHARS] if answers == "docstring"
                              else _source(text, node)))
    return found


def conversations(count: int, seed: int, answers: Answers = "docstring") -> list[dict]:
    """`count` chat conversations (some two-turn) about documented stdlib functions; the first answer is
    the docstring or the source (`answers`)."""
    rng = random.Random(seed)
    pool = [(path.stem, name, doc) for path in stdlib_sources(400)
            for name, doc in _documented_functions(path, answers)]
    rng.shuffle(pool)
    if len(pool) < count:
        raise TooFewFunctions(f"only {len(pool)} documented stdlib functions, {count} conversations asked")
    out = []
    for module, name, doc in pool[:count]:
        messages = [
            {"role": "system", "content": "You are a concise Python assistant."},
            {"role": "user", "content": rng.choice(QUESTION_TEMPLATES if answers == "docstring"
                                                   else SOURCE_TEMPLATES).format(name=name, module=module)},
            {"role": "assistant", "content": doc},
        ]
        if rng.random() < 0.3:
            messages += [{"role": "user", "content": rng.choice(FOLLOW_UPS)},
                         {"role": "assistant", "content": f"See the documentation of {module}.{name}: {doc[:160]}"}]
        out.append({"id": f"{module}.{name}", "messages": messages})
    return out
