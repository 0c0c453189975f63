"""The run's decision and its why, as data (`status --json`) and as text (the Run tab's result line, the Eval
tab, `status`). Read from deploy-measure's eval/online.json (there also when the head failed its own checks)
and its recorded figures. Any field may be missing, and a level may carry fields this module does not know
(a k schedule, a traffic mix): the data passes a level's plain values through, the text shows what exists."""
from __future__ import annotations

from pipeline.layout.matrix import level_of, second_instance
from pipeline.layout.results import DeployMeasureResult, EvaluateOfflineResult, RunSnapshot, decision_in


def concurrency_order(key) -> tuple:
    """Levels in numeric order; a key that is not a number (a traffic mix) after them, by name."""
    text = str(key)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


def verdict(online: dict | None, measured: DeployMeasureResult, offline: EvaluateOfflineResult) -> dict | None:
    """The decision with its figures; None before deploy-measure decided."""
    decision = decision_in(online) or measured.verdict()
    if decision is None:
        return None
    online = online or {}
    matrix = online.get("matrix") or {}
    # the row deploy-measure weighed for deployment (a k of the sweep, a k per batch size), else the head's own
    row = ((online.get("considered") or {}).get("row")) or "eagle3"
    head = matrix.get(row) or matrix.get("eagle3") or {}
    levels = {str(c): {k: v for k, v in level.items() if isinstance(v, (int, float, str, bool))}
              for c, level in sorted((head.get("levels") or {}).items(), key=lambda kv: concurrency_order(kv[0]))
              if isinstance(level, dict)}
    second = online.get("second_server")
    second = second if isinstance(second, dict) and second.get("row") == second_instance(row) else {}
    pooled = second.get("levels") or {}
    low = level_of(head, min(online.get("concurrency") or [1]))
    # τ as tokens per decode step: the unit of the break-even τ it is compared with (step_economics)
    tau = next((t for t in (measured.tokens_per_step, low.get("tokens_per_step"), measured.mean_acceptance_length,
                            low.get("mean_acceptance_length")) if t is not None), None)
    schedule = online.get("schedule")
    schedule = schedule if isinstance(schedule, dict) else {}
    return {"deploy": decision.deploy, "reason": decision.reason, "line": decision.line, "row": row, "tau": tau,
            # where the head was measured on a second server, the pooled speedup the decision weighed
            "speedup": {c: (pooled.get(c) or [level.get("speedup")])[0] for c, level in levels.items()},
            "k_per_level": {str(c): k for c, k in (schedule.get("per_level") or {}).items()},
            "expected_speedup": online.get("expected_speedup"), "traffic": online.get("traffic"),
            "break_even_tau": measured.break_even_tau, "deploy_speedup": measured.deploy_speedup,
            "step_ms": measured.step_ms, "baseline_step_ms": measured.baseline_step_ms,
            "lossless": head.get("identical_outputs", measured.identical_outputs),
            "numeric_ties": head.get("numeric_ties"), "offline_lossless": offline.lossless,
            "why": measured.why(), "levels": levels}


def of_snapshot(snap: RunSnapshot, online: dict | None) -> dict | None:
    return verdict(online, snap.result(DeployMeasureResult), snap.result(EvaluateOfflineResult))


def figures_line(v: dict, plain: bool = False) -> str:
    """τ, the speedup at each measured level, the break-even τ and the lossless check, what of them exists.
    `plain`: ASCII words for a terminal that may not take the glyphs (`status`)."""
    tau, yes, no = ("tau", "yes", "NO") if plain else ("τ", "✔", "✖")
    parts = [f"{tau} {v['tau']:.2f}"] if v.get("tau") is not None else []
    ks = v.get("k_per_level") or {}
    speedups = [f"x{s:.2f} at c={c}" + (f" k={ks[c]}" if c in ks else "")
                for c, s in (v.get("speedup") or {}).items() if isinstance(s, (int, float))]
    if speedups:
        parts.append("speedup " + ", ".join(speedups))
    expected = v.get("expected_speedup") or {}
    if isinstance(expected.get("median"), (int, float)):
        parts.append(f"x{expected['median']:.2f} expected on the traffic")
    if v.get("break_even_tau") is not None:
        parts.append(f"pays from {tau} {v['break_even_tau']:.2f}")
    if v.get("lossless") is not None:
        ties = f" ({v['numeric_ties']} bf16 ties)" if v.get("numeric_ties") else ""
        parts.append(f"lossless {yes}{ties}" if v["lossless"] else f"lossless {no}: outputs differ{ties}")
    return ("; " if plain else " · ").join(parts)


def result_lines(v: dict | None) -> str:
    """The Run tab's result: the decision with its reason, then its figures (each wraps, never cut)."""
    if v is None:
        return ""
    head = f"{'✔' if v['deploy'] else '✖'} {v['line']}"
    return "\n".join(line for line in (head, figures_line(v)) if line)
