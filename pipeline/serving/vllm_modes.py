"""The vLLM command line for each server mode, built as an argv list from the profile (never a shell
string). Modes: production (the operator's own flags), extraction (hidden states to files),
baseline (target alone), regenerate (the baseline that speculators' regenerate-responses asks),
speculative (target + the trained EAGLE-3 head, at one k or a k per batch size), ngram (prompt lookup),
suffix (suffix decoding: vLLM's method "suffix", the arctic-inference package)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from pipeline.compat import vllm_cpu_env, vllm_dynamic_k, vllm_flags, vllm_kv_groups
from pipeline.compat.versions import served_vllm
from pipeline.host.procs import repo_on_path
from pipeline.profile import Profile
from pipeline.serving import mooncake

MODES = ("production", "extraction", "baseline", "regenerate", "speculative", "ngram", "suffix")
INTERNAL_HOST = "127.0.0.1"  # the internal modes are keyless: never on an interface others reach


def bind_host(profile: Profile, mode: str) -> str:
    """Production binds where the operator says; every internal mode binds loopback."""
    return profile.server.host if mode == "production" else INTERNAL_HOST


def accelerator_available() -> bool:
    import torch
    return torch.accelerator.is_available()


def served_dtype(profile: Profile) -> str:
    """The dtype the server runs the target in: server.dtype, or the target's own for "auto"."""
    return profile.server.dtype if profile.server.dtype != "auto" else profile.target.dtype


def _is_mla(target_dir: Path) -> bool:
    from pipeline.data.targetinfo import TargetInfoError, from_config
    try:
        return from_config(Path(target_dir) / "config.json").attention == "MLA"
    except (OSError, TargetInfoError, ValueError):
        return False


def base_argv(profile: Profile, target_dir: Path, host: str) -> list[str]:
    s = profile.server
    argv = [s.python or sys.executable, "-m", vllm_flags.API_SERVER_MODULE,
            "--model", str(target_dir), "--served-model-name", s.served_model_name,
            "--host", host, "--port", str(s.port), "--max-model-len", str(s.max_model_len),
            "--dtype", s.dtype, "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if accelerator_available():
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    elif backend := vllm_cpu_env.mla_backend(_is_mla(target_dir), served_dtype(profile)):
        argv += ["--attention-backend", backend]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def extraction_config(profile: Profile, layer_ids: list[int], storage: Path, cpu: bool) -> tuple[dict, dict]:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    if profile.extract.transfer == "mooncake":  # online across nodes: hs_connectors' own config
        from pipeline.serving.online_training import mooncake_kv_config
        kv = mooncake_kv_config(profile)
        if mooncake.runs_here(profile):  # the server's store client on loopback, beside the run's master
            kv["kv_connector_extra_config"]["mooncake"]["local_hostname"] = "127.0.0.1"
        if cpu:  # its streams and events need an accelerator (compat/vllm_cpu_mooncake_connector.py)
            kv |= {"kv_connector": "CpuMooncakeHiddenStatesConnector",
                   "kv_connector_module_path": "pipeline.compat.vllm_cpu_mooncake_connector"}
        return spec, kv
    # vLLM's own connector with its device → host path off the engine's thread (and a CPU's own copy)
    # (a name, not an import: the module imports vLLM, which only the server's process needs)
    return spec, {"kv_connector": "StagedHiddenStatesConnector", "kv_role": "kv_producer",
                  "kv_connector_module_path": "pipeline.compat.vllm_hidden_states_connector",
                  "kv_connector_extra_config": {"shared_storage_path": str(storage), "use_synchronization_lock": True}}


def _render_flags(profile: Profile) -> list[str]:
    served = served_vllm(profile.server.python) if profile.data.tokenize == "render" else None
    return vllm_flags.render_endpoint_flags(profile.data.tokenize, served[1] if served else None)


def server_argv(profile: Profile, mode: str, target_dir: Path, *, layer_ids: list[int] | None = None,
                storage: Path | None = None, draft_dir: Path | None = None, k: int | None = None,
                schedule: list[list[int]] | None = None) -> list[str]:
    """`k`: the head's draft length (evaluate.k when None); `schedule`: a k per batch-size range
    (compat/vllm_dynamic_k.py)."""
    if mode not in MODES:
        raise ValueError(f"unknown server mode {mode!r} (one of {', '.join(MODES)})")
    argv = base_argv(profile, target_dir, bind_host(profile, mode))
    own = len(argv)  # where the tool's flags that the operator's own may override go
    if mode == "production":
        argv += list(profile.server.production_args)
    elif mode == "extraction":
        if not layer_ids or storage is None:
            raise ValueError("extraction mode needs layer ids and a storage directory")
        # speculators' online dataset refuses a server whose first model id is not the trainer's
        # --verifier-name-or-path: serve the target under its path (pipeline/compat/vllm_flags.py)
        argv[argv.index("--served-model-name") + 1] = vllm_flags.extraction_served_name(target_dir)
        spec, kv = extraction_config(profile, layer_ids, storage, cpu=not accelerator_available())
        # No prefix caching (vllm-project/vllm#44485); the render endpoint needs scale-out (compat/vllm_flags.py)
        argv += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
                 *vllm_flags.EXTRACTION_FLAGS, *_render_flags(profile)]
        if profile.extract.enforce_eager and "--enforce-eager" not in argv:
            argv.append("--enforce-eager")
    elif mode == "baseline":
        argv += _render_flags(profile)
    elif mode == "regenerate":  # the baseline that speculators' regenerate-responses asks by the target's path
        at = argv.index("--served-model-name")
        argv[at + 1: at + 2] = vllm_flags.regenerate_served_names(profile.server.served_model_name, target_dir)
    elif mode == "ngram":
        ev = profile.evaluate
        argv += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": ev.k,
                                                     "prompt_lookup_min": ev.ngram_min,
                                                     "prompt_lookup_max": ev.ngram_max})]
    elif mode == "suffix":
        argv += ["--speculative-config", json.dumps(vllm_dynamic_k.suffix_config())]
    elif mode == "speculative" and draft_dir is None:
        raise ValueError("speculative mode needs a draft checkpoint")
    if mode in ("production", "speculative") and draft_dir is not None:  # production too: with the new head
        # Always name the method: a path without "eagle3" in it would be served as draft_model (§2.5).
        spec = vllm_flags.eagle3_speculative_config(draft_dir, k or profile.evaluate.k)
        if schedule:
            spec |= vllm_dynamic_k.schedule_config(schedule)
        argv += ["--speculative-config", json.dumps(spec)]
        # a windowed head (speculators' default) kept in the target's KV-cache group: x1.22 → x1.66 at
        # c = 32 on an H100 (compat/vllm_kv_groups.py); the operator's production flags decide it where they
        # name it, in the matrix too; before their flags, which argparse lets stand over it
        sv = profile.server
        argv[own:own] = vllm_kv_groups.head_flags(target_dir, draft_dir, [*sv.production_args, *sv.extra_args])
    argv += list(profile.server.extra_args)
    return argv


def server_cache(profile: Profile) -> Path:
    """vLLM's caches, shared by every run of run.cache_dir as vLLM's default (~/.cache/vllm) is shared by every
    server of a user: what it keys by content there (a model class's inspection, torch.compile's artifacts by
    config and versions) is the same for every run. Per run, each run's first start of an architecture paid
    a subprocess that imports vLLM again to inspect it (≈ 10 s on 2 busy cores, each run of the test suite),
    and each GPU run a cold compile (20 s for the target, 15 s for a head at k = 3 on an H200)."""
    return Path(profile.run.cache_dir).resolve() / "server-cache"


def shared_dirs(profile: Profile, **names: str) -> dict:
    """{VARIABLE: server_cache/sub} for each `VARIABLE=sub`, where this user can write every sub (created
    here), else {}: a read-only cache_dir, or one another user created, must not stop a server or a trainer."""
    shared = server_cache(profile)
    with contextlib.suppress(OSError):
        for sub in names.values():
            (shared / sub).mkdir(parents=True, exist_ok=True)
    if not all(os.access(shared / sub, os.W_OK | os.X_OK) for sub in names.values()):
        return {}
    return {var: str(shared / sub) for var, sub in names.items()}


def cache_env(profile: Profile) -> dict:
    """vLLM's cache variables in server_cache, or none and vLLM keeps its own default (~/.cache/vllm)."""
    return shared_dirs(profile, VLLM_CACHE_ROOT="vllm", TORCHINDUCTOR_CACHE_DIR="inductor")


def trainer_cache_env(profile: Profile) -> dict:
    """The trainer's torch.compile and Triton caches in the shared cache beside vLLM's (else {}: the run's own
    .cache, as before). Keyed by content like vLLM's, so a later run of the box starts warm: on an H200 the
    train stage's first step came at 94–106 s with cold caches and 24–26 s with warm ones (flex attention,
    NOTES.md "On H200s", row (b)), and each run kept its own — every run of a box, a next release's cold and
    warm starts included, paid the compile again."""
    return shared_dirs(profile, TORCHINDUCTOR_CACHE_DIR="inductor", TRITON_CACHE_DIR="triton")


def server_env(profile: Profile, mode: str = "production") -> dict:
    env = {"HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1", **cache_env(profile),
           "VLLM_CPU_KVCACHE_SPACE": str(profile.server.cpu_kvcache_gib),
           # engine workers import the CPU connector from this repository
           "PYTHONPATH": repo_on_path(os.environ.get("PYTHONPATH"))}
    if not accelerator_available():
        env.update(vllm_cpu_env.cpu_server_env(profile.server.python or sys.executable,
                                               profile.server.tensor_parallel_size, os.environ.get("LD_PRELOAD", "")))
    if profile.server.cuda_visible_devices:  # serving on some GPUs, training on the others
        env["CUDA_VISIBLE_DEVICES"] = profile.server.cuda_visible_devices
    # the internal modes stay on loopback, keyless
    if mode == "production" and (name := profile.server.api_key_env):
        if not (key := os.environ.get(name)):  # production keyless on its host is not what the operator set up
            from pipeline.serving.server import ServerError
            raise ServerError(f"server.api_key_env = {name!r}: ${name} is not set in this environment, and "
                              f"production would serve without its key (export it and run again)")
        env["VLLM_API_KEY"] = key  # through the environment: never on the command line or in a log
    return env
