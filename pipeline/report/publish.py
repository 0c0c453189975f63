"""A run's chosen head as a directory to hand over: the head as speculators and vLLM load it, a README.md
model card (target, data, regeneration, draft vocabulary, training, hardware, τ per position, the
benchmark matrix, the exact --speculative-config) and the run's evaluation files as provenance. Only a
head whose run decided `deploy`, unless forced. A run that deployed the head that existed
(evaluate.existing_policy = "deploy", measure-existing's decision) and trained none publishes that head."""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from pathlib import Path

from pipeline.compat import vllm_dynamic_k, vllm_flags, vllm_kv_groups
from pipeline.layout import atomicio, results
from pipeline.layout.checkpoints import measures_checkpoints
from pipeline.layout.rundir import RunDir
from pipeline.profile import Profile
from pipeline.report.notes import _fmt, _matrix_lines, existing_lines, production_lines, sweep_lines
from pipeline.serving import deploy


class PublishError(RuntimeError):
    """Nothing published; the message is one line."""


def chosen_head(run: RunDir, profile: Profile) -> tuple[Path | None, str]:
    """The head the run deploys, and where it was recorded: pick-checkpoint's choice (evaluate.checkpoints =
    "each", or a warm start), else the last epoch's; None until that stage has finished."""
    if measures_checkpoints(profile):
        picked = run.result(results.PickCheckpointResult).checkpoint
        return (Path(picked) if picked else None), "pick-checkpoint"
    recorded = run.result(results.TrainResult).checkpoint
    return (Path(recorded) if recorded else None), "train"


def publish(run: RunDir, out: Path, force: bool = False) -> Path:
    profile = run.profile()
    existing = run.result(results.MeasureExistingResult)
    if existing.skips_training:  # the existing head cleared and was deployed; no head was trained
        decision = existing.verdict()
        head, stage = (Path(existing.head) if existing.head else None), "measure-existing"
        said = decision.line if decision else "not recorded"
    else:
        measured = run.result(results.DeployMeasureResult)
        decision = measured.verdict()
        said = (decision.line if decision else
                f"{measured.decision!r}, recorded before decisions carried their reason (run --resume {run.root} "
                f"--from deploy-measure measures it again)" if measured.decision else
                "not measured (no deploy-measure ran: evaluate.online = false)")
        head, stage = chosen_head(run, profile)
    if not force and not (decision and decision.deploy):
        raise PublishError(f"{run.root}: the run's decision is {said}; --force publishes the head anyway")
    if head is None or not (head / "config.json").is_file():
        raise PublishError(f"{run.root}: no trained head to publish ({stage} has not finished)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PublishError(f"{out}: exists and is not an empty directory (publish overwrites nothing)")
    if not out.parent.is_dir():
        raise PublishError(f"{out}: directory {out.parent} does not exist (publish creates one level only)")
    target = run.target_dir(profile)
    deploy.publish_draft(head, out, target)
    provenance = out / "evaluation"
    provenance.mkdir()
    for result in (run.offline_result, run.online_result, run.checkpoints_result, run.production_result,
                   run.existing_result):
        if result.is_file():
            shutil.copy2(result, provenance / result.name)
    card = (existing_card(run, profile, existing, target, out, decision, force) if existing.skips_training
            else model_card(run, profile, head, target, out, decision, force))
    atomicio.atomic_write_text(out / "README.md", card)
    return out


def serve_lines(target: Path, out: Path, k: int, schedule: list | None = None, server_args: tuple = ()) -> list[str]:
    """How to serve the published head: the exact --speculative-config (`server_args`: the operator's own
    production flags, which decide the KV-cache manager where they name it)."""
    spec_dict = vllm_flags.eagle3_speculative_config(out.resolve(), k)
    if schedule:  # the k per batch size the run measured and deployed
        spec_dict |= vllm_dynamic_k.schedule_config(schedule)
    spec = json.dumps(spec_dict)
    # as the run served it: the KV-cache manager as production's flags chose it, else a windowed head beside a
    # plain target in one group (compat/vllm_kv_groups.py)
    more = "".join(f" {f}" for f in vllm_kv_groups.head_flags(target, out, server_args))
    return ["## Serve it", "", "```",
            f"vllm serve {shlex.quote(str(target))} --speculative-config {shlex.quote(spec)}{more}", "```", ""]


def _operator_args(profile: Profile) -> tuple:
    return (*profile.server.production_args, *profile.server.extra_args)


def existing_card(run: RunDir, profile: Profile, existing: results.MeasureExistingResult, target: Path, out: Path,
                  decision, forced: bool) -> str:
    """The card of a head the run found, measured and deployed without training one."""
    lines = [f"# EAGLE-3 draft head for `{profile.target.model_path or target.name}`", "",
             f"The head that existed, `{existing.existing_head}` ({existing.kind}), measured on this target by "
             f"eagle3-console (run `{run.root.name}`, profile `{profile.name}`) before any training and deployed "
             "as it was (evaluate.existing_policy = deploy): no head was trained.", "",
             "**Decision: " + (decision.line if decision else "not recorded") + "**"
             + (" — published with --force" if forced else ""), "",
             *serve_lines(target, out, existing.k or profile.evaluate.k, server_args=_operator_args(profile)),
             "## Target", "", f"- `{target}`", ""]
    if (measured := atomicio.read_json(run.existing_result)):
        lines += existing_lines(measured, None)
    lines += ["Provenance: `evaluation/` holds the run's own result files.", ""]
    return "\n".join(lines)


def _layers(head: Path, t) -> int:
    """The head's decoder layers as written (a warm start keeps its starting head's), else the profile's."""
    layer = (atomicio.read_json(head / "config.json") or {}).get("transformer_layer_config")
    return layer["num_hidden_layers"] if isinstance(layer, dict) and isinstance(layer.get("num_hidden_layers"), int) \
        else t.num_layers


def model_card(run: RunDir, profile: Profile, head: Path, target: Path, out: Path, decision, forced: bool) -> str:
    state = run.read_state()
    stages = state.get("stages", {})
    config = target / "config.json"
    revision = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else "unknown"
    d, t, ev = profile.data, profile.train, profile.evaluate
    sources = ", ".join(f"{s.source}" + (f" (limit {s.limit})" if s.limit else "") for s in d.sources())
    prepared, regen = run.result(results.PrepareResult), run.result(results.RegenerateResult)
    vocab, train = run.result(results.VocabResult), run.result(results.TrainResult)
    deployed = (atomicio.read_json(run.online_result) or {}).get("deployed") or {}
    lines = [f"# EAGLE-3 draft head for `{profile.target.model_path or target.name}`", "",
             f"Trained by eagle3-console (run `{run.root.name}`, profile `{profile.name}`) with speculators.",
             "", "**Decision: " + (decision.line if decision else "not measured") + "**"
             + (" — published with --force" if forced else ""), "",
             *serve_lines(target, out, deployed.get("k") or ev.k, deployed.get("schedule"), _operator_args(profile)),
             "## Target", "", f"- `{target}` (config.json sha256 {revision})",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in (state.get("versions") or {}).items()), "",
             "## Data", "", f"- sources: {sources}; held out {d.heldout}; sequence length {d.seq_length}",
             f"- prepared: {_fmt(prepared.rows)} rows, {_fmt(prepared.tokens)} tokens "
             f"({_fmt(prepared.loss_tokens)} trained on)",
             "- regeneration: " + (f"the target's own answers ({d.regenerate_backend}, at most "
                                   f"{d.regenerate_max_tokens} tokens, sampling {d.regenerate_sampling}): "
                                   f"{_fmt(regen.generated_tokens)} tokens" if d.regenerate else "none"),
             f"- draft vocabulary: {profile.vocab.draft_vocab_size} of {_fmt(vocab.target_vocab_size)} "
             f"tokens (coverage {_fmt(vocab.coverage)})", "",
             "## Training", "", f"- {t.epochs} epochs, lr {t.lr:g}, {t.optimizer}, {_layers(head, t)} layer(s), "
             f"total_seq_len {t.total_seq_len}, ttt_steps {t.ttt_steps}, extraction {profile.extract.mode}",
             f"- final train loss {_fmt(train.train_loss)}, {_fmt(train.tokens_per_s)} tokens/s; "
             f"the head: `{head.name}` ({'measured best' if ev.checkpoints == 'each' else 'last epoch'})",
             f"- hardware: {profile.hardware.gpus} GPU(s) planned" + (
                 f"; GPU use while training: {stages['train']['gpu']}" if stages.get("train", {}).get("gpu") else ""),
             "", "## Acceptance", ""]
    offline, online = run.result(results.EvaluateOfflineResult), run.result(results.DeployMeasureResult)
    if offline.tau is not None:
        lines.append(f"- offline (transformers): τ {offline.tau:.3f}, per position "
                     + " / ".join(f"{a:.2f}" for a in offline.acceptance_per_position)
                     + f", lossless {offline.lossless}, {offline.prompts} held-out prompts")
    if online.mean_acceptance_length is not None:
        lines.append(f"- vLLM: τ {online.mean_acceptance_length:.3f}, per position "
                     + " / ".join(f"{a:.2f}" for a in online.acceptance_per_position)
                     + f", outputs identical to the target's: {online.identical_outputs}")
    if (matrix := atomicio.read_json(run.online_result)):
        lines += ["", "## Benchmark matrix (vLLM, greedy, held-out prompts)", "", *_matrix_lines(matrix), "",
                  *sweep_lines(matrix)]
    if (production := atomicio.read_json(run.production_result)):
        lines += ["", *production_lines(production)]
    lines += ["", "Provenance: `evaluation/` holds the run's own result files.", ""]
    return "\n".join(lines)
