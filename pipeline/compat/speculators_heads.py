"""An EAGLE-3 head an operator names (to measure, deploy, or train further with speculators'
`--from-pretrained`): what the path holds, a research-format head converted by speculators' own converter,
its shape and vocabulary mapping, and where it contradicts the target and the profile.

Told apart by speculators 0.9.0's own signals: a run directory (profile.toml) offers its published head,
RunDir.draft_dir; a speculators head has `speculators_model_type` in config.json (what
`SpeculatorModel.from_pretrained` tests) and *.safetensors weights; without weights it is refused, as
`--from-pretrained` would take it as config-only and start from fresh weights. A research-format head
(SafeAILab/EAGLE, yuhuili's EAGLE3 heads) lacks that key and has one model.safetensors or pytorch_model.bin
(convert/utils.py `load_checkpoint_weights`; sharded is refused) keyed fc.weight, midlayer.*, norm, lm_head,
d2t, t2d. `speculators convert --algorithm eagle3` only warns when a weight is missing from the checkpoint
or goes unused, and saves the head with that piece at its random initialization (exit 0): `convert` fails
there. The converter reads norm_before_residual from its kwargs only, never from the research config:
`convert` hands on each of the four norms the config sets.

Warm start: `--from-pretrained` loads the head's d2t/t2d, then replaces them by the mapping the trainer is
given (--d2t-path/--t2d-path, else data/d2t-N.npy, else one rebuilt from token_freq.pt;
`SpeculatorModel.from_pretrained` → `load_vocab_mappings`) and keeps the head's trained lm_head rows:
another mapping silently re-labels them, so `write_vocab_files` writes the head's own as the vocab stage's
files. Its norms come from the head's config, not the train.norm_* flags. tests/test_speculators_heads.py.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.compat.eagle3_fields import FIELDS, head_values, trained_value
from pipeline.layout import atomicio
from pipeline.layout.rundir import PROFILE_FILE, RunDir

RESEARCH_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # the converter's order
CONVERT_TIMEOUT_S = 1800
IGNORED_UNUSED = ("rotary_emb.inv_freq",)  # a buffer older checkpoints saved; the head recomputes it
Child = Callable[[list[str], dict[str, str]], tuple[int, str]]  # (argv, env) -> (exit code, stdout+stderr)


class HeadError(ValueError):
    pass


@dataclass(frozen=True)
class HeadSource:
    kind: Literal["run", "speculators", "research"]
    head: Path  # the directory holding config.json and the weights (a run's: its draft_dir)
    weights: tuple[Path, ...]
    run: Path | None = None


@dataclass(frozen=True)
class HeadShape:
    path: Path
    speculators_model_type: str
    hidden_size: int  # the draft's
    target_hidden_size: int  # the hidden states its fc reads (config's target_hidden_size, else hidden_size)
    layers: int
    draft_vocab_size: int
    target_vocab: int  # transformer_layer_config.vocab_size: the verifier vocabulary the head maps to
    aux_layer_ids: tuple[int, ...] | None  # eagle_aux_hidden_state_layer_ids (None: speculators' default)
    num_aux: int | None  # from fc.weight's width
    has_d2t: bool
    has_t2d: bool
    norms: dict[str, bool | None]  # eagle3_fields.FIELDS as written, None where absent
    speculative_tokens: int | None  # the default proposal's length
    verifier: str | None  # speculators_config.verifier.name_or_path
    window: int = 0  # its layers' sliding window (train.sliding_window's terms: 0 = full attention)
    full_layers: bool = True  # some layer has full attention (every layer where window is 0)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeadError(f"{path}: unreadable ({type(exc).__name__}: {_one_line(exc)})") from None
    if not isinstance(data, dict):
        raise HeadError(f"{path}: not a JSON object")
    return data


def _weights(files: tuple[Path, ...], names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Tensor shapes by key across `files` (names None), or the tensors `names` themselves where present;
    safetensors read by key without loading the rest."""
    out: dict[str, Any] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(file), framework="pt") as fh:
                    for key in fh.keys():
                        if names is None:
                            out[key] = tuple(fh.get_slice(key).get_shape())
                        elif key in names:
                            out[key] = fh.get_tensor(key)
            else:
                import torch
                try:
                    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # mmap takes torch.save's zip format only, not the legacy one
                    state = torch.load(file, map_location="cpu", weights_only=True)
                out.update({k: tuple(v.shape) if names is None else v for k, v in state.items()
                            if names is None or k in names})
        except Exception as exc:  # noqa: BLE001 - a torn or foreign file, in one line
            raise HeadError(f"{file}: unreadable weights ({type(exc).__name__}: {_one_line(exc)})") from None
    return out


def classify(path: Path) -> HeadSource:
    """What `path` is: a run directory with a published head, a speculators head or a research-format one."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise HeadError(f"{path}: not a directory")
    if (path / PROFILE_FILE).is_file():
        head = RunDir(path).draft_dir
        if not (head / "config.json").is_file():
            raise HeadError(f"{path}: a run directory without a published head ({head} has no config.json)")
        published = classify(head)
        return HeadSource("run", published.head, published.weights, run=path)
    if not (path / "config.json").is_file():
        raise HeadError(f"{path}: no config.json and no {PROFILE_FILE}: neither a head nor a run directory")
    config = _json(path / "config.json")
    if "speculators_model_type" in config or "speculators_config" in config:
        if (kind := config.get("speculators_model_type")) != "eagle3":
            raise HeadError(f"{path / 'config.json'}: speculators_model_type {kind!r}, not an eagle3 head")
        if not (weights := tuple(sorted(path.glob("*.safetensors")))):
            raise HeadError(f"{path}: a speculators config.json but no *.safetensors weights")
        return HeadSource("speculators", path, weights)
    if "dflash_config" in config or any("DFlash" in a for a in config.get("architectures") or []):
        raise HeadError(f"{path / 'config.json'}: a DFlash head, not EAGLE-3")
    found = [path / n for n in RESEARCH_WEIGHTS if (path / n).is_file()]
    if not found:
        sharded = sorted(p.name for p in path.glob("*.index.json"))
        raise HeadError(f"{path}: no {' or '.join(RESEARCH_WEIGHTS)}" + (
            f" (sharded, {sharded[0]}: speculators' converter takes one file)" if sharded else ""))
    keys = _weights((found[0],))
    if "fc.weight" not in keys or not any(k.startswith(("midlayer.", "layers.")) for k in keys):
        raise HeadError(f"{found[0]}: no fc.weight and midlayer.* weights: not an EAGLE-3 head")
    return HeadSource("research", path, (found[0],))


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=CONVERT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{type(exc).__name__}: {exc}"
    return done.returncode, done.stdout + "\n" + done.stderr


def _last_error(output: str) -> str:
    """The child's last exception line (with the indented detail torch prints after it), else its last line."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i][:1].isspace() and re.match(r"^[\w.]*(Error|Exception)\b", lines[i]):
            detail = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1][:1].isspace() else ""
            return f"{lines[i]} {detail}".strip()[:400]
    return lines[-1].strip()[:400] if lines else "no output"


def _dropped(output: str) -> str | None:
    """The converter's own warnings that a weight was left at its initialization or went unused."""
    found = []
    for what, keys in re.findall(r"(Missing|Unexpected) keys in checkpoint: (\[.*?\])\s*$", output, re.M):
        names = [k for k in ast.literal_eval(keys) if not k.endswith(IGNORED_UNUSED)]
        if names:
            found.append(f"{'not in the checkpoint' if what == 'Missing' else 'unused'}: {', '.join(names)}")
    return "; ".join(found) or None


def convert(source: Path, dest: Path, *, verifier: Path, python: str = sys.executable,
            run_child: Child | None = None) -> Path:
    """A research-format head converted into `dest` by speculators' own converter in a child process,
    offline, against the local target `verifier`; built at dest.tmp-PID and renamed, nothing at dest on
    failure."""
    src, dest, verifier = classify(source), Path(dest).expanduser().resolve(), Path(verifier).expanduser().resolve()
    if src.kind != "research":
        raise HeadError(f"{src.head}: already a speculators head: nothing to convert")
    if not (verifier / "config.json").is_file():
        raise HeadError(f"{verifier}: no config.json (the verifier is the target's local model directory)")
    if dest.exists():
        raise HeadError(f"{dest}: already exists")
    values = head_values(_json(src.head / "config.json"))[0]
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    for left in dest.parent.glob(f"{dest.name}.tmp-*"):  # a killed attempt's (another pid): the head's size each
        shutil.rmtree(left, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "speculators", "convert", str(src.head), "--verifier", str(verifier),
            "--algorithm", "eagle3", "--output-path", str(tmp)]
    if kwargs := {f: True for f, v in values.items() if v is True}:
        argv += ["--algorithm-kwargs", json.dumps(kwargs)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TYPER_STANDARD_TRACEBACK": "1", "NO_COLOR": "1"}
    try:
        rc, output = (run_child or _run)(argv, env)
        if rc != 0:
            raise HeadError(f"{src.head}: speculators convert exited with {rc}: {_last_error(output)}")
        if problem := _dropped(output):
            raise HeadError(f"{src.head}: speculators convert left the head incomplete ({problem})")
        if classify(tmp).kind != "speculators":
            raise HeadError(f"{tmp}: speculators convert wrote no speculators head")
        tmp.rename(dest)
        atomicio.fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _size(where: Path, value, key: str) -> int:
    """A config's size field, or one line naming it (not int()'s complaint)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HeadError(f"{where}: {key} is {value!r}, not a positive integer")
    return value


def shape(path: Path) -> HeadShape:
    """A speculators head's (or a run's published head's) sizes and fields, read from config.json and the
    weights' index, no tensor loaded; a research-format head's as speculators' converter will write them."""
    if (src := classify(path)).kind == "research":
        return _research_shape(src)
    where = src.head / "config.json"
    config = _json(where)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or not layer:  # read as a default model's sizes it would pass for another head
        raise HeadError(f"{where}: transformer_layer_config is {layer!r}, not the draft layer's config")
    if not {"hidden_size", "num_hidden_layers", "vocab_size"} <= layer.keys():  # an older writer's diff dict
        from transformers import AutoConfig  # speculators' class for a layer config without model_type: qwen3
        layer = {**AutoConfig.for_model(layer.get("model_type") or "qwen3").to_dict(), **layer}
    types = layer.get("layer_types") or []
    if not isinstance(types, list):
        raise HeadError(f"{src.head / 'config.json'}: transformer_layer_config.layer_types is {types!r}, "
                        f"not a list of layer kinds")
    window = layer["sliding_window"] if isinstance(layer.get("sliding_window"), int) and "sliding_attention" in types \
        else 0
    keys = _weights(src.weights)

    def size(value, key: str) -> int:
        return _size(where, value, key)
    hidden = size(layer["hidden_size"], "transformer_layer_config.hidden_size")
    target_hidden = size(config.get("target_hidden_size") or hidden, "target_hidden_size")
    fc = keys.get("fc.weight")
    spec: dict = config["speculators_config"] if isinstance(config.get("speculators_config"), dict) else {}
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    chosen = next((m for m in methods if m.get("proposal_type") == spec.get("default_proposal_method")),
                  methods[0] if methods else {})
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and (not isinstance(aux, list) or not all(isinstance(i, int) for i in aux)):
        raise HeadError(f"{where}: eagle_aux_hidden_state_layer_ids is {aux!r}, not a list of layer indices")
    return HeadShape(
        path=src.head, speculators_model_type=config["speculators_model_type"], hidden_size=hidden,
        target_hidden_size=target_hidden,
        layers=size(layer["num_hidden_layers"], "transformer_layer_config.num_hidden_layers"),
        draft_vocab_size=size(config.get("draft_vocab_size") or 32000, "draft_vocab_size"),  # the config's default
        target_vocab=size(layer["vocab_size"], "transformer_layer_config.vocab_size"),
        aux_layer_ids=tuple(aux) if aux else None,
        num_aux=fc[1] // target_hidden if fc and len(fc) == 2 else None,
        has_d2t="d2t" in keys, has_t2d="t2d" in keys, norms=head_values(config)[0],
        speculative_tokens=chosen.get("speculative_tokens"),
        verifier=spec["verifier"].get("name_or_path") if isinstance(spec.get("verifier"), dict) else None,
        window=window, full_layers=not window or "full_attention" in types)


# What every EAGLE-3 research head holds (SafeAILab/EAGLE's LlamaForCausalLMEagle3, one decoder layer):
# speculators 0.9.0's converter loads the rest at its random initialization with a warning only
# (convert/eagle/eagle3_converter.py `load_state_dict(strict=False)`), which `convert` refuses after the fact.
RESEARCH_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
                 "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                 *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


def _research_shape(src: HeadSource) -> HeadShape:
    """EAGLE's config.json and the weights' shapes, as the converter carries them over (convert/eagle3: the
    layer sizes and draft vocabulary from the config, the mapping from the weights, full attention, the four
    norms where the config sets them): a warm start's or an existing head's shape is checked before any
    conversion, which happens only in vocab or measure-existing."""
    where = src.head / "config.json"
    config, keys = _json(where), _weights(src.weights)
    if missing := [k for k in RESEARCH_KEYS if k not in keys]:  # before extract, not in the vocab stage
        raise HeadError(f"{src.weights[0]}: not in the weights: {', '.join(missing)} (speculators convert would "
                        f"leave them at random)")
    hidden = _size(where, config.get("hidden_size"), "hidden_size")
    fc, t2d = keys.get("fc.weight"), keys.get("t2d")
    target_hidden = _size(where, config.get("target_hidden_size") or (fc[1] // 3 if fc and len(fc) == 2 else hidden),
                          "target_hidden_size")
    return HeadShape(
        path=src.head, speculators_model_type="eagle3", hidden_size=hidden, target_hidden_size=target_hidden,
        layers=_size(where, config.get("num_hidden_layers") or 1, "num_hidden_layers"),
        draft_vocab_size=_size(where, config.get("draft_vocab_size") or config.get("vocab_size"), "draft_vocab_size"),
        target_vocab=t2d[0] if t2d else _size(where, config.get("vocab_size"), "vocab_size"),
        aux_layer_ids=None, num_aux=fc[1] // target_hidden if fc and len(fc) == 2 else None,
        has_d2t="d2t" in keys, has_t2d=t2d is not None, norms=head_values(config)[0], speculative_tokens=None,
        verifier=None)


def vocab_mapping(path: Path) -> tuple[Any, Any] | None:
    """The head's (d2t, t2d) as its weights store them (torch tensors), None when it has neither."""
    src = classify(path)
    found = _weights(src.weights, ("d2t", "t2d"))
    if not found:
        return None
    if len(found) == 1:
        raise HeadError(f"{src.head}: its weights hold {', '.join(found)} without the other of d2t/t2d")
    return found["d2t"], found["t2d"]


def checked_mapping(path: Path) -> tuple[Any, Any]:
    """The head's (d2t int64, t2d bool) after the checks speculators' `load_vocab_mappings` makes and EAGLE's
    convention (target id = draft index + d2t): preflight's as the vocab stage's."""
    import torch

    if (mapping := vocab_mapping(path)) is None:
        raise HeadError(f"{classify(path).head}: its weights hold no d2t/t2d to reuse")
    d2t, t2d = mapping[0].to(torch.long), mapping[1].to(torch.bool)
    n = d2t.shape[0]
    if int(t2d.sum()) != n or not torch.equal(torch.arange(n) + d2t, torch.nonzero(t2d).squeeze(1)):
        raise HeadError(f"{classify(path).head}: d2t ({n} entries) and t2d ({int(t2d.sum())} set) disagree")
    return d2t, t2d


def write_vocab_files(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """The head's own mapping as the vocab stage writes it for speculators' trainer (RunDir.vocab_mappings:
    d2t-N.npy int64 offsets, t2d-N.npy bool mask, N its draft vocab size), after the checks speculators'
    `load_vocab_mappings` makes and EAGLE's convention (target id = draft index + d2t) holds."""
    import numpy as np

    d2t, t2d = checked_mapping(path)
    n = d2t.shape[0]
    out = Path(out_dir) / f"d2t-{n}.npy", Path(out_dir) / f"t2d-{n}.npy"
    for file, array in zip(out, (d2t.numpy(), t2d.numpy()), strict=True):
        def save(p: Path, a=array) -> None:
            with open(p, "wb") as fh:  # a handle: np.save would append ".npy" to a temp path
                np.save(fh, a)
        atomicio.atomic_write_with(file, save)
    return out


def mismatches(shape: HeadShape, *, hidden_size: int, target_vocab: int, draft_vocab: int | None,
               layers: int | None, aux_layer_ids: list[int] | None = None,
               norms: dict[str, bool] | None = None, window: int | None = None,
               training: bool = True) -> list[tuple[str, str]]:
    """(profile key or target config field, reason) for each way the head contradicts the target (its
    hidden_size and vocab_size) or the profile (vocab.draft_vocab_size, train.num_layers, the aux ids the
    trainer is given: extract.layer_ids without the last, train.norm_*, train.sliding_window); empty when it
    fits. `training` False: only what serving needs (vLLM reads target_hidden_size; the draft's own width is
    the head's business there)."""
    out = []
    if shape.target_hidden_size != hidden_size:
        out.append(("hidden_size", f"the head reads hidden states of size {shape.target_hidden_size}, the target's "
                                   f"are {hidden_size}: it can be neither served nor trained on this target"))
    elif training and shape.hidden_size != hidden_size:
        out.append(("hidden_size", f"the draft's hidden size {shape.hidden_size} is not the target's {hidden_size}: "
                                   "speculators refuses to train it further"))
    if draft_vocab is not None and shape.draft_vocab_size != draft_vocab:
        out.append(("vocab.draft_vocab_size", f"the head drafts from {shape.draft_vocab_size} tokens, the profile "
                                              f"asks {draft_vocab}: a warm start keeps the head's"))
    if shape.target_vocab != target_vocab:
        out.append(("vocab_size", f"the head maps to a vocabulary of {shape.target_vocab}, the target's has "
                                  f"{target_vocab}: its d2t/t2d cannot be reused"))
    if layers is not None and shape.layers != layers:
        out.append(("train.num_layers", f"the head has {shape.layers} decoder layer(s), the profile asks {layers}"))
    if aux_layer_ids is not None and (shape.aux_layer_ids not in (None, tuple(aux_layer_ids))
                                      or shape.num_aux not in (None, len(aux_layer_ids))):
        reads = list(shape.aux_layer_ids) if shape.aux_layer_ids else "speculators' default layers"
        out.append(("extract.layer_ids", f"the head reads {reads} ({shape.num_aux} aux states), the profile "
                                         f"gives {list(aux_layer_ids)}"))
    if window is not None and shape.window != window:
        has, asks = (f"a window of {w}" if w else "full attention" for w in (shape.window, window))
        out.append(("train.sliding_window", f"the head's layers have {has}, the profile asks {asks}: a warm "
                                            f"start keeps the head's (set {shape.window} or leave the key out)"))
    for field, wanted in (norms or {}).items():
        if field in FIELDS and trained_value(shape.norms.get(field)) != wanted:
            out.append((f"train.{field}", f"the head has {field} = {trained_value(shape.norms.get(field))}, the "
                                          f"profile {wanted}: a warm start keeps the head's"))
    return out
