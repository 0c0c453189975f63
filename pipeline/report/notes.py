"""The per-run notes log: append-only JSON lines, fsync'd on every append, never rewritten."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipeline.layout import atomicio
from pipeline.layout.matrix import level_of
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, RunSnapshot, decision_in
from pipeline.layout.rundir import RunDir, now_iso

# Secrets come from the environment; whatever their value, it never reaches a note.
_SECRET_ENV = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD)$")
_SECRET_TEXT = re.compile(r"(hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9-]{8,})")


def redact(text: str) -> str:
    for name, value in os.environ.items():
        if value and len(value) >= 6 and _SECRET_ENV.search(name):
            text = text.replace(value, f"<{name}>")
    return _SECRET_TEXT.sub("<redacted>", text)


def add(run: RunDir, text: str, *, source: str = "operator", stage: str | None = None,
        figures: dict | None = None) -> dict:
    record: dict = {"ts": now_iso(), "source": source, "stage": stage, "text": redact(text)}
    if figures:
        record["figures"] = figures
    atomicio.append_jsonl(run.notes_path, record)
    return record


def read(run: RunDir) -> list[dict]:
    return atomicio.read_jsonl(run.notes_path)


# What the train stage's loss figures are (speculators' metrics: pipeline/report/plots.py says where they come from)
LOSSES_STAGE = ("train_loss: the last logged step's training loss, the sum over the k TTT steps (train/loss, the "
                "console's \"now\"); val_loss_epoch: the same sum on the validation split at the last epoch's end; "
                "val_loss_N_epoch: TTT step N's own share of it.")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _matrix_lines(res: dict) -> list[str]:
    lines = ["| method | concurrency | output tok/s | ms per token (request) | TTFT ms | TPOT ms (after the first) "
             "| τ (mean acceptance length) | per-position acceptance | speedup | same output as baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, row in res["matrix"].items():
        if row.get("error") and not row.get("levels"):
            lines.append(f"| {method} | – | – | – | – | – | – | – | – | not measured: {row['error'][:160]} |")
            continue
        for c, lv in sorted(row.get("levels", {}).items(), key=lambda kv: int(kv[0])):
            acc = " / ".join(f"{a:.2f}" for a in lv.get("acceptance_per_position", [])) or "–"
            tau = f"{lv['mean_acceptance_length']:.3f}" if lv.get("mean_acceptance_length") else "–"
            same = "–" if method == "baseline" else ("yes" if row.get("identical_outputs") else "NO")
            spread = (f" ({min(lv['rounds_tok_s']):.0f}–{max(lv['rounds_tok_s']):.0f})"
                      if lv.get("rounds_tok_s") else "")
            lines.append(f"| {method} | {c} | {lv['output_tok_s']:.1f}{spread} | {_fmt(lv.get('tpot_ms'))} "
                         f"| {_fmt(lv.get('ttft_ms'))} | {_fmt(lv.get('decode_tpot_ms'))} | {tau} | {acc} "
                         f"| x{_fmt(lv.get('speedup'))} | {same} |")
    return lines


def sweep_lines(res: dict) -> list[str]:
    """The head weighed at each k and level (served or predicted, with the prediction's check), the k per
    batch size chosen, the traffic it was weighed on, and how far instances of the target alone differed."""
    sweep = res.get("sweep") or {}
    if not sweep:
        return []
    ks = sorted({int(k) for pts in sweep.values() for k in pts if int(k) > 0})
    lines = ["## The head at each k (speedup over the baseline: median, min–max over rounds, or over servers "
             "where several were measured)", "",
             "| concurrency | " + " | ".join(f"k={k}" for k in ks) + " | k chosen |",
             "|---|" + "---|" * len(ks) + "---|"]
    chosen = ((res.get("schedule") or {}).get("per_level")) or {}
    for c in sorted(sweep, key=int):
        cells = []
        for k in ks:
            p = sweep[c].get(str(k))
            if p is None:
                cells.append("–")
                continue
            how = "" if p.get("measured") else " predicted"
            err = f", check {p['error']:+.0%}" if p.get("error") is not None else ""
            cells.append(f"x{p['speedup']:.3f} (x{p['lo']:.2f}–x{p['hi']:.2f}){how}{err}")
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {chosen.get(str(c), '–')} |")
    if any(p.get("error") is not None for pts in sweep.values() for p in pts.values()):
        lines += ["", "check: a served k predicted from the served k around it, against what it measured; from k=0 "
                  "(the target alone) it includes the cost every draft step pays whatever its k, so it overstates "
                  "the error of a k predicted between two served heads"]
    sched = res.get("schedule") or {}
    if sched.get("text"):
        lines += ["", f"k per batch size (vLLM's num_speculative_tokens_per_batch_size): {sched['text']}"]
    traffic = res.get("traffic") or {}
    if traffic.get("weights"):
        lines.append("traffic weighed: " + ", ".join(f"c={c} {w:.0%}" for c, w in traffic["weights"].items())
                     + f" ({traffic.get('from')})")
    if (exp := res.get("expected_speedup")):
        lines.append(f"expected speedup of what was considered for deployment under it: x{exp['median']:.3f} "
                     f"(x{exp['lo']:.3f}–x{exp['hi']:.3f})")
    if (second := res.get("second_server")) and second.get("levels"):  # what the decision weighed, per level
        lines.append(f"measured on a second server too ({second['row']}), each server at its median round: "
                     + ", ".join(f"c={c} x{m:.3f} (x{lo:.3f}–x{hi:.3f})"
                                 for c, (m, lo, hi) in second["levels"].items()))
    inst = res.get("instances") or {}
    for c, e in (inst.get("levels") or {}).items():
        parts = [f"{m} {v:.1f}" for m, v in e.get("baseline_instances", {}).items()]
        if "production_before" in e:
            parts.append(f"production before the run {e['production_before']:.1f}")
        said = ([f"baseline instances {e.get('spread', 0):.0%} apart"] if len(e.get("baseline_instances", {})) > 1
                else []) + ([f"production {e['production_vs_baseline']:+.0%} of the baseline"]
                            if "production_vs_baseline" in e else [])
        if e.get("span", 0) > max(e.get("spread", 0), abs(e.get("production_vs_baseline", 0))):
            said.append(f"every instance {e['span']:.0%} apart")
        bound = f"; bound {inst['bound']:.0%}" if said and inst.get("bound") is not None else ""
        lines.append(f"the target alone at c={c}: " + ", ".join(parts) + " tok/s"
                     + (f" ({'; '.join(said)}{bound})" if said else ""))
    return lines + [""]


def ngram_comparison(offline: EvaluateOfflineResult | None, online: DeployMeasureResult | None) -> str | None:
    """n-gram prompt lookup next to the head: vLLM's figures when the matrix served it, else the offline
    replay of vLLM's proposer on the same greedy outputs. Its τ counts only the steps where it found a
    match; tokens per step counts them all, as the head's τ does."""
    if online and online.ngram_tau is not None and online.ngram_tokens_per_step is not None:
        source, tau, per_step, head = "vLLM", online.ngram_tau, online.ngram_tokens_per_step, online.tokens_per_step
    elif offline and offline.ngram_tau is not None and offline.ngram_tokens_per_step is not None:
        source, tau, per_step, head = "replayed offline", offline.ngram_tau, offline.ngram_tokens_per_step, offline.tau
    else:
        return None
    line = (f"n-gram (prompt lookup, {source}): mean acceptance length {tau:.3f} when it drafts; "
            f"tokens per step {per_step:.3f}")
    if head is not None:  # offline the head drafts at every step: its τ is its tokens per step
        named = "its tokens per step" if source == "vLLM" else "its τ: drafting at every step, its tokens per step"
        line += f" against the head's {head:.3f} ({named}), x{head / per_step:.2f}"
    return line


def economics(online: DeployMeasureResult | None) -> str | None:
    """What the speed figures mean (DeployMeasureResult.why)."""
    return online.why() if online else None


def to_markdown(run: RunDir, snapshot: RunSnapshot, out_path: Path | None = None) -> str:
    """The run report: profile and versions, the decision, the stages as they stand (`snapshot`: a stage
    whose job is gone reads interrupted, as in `status`), offline and online evaluation, plots (written as
    PNG into RUN/report/), and every note in order."""
    from pipeline.report import plots

    profile = run.profile()
    state = run.read_state()
    stages = state.get("stages", {})
    online = atomicio.read_json(run.online_result)
    versions = ", ".join(f"{k} {v}" for k, v in (state.get("versions") or {}).items())
    lines = [f"# Run report: {run.root.name}", "", f"- profile: `{profile.name}` {profile.description}".rstrip(),
             f"- run directory: `{run.root}`", f"- created: {state.get('created', '?')}",
             f"- versions: {versions or 'not recorded'}",
             f"- target: {profile.target.model_path or 'demo target'}; k = {profile.evaluate.k}; "
             f"draft vocab {profile.vocab.draft_vocab_size}; epochs {profile.train.epochs}", ""]
    measured = snapshot.result(DeployMeasureResult) if "deploy-measure" in stages else None
    existing = atomicio.read_json(run.existing_result)
    if decision := decision_in(online):
        lines += [f"**Decision: {decision.line}**", ""]
        if why := economics(measured):
            lines += [f"Why: {why}.", ""]
    elif existing and existing.get("reason"):  # no new head was measured: what the existing head's said
        lines += [f"**Decision on the existing head (measure-existing): {existing['decision']}**", ""]
    if rows := [row for row in snapshot.stages if row.status != "n/a"]:
        lines += [f"## Stages (the job: {snapshot.state})", "", "| stage | status | seconds | key figures |",
                  "|---|---|---|---|"]
        for row in rows:
            figs = ", ".join(f"{k}={_fmt(v)}" for k, v in row.figures.items()
                             if not isinstance(v, (dict, list)) and not str(k).endswith(("_dir", "checkpoint")))
            secs = _fmt(row.seconds) if row.seconds is not None else ""
            lines.append(f"| {row.name} | {row.status} | {secs} | {figs} |")
        lines.append("")
        if any(row.name == "train" and "train_loss" in row.figures for row in rows):
            lines += [LOSSES_STAGE, ""]
    picked = atomicio.read_json(run.checkpoints_result)
    if picked and picked.get("chosen"):
        lines += checkpoint_lines(picked)
    offline = snapshot.result(EvaluateOfflineResult) if stages.get("evaluate-offline", {}).get("figures") else None
    for checked in (snapshot.result(EvaluateOfflineResult), snapshot.result(DeployMeasureResult)):
        if checked.acceptance_gap:
            lines += [f"**Warning ({checked.STAGE}): {checked.acceptance_gap}.** Likely: "
                      f"{'; '.join(checked.likely_causes)}.", ""]
    if offline and offline.tau is not None:
        acc = " / ".join(f"{a:.2f}" for a in offline.acceptance_per_position)
        lines += ["## Offline evaluation (transformers target + new head)", "",
                  f"τ = {offline.tau:.3f} over {offline.prompts} held-out prompts, per-position acceptance "
                  f"{acc}, lossless = {offline.lossless}.", ""]
        if line := ngram_comparison(offline, measured):
            lines += [f"{line}.", ""]
        lines += source_lines((atomicio.read_json(run.offline_result) or {}).get("per_source") or {})
    elif measured and measured.mean_acceptance_length is not None:
        acc = " / ".join(f"{a:.2f}" for a in measured.acceptance_per_position)
        ties = (online or {}).get("matrix", {}).get("eagle3", {}).get("numeric_ties", 0)
        lines += ["## Evaluation through vLLM (the offline evaluator did not run)", "",
                  f"τ from vLLM = {measured.mean_acceptance_length:.3f} over {online and online.get('prompts')} "
                  f"held-out prompts (k = {profile.evaluate.k}), per-position acceptance {acc}; outputs identical "
                  f"to the baseline's: {'yes' if measured.identical_outputs else 'no'}"
                  + (f" ({ties} numeric tie(s) of the target's own)" if ties else "")
                  + f". Why not offline: {offline_why(profile)}.", ""]
        if line := ngram_comparison(None, measured):
            lines += [f"{line}.", ""]
    if existing:
        lines += existing_lines(existing, measured)
    if online:
        offline_tau = (f"offline τ of the same head: {_fmt(online.get('offline_tau'))}" if online.get("offline_tau")
                       is not None else "no offline τ (the offline evaluator did not run)")
        lines += ["## Benchmark matrix (vLLM, greedy, held-out prompts)", ""] + _matrix_lines(online) + [
            "", "ms per token (request) = request latency / output tokens (the first token's wait included, what "
            "the speedup is of); TTFT = the first token's wait; TPOT = the time per token after it, streamed"
            + (f"; every answer at least {online['min_new_tokens']} tokens (vLLM's min_tokens)"
               if online.get("min_new_tokens") else "")
            + (f"; tok/s: the median of {online['rounds']} rounds (min–max beside it)"
               if (online.get("rounds") or 1) > 1 else "") + f"; {offline_tau}.", ""] + sweep_lines(online)
    served = {m: r["per_source"] for src in (existing or {}, online or {})
              for m, r in (src.get("matrix") or {}).items() if isinstance(r, dict) and r.get("per_source")}
    lines += served_source_lines(served)
    if production := atomicio.read_json(run.production_result):
        lines += production_lines(production)
    try:
        made = plots.all_plots(run, run.report_dir)
    except OSError as exc:  # a read-only or full run: the report goes out without its plots
        made = {}
        lines += ["## Plots", "", f"not written: {exc}", ""]
    if made:
        base = (out_path.parent if out_path else run.root).resolve()
        lines += ["## Plots", ""]
        for name, path in made.items():
            lines += [f"![{name}]({os.path.relpath(path, base)})", "", f"*{plots.CAPTIONS[name]}.*", ""]
    lines += ["## Notes", ""]
    for note in read(run):
        who = "operator" if note.get("source") == "operator" else (note.get("stage") or "pipeline")
        note_figures = note.get("figures")
        tail = f" ({', '.join(f'{k}={_fmt(v)}' for k, v in note_figures.items())})" if note_figures else ""
        lines.append(f"- `{note['ts']}` **{who}**: {note['text']}{tail}")
    return "\n".join(lines) + "\n"


def source_lines(per_source: dict) -> list[str]:
    """τ per source of a mix (evaluate-offline's per_source): an average hides where a head is weak."""
    if len(per_source) < 2:
        return []
    lines = ["τ per source of the data mix (held out from each):", "", "| source | prompts | τ | per position |",
             "|---|---|---|---|"]
    for src, f in per_source.items():
        acc = " / ".join(f"{a:.2f}" for a in f.get("acceptance_per_position") or [])
        lines.append(f"| {src} | {f.get('prompts')} | {_fmt(f.get('tau'))} | {acc} |")
    return lines + [""]


def served_source_lines(rows: dict[str, dict]) -> list[str]:
    """τ per source through vLLM (a drafting row's per_source), one column per row: the existing head, the new
    one, n-gram."""
    if not rows:
        return []
    names = list(rows)
    sources = sorted({s for per in rows.values() for s in per})
    lines = ["τ per source through vLLM (each source's prompts sent alone):", "",
             "| source | prompts | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for src in sources:
        count = next((per[src]["prompts"] for per in rows.values() if src in per), "")
        taus = [(rows[n].get(src) or {}).get("tau") for n in names]
        lines.append(f"| {src} | {count} | " + " | ".join("–" if t is None else _fmt(t) for t in taus) + " |")
    return lines + [""]


def existing_lines(res: dict, new: DeployMeasureResult | None) -> list[str]:
    """measure-existing's figures (eval/existing.json): the existing head against the target alone at each
    level, and beside the new head's where deploy-measure measured one."""
    low = str(min(res.get("concurrency") or [1]))
    row = (res.get("matrix") or {}).get("existing") or {}
    lv = level_of(row, low)
    lines = ["## The existing head, measured first (measure-existing)", "",
             f"`{res.get('existing_head')}` ({res.get('kind')}; served from `{res.get('head')}`), k = {res.get('k')}, "
             f"{res.get('prompts')} held-out prompts, greedy; evaluate.existing_policy = {res.get('policy')}"
             + ("; the stages that make a new head were skipped" if res.get("skips_training") else "") + ".", "",
             f"Decision: {res.get('decision')}.", ""]
    if (considered := res.get("considered")) and considered.get("what"):  # the sweep over k, as for a new head
        lines += [f"Weighed over k: {considered['what']}"
                  + (f" (k per level: {', '.join(f'c={c} k={k}' for c, k in res['schedule']['per_level'].items())})"
                     if (res.get("schedule") or {}).get("per_level") else "") + ".", ""]
    if row.get("error"):
        return lines + [f"Not measured: {row['error'][:300]}.", ""]
    lines += ["| concurrency | existing head tok/s | target alone tok/s | speedup (median, min–max) |",
              "|---|---|---|---|"]
    for c, e in sorted((res.get("levels") or {}).items(), key=lambda kv: int(kv[0])):
        spread = (f" ({min(e['rounds_tok_s']):.0f}–{max(e['rounds_tok_s']):.0f})" if e.get("rounds_tok_s") else "")
        interval = (f" (x{e['speedup_lo']:.3f}–x{e['speedup_hi']:.3f})" if e.get("speedup_lo") is not None else "")
        base = f"{e['baseline_tok_s']:.1f}" if e.get("baseline_tok_s") is not None else "–"
        lines.append(f"| {c} | {e['tok_s']:.1f}{spread} | {base} | x{_fmt(e.get('speedup'))}{interval} |")
    lines += ["", f"| head | τ (vLLM) | per-position acceptance | speedup at c={low} | same output as the target |",
              "|---|---|---|---|---|"]

    def cells(tau, acc, speedup, same) -> str:
        return (f"{_fmt(tau) if tau is not None else '–'} | {' / '.join(f'{a:.2f}' for a in acc or []) or '–'} | "
                f"{'x' + _fmt(speedup) if speedup is not None else '–'} | "
                f"{'–' if same is None else 'yes' if same else 'NO'}")
    lines.append("| existing | " + cells(lv.get("mean_acceptance_length"), lv.get("acceptance_per_position"),
                                         lv.get("speedup"), row.get("identical_outputs")) + " |")
    if new is not None and new.mean_acceptance_length is not None:
        lines.append("| new (this run) | " + cells(new.mean_acceptance_length, new.acceptance_per_position,
                                                   new.speedup, new.identical_outputs) + " |")
    return lines + [""]


def checkpoint_lines(picked: dict) -> list[str]:
    """pick-checkpoint's table: τ per checkpoint beside the training figures of its epoch."""
    chosen = picked["chosen"]
    lines = [f"## Choosing the checkpoint ({picked['backend']}, {picked['prompts']} held-out prompts, "
             f"k = {picked['k']})", "", f"Deployed: {chosen['why']}.", "",
             "| checkpoint | train loss (epoch mean) | val loss (epoch) | val accuracy per position | τ "
             "| acceptance per position | deployed / disagrees |",
             "|---|---|---|---|---|---|---|"]
    for e in picked["checkpoints"]:
        mark = "**deployed**" if e["label"] == chosen["label"] else ("⚠ disagrees" if e.get("disagrees") else "")
        val = " / ".join(f"{a:.2f}" for a in e.get("val_acc") or [])
        acc = " / ".join(f"{a:.2f}" for a in e["acceptance_per_position"])
        lines.append(f"| {e['label']} | {_fmt(e.get('train_loss')) if e.get('train_loss') is not None else ''} | "
                     f"{_fmt(e.get('val_loss')) if e.get('val_loss') is not None else ''} | {val} | "
                     f"{e['tau']:.3f} | {acc} | {mark} |")
    return lines + ["", "Losses: both the sum over the TTT steps (speculators' train/loss), train loss its mean over "
                        "the epoch's logged steps, val loss over the validation split at the epoch's end "
                        "(val/loss_epoch). Validation accuracy: speculators' full accuracy per draft position on its "
                        "validation split (teacher-forced); τ and acceptance: measured on the held-out prompts. ⚠: "
                        "they disagree by far (pipeline/evaluation/diagnose.py).", ""]


def production_lines(res: dict) -> list[str]:
    """The operator's production server on the same requests before the run and after its handover."""
    before, after = res["before"]["row"], res["after"]["row"]
    head = "with the new head" if res.get("with_draft") else "without a head (the run did not deploy one)"
    lines = ["## Production before and after", "", f"Before: {res['before']['server']}; after: "
             f"{res['after']['server']}, {head}. The same {len(res['before']['prompt_ids'])} held-out prompts, greedy."
             + (f" {res['same_argv'][0].upper()}{res['same_argv'][1:]}." if res.get("same_argv") else ""),
             "", "| concurrency | tok/s before | tok/s after | speedup | TTFT ms before | TTFT ms after "
             "| TPOT ms before | TPOT ms after |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted(res.get("speedup", {}), key=int):
        b, a = level_of(before, c), level_of(after, c)
        lines.append(f"| {c} | {b['output_tok_s']:.1f} | {a['output_tok_s']:.1f} | x{res['speedup'][c]:.2f} | "
                     f"{_fmt(b.get('ttft_ms'))} | {_fmt(a.get('ttft_ms'))} | "
                     f"{_fmt(b.get('decode_tpot_ms'))} | {_fmt(a.get('decode_tpot_ms'))} |")
    return lines + [""]


def offline_why(profile) -> str:
    """Why evaluate-offline did not run for this profile (the planner's reason)."""
    from pipeline.data.targetinfo import TargetInfoError, target_info
    from pipeline.evaluation.offline_policy import offline_evaluation
    try:
        return offline_evaluation(profile, target_info(profile))[1]
    except TargetInfoError as exc:
        return str(exc)


def check_destination(path: Path) -> None:
    """An export destination the operator named: a file in an existing, writable directory. Checked
    before anything is rendered; no directory is created for it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"-o {path}: is a directory; name the file to write")
    if not path.parent.is_dir():
        raise ValueError(f"-o {path}: directory {path.parent} does not exist (export creates none)")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"-o {path}: directory {path.parent} is not writable")


def export(run: RunDir, fmt: str, snapshot: RunSnapshot, out_path: Path | None = None) -> str:
    if fmt == "md":
        return to_markdown(run, snapshot, out_path)
    if fmt == "json":
        return json.dumps({"run": str(run.root), "snapshot": snapshot.as_json(), "state": run.read_state(),
                           "notes": read(run)}, indent=2) + "\n"
    raise ValueError(f"unknown notes format {fmt!r} (md or json)")
