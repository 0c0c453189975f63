"""Asking the vLLM a profile serves with (server.python, else this interpreter) before any GPU work: a probe
module of pipeline/compat, run in that interpreter, answers one JSON question (vllm_extract_probe.py: the
target's attention, MLA and INT4 experts; eagle3_fields.py: the head config fields vLLM reads). Each answer
is remembered under run.cache_dir/vllm-answers per interpreter, vLLM version, probe and question: asking
costs a vLLM import, ≈ 10 s on 2 cores."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.compat import vllm_cpu_env
from pipeline.compat.versions import served_vllm
from pipeline.data.target import resolve_layer_ids
from pipeline.data.targetinfo import TargetInfo
from pipeline.host.procs import last_error_text, repo_on_path
from pipeline.layout import atomicio
from pipeline.profile import Profile

TARGET_PROBE = "pipeline.compat.vllm_extract_probe"
HEAD_PROBE = "pipeline.compat.eagle3_fields"
ROOT = Path(__file__).resolve().parents[2]


def ask(python: str, cache_dir: str | Path, probe: str, question: dict) -> dict:
    """The answer of the vLLM in `python` ("" = this interpreter) to `question`, asked through the module
    `probe` or remembered; {"error": why} when it cannot be asked (no vLLM there, a crash, a timeout)."""
    if (served := served_vllm(python)) is None:
        return {"error": f"no vllm or vllm-cpu in {python or sys.executable}"}
    q = json.dumps(question, sort_keys=True)
    key = hashlib.sha256(json.dumps([os.path.realpath(python or sys.executable), f"{served[0]}=={served[1]}",
                                     probe, q]).encode())
    memo = Path(cache_dir).resolve() / "vllm-answers" / f"{key.hexdigest()[:32]}.json"
    if isinstance(known := atomicio.read_json(memo), dict):
        return known
    answer = _asked(python, probe, q)
    if "error" not in answer:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next preflight the question again
            atomicio.atomic_write_json(memo, answer)
    return answer


@functools.lru_cache(maxsize=16)
def _asked(python: str, probe: str, question: str) -> dict:
    env = {**os.environ, "PYTHONPATH": repo_on_path(os.environ.get("PYTHONPATH")),
           "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run([python or sys.executable, "-m", probe, question],
                             capture_output=True, text=True, timeout=180, check=False, env=env, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": last_error_text(out.stderr) or f"exit {out.returncode}, no answer"}


def target_question(profile: Profile, info: TargetInfo) -> dict:
    """What vllm_extract_probe.py is asked about the target: its shape, dtype and aux layers, MLA's ranks and
    the backend a CPU server names, INT4 experts' group size."""
    dtype = profile.server.dtype if profile.server.dtype in ("float32", "bfloat16", "float16") else profile.target.dtype
    q = {"hidden": info.hidden, "layers": info.layers, "dtype": dtype,
         "aux_ids": resolve_layer_ids(profile.extract.layer_ids, info.layers)}
    if info.attention != "MLA":
        q["head_dim"] = info.head_dim
    else:
        q.update(kv_lora_rank=info.kv_lora_rank, qk_rope_head_dim=info.qk_rope_head_dim, rope_type=info.rope_type,
                 heads=info.heads)
        if (named := vllm_cpu_env.mla_backend(True, dtype)):  # what a CPU server names (compat/vllm_cpu_env.py)
            q["mla_backend"] = named
    if info.int4_group_size:
        q["int4_group_size"] = info.int4_group_size
    return q


def target_answer(profile: Profile, info: TargetInfo) -> dict:
    """The serving vLLM's answer about this target (vllm_extract_probe.py), asked or remembered."""
    return ask(profile.server.python, profile.run.cache_dir, TARGET_PROBE, target_question(profile, info))
