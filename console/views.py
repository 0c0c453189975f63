"""What the panels show, built from snapshots: rows and strings, no widgets."""
from __future__ import annotations

from pathlib import Path

from rich.text import Text

from console import verdict
from console.formatting import BLOCKS, fmt_secs, na, spark
from pipeline.host import gpu
from pipeline.layout.matrix import level_of
from pipeline.layout.results import RunSnapshot, decision_in
from pipeline.profile import Profile
from pipeline.run import jobs

LOSS_CURVE_WIDTH = 70


def gpu_row(g: gpu.GpuSample, util_hist, mem_hist) -> tuple:
    name = g.name.removeprefix("NVIDIA ")
    if g.lost:
        return str(g.index), name, Text("✖ GPU LOST", style="bold red"), Text(g.error[:30])
    mem = f"{na(g.mem_used and g.mem_used / 2**30, '{:.1f}')}/{na(g.mem_total and g.mem_total / 2**30, '{:.0f}')}G"
    power = f"{na(g.power_w, '{:.0f}')}/{na(g.power_limit_w, '{:.0f}')}W"
    return (str(g.index), name, na(g.util_pct, "{}%"), spark(util_hist), mem, spark(mem_hist),
            na(g.temp_c, "{}°C"), power, na(g.sm_clock_mhz))


def loss_curve(losses: tuple[float, ...]) -> str:
    """The whole run, bucketed: each block is the mean loss of its share of the steps."""
    n = len(losses)
    buckets = [losses[i * n // LOSS_CURVE_WIDTH:(i + 1) * n // LOSS_CURVE_WIDTH] for i in range(LOSS_CURVE_WIDTH)]
    means = [sum(b) / len(b) for b in buckets if b]
    top = max(means) or 1.0
    curve = "".join(BLOCKS[min(7, int(v / top * 7.999))] for v in means)
    return f"training loss over {n} logged steps (first {losses[0]:.3g}, now {losses[-1]:.3g})\n{curve}"


def checkpoints_text(picked: dict) -> str:
    """pick-checkpoint's measurements: τ per checkpoint as a sparkline, then one line each beside its epoch's
    losses; * the deployed one, ! training and serving disagree by far."""
    entries = picked.get("checkpoints") or []
    if not entries:
        return ""
    taus = [e["tau"] for e in entries]
    lo, hi = min(taus), max(taus)
    line = "".join(BLOCKS[min(7, int((t - lo) / (hi - lo) * 7.999)) if hi > lo else 3] for t in taus)
    chosen = (picked.get("chosen") or {}).get("label")
    head = (f"τ per checkpoint ({picked.get('backend')}, {picked.get('prompts')} prompts): {line}  "
            f"{lo:.2f}–{hi:.2f}" + (f"  deployed: {chosen}" if chosen else "  (measuring…)"))
    rows = [f"{'':2}{'ckpt':<12}{'train':>8}{'val':>8}{'val acc':>22}{'τ':>8}  acceptance"]
    for e in entries:
        mark = "*" if e["label"] == chosen else ("!" if e.get("disagrees") else " ")
        val_acc = " ".join(f"{a:.2f}" for a in e.get("val_acc") or []) or "N/A"
        losses = f"{na(e.get('train_loss'), '{:.3f}'):>8}{na(e.get('val_loss'), '{:.3f}'):>8}"
        rows.append(f"{mark:<2}{e['label']:<12}{losses}{val_acc:>22}{e['tau']:>8.3f}  "
                    + " ".join(f"{a:.2f}" for a in e["acceptance_per_position"]))
    return "\n".join([head, *rows])


def matrix_rows(evaluation: dict) -> list[tuple]:
    """In the order of EvalTab.MATRIX_COLUMNS: what decides first (speedup, τ, lossless), the widest last."""
    rows: list[tuple] = []
    for method, row in (evaluation.get("matrix") or {}).items():
        if row.get("error") and not row.get("levels"):  # a refused method is a row saying why
            rows.append((method, "", "", "", "", "", "", "", Text(f"✖ {row['error'][:60]}")))
        same = "" if method == "baseline" else ("✔ yes" if row.get("identical_outputs") else "✖ NO")
        for c, level in sorted((row.get("levels") or {}).items(), key=lambda kv: verdict.concurrency_order(kv[0])):
            acc = level.get("acceptance_per_position") or []
            bars = " ".join(f"{BLOCKS[min(7, int(a * 7.999))]}{a:.2f}" for a in acc)
            rows.append((method, str(c), na(level.get("speedup"), "x{}"),
                         na(level.get("mean_acceptance_length"), "{:.3f}"), same,
                         na(level.get("output_tok_s"), "{:.1f}"), na(level.get("ttft_ms"), "{:.1f}"),
                         na(level.get("decode_tpot_ms"), "{:.2f}"), bars))
    return rows


def decision_text(evaluation: dict, run: RunSnapshot | None = None) -> str:
    """The decision, whole (it wraps), its why (a step's cost with and without the head, the τ from which it
    pays), and each method's tokens per decode step at the lowest concurrency: n-gram's beside the head's
    (its τ counts only the steps where it drafted)."""
    low = min(evaluation.get("concurrency") or [1])
    per_step = [f"{method} {level['tokens_per_step']:.2f}" for method, row in (evaluation.get("matrix") or {}).items()
                if (level := level_of(row, low)) and level.get("tokens_per_step") is not None]
    v = verdict.of_snapshot(run, evaluation) if run else None
    decision = decision_in(evaluation)
    lines = [f"decision: {decision.line if decision else 'not measured yet'}",
             *([verdict.figures_line(v)] if v and verdict.figures_line(v) else []),
             *([f"why: {v['why']}"] if v and v.get("why") else []),
             *([f"tokens per decode step at c = {low}: " + " · ".join(per_step)] if per_step else [])]
    return "\n".join(lines)


def server_text(s: dict, profile: Profile) -> str:
    if s.get("state") != "running":
        return f"vLLM on {profile.server.host}:{profile.server.port}: not running ({s.get('state')})"
    return (f"mode {s['mode']} · pid {s['pid']} (group {s['pgid']}: {s.get('pids')}) · port {s['port']} · "
            f"{'healthy' if s.get('healthy') else 'NOT healthy'} · up {fmt_secs(s.get('uptime_s'))}\n"
            f"log {s.get('log')}")


def summary(run: RunSnapshot, current: str | None, gpus: gpu.GpuSnapshot | None) -> str:
    s = run.server
    server = (f"{s.get('mode')} pid {s.get('pid')} :{s.get('port')} {'healthy' if s.get('healthy') else 'not healthy'}"
              if s.get("state") == "running" else "no server")
    gpu_count = "GPUs …" if gpus is None else "no NVML" if gpus.unavailable else f"{len(gpus.gpus)} GPU(s)"
    return f" {Path(run.root).name} · job {run.state} · stage {current or '-'} · {server} · {gpu_count}"


def note_line(note: dict) -> str:
    return f"{note['ts'][11:19]} {note.get('stage') or note.get('source')}: {note['text']}"


def holder_text(holder: dict) -> str:
    return f"Run {holder.get('run', '?')} (pid {holder.get('pid', '?')})"


def outcome(run: RunSnapshot, evaluation: dict | None) -> str:
    """The result once deploy-measure decided (deploy or not and why, τ, the speedup at each level, the
    break-even τ, lossless), and what to do next once the run has ended (or stopped)."""
    result = verdict.result_lines(verdict.of_snapshot(run, evaluation))
    ended = run.state not in ("running", "not started")
    return "\n".join(line for line in (result, ended and f"next: {jobs.next_step(run.state, run.root)}") if line)
