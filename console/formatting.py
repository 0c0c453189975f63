"""Plain text for the panels: sizes, clocks, estimates, counts, bars and sparklines."""
from __future__ import annotations

from pipeline import units

BLOCKS = "▁▂▃▄▅▆▇█"


def human_bytes(n: float | None) -> str:
    return "N/A" if n is None else units.human(n, sep="")


def na(value, fmt="{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def fmt_secs(s: float | None) -> str:
    if s is None:
        return ""
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def coarse_secs(s: float | None) -> str:
    """The running stage's elapsed time, in whole minutes as its ETA: a repaint of the stage table costs
    ~40 ms on a small CPU (NOTES.md), so a clock that moves every second, or every 10 s, would be most
    of the console's cost. Finished stages show m:ss."""
    if s is None:
        return ""
    m = int(s) // 60
    return "<1m" if m == 0 else (f"{m}m" if m < 60 else f"{m // 60}h{m % 60:02d}m")


def eta_text(s: float | None) -> str:
    """An estimate, shown as one: whole minutes (it moves faster than the clock, so seconds would
    repaint the table every tick)."""
    t = coarse_secs(s)
    return t if t in ("", "<1m") else f"~{t}"


def count(n: float) -> str:
    """A count in at most 5 cells: 8, 120, 9999, 56.7k, 1.23M (`:g` alone writes 1.23457e+06)."""
    for threshold, scale, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(n) >= threshold:
            scaled = n / scale
            return f"{scaled:.3g}{suffix}" if abs(scaled) < 999.5 else f"{scaled:.0f}{suffix}"
    return f"{n:g}"


def figure(key: str, value) -> str:
    return f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"


def bar(fraction: float | None, width: int = 12) -> str:
    if fraction is None:
        return " " * width
    filled = round(fraction * width)
    return "█" * filled + "░" * (width - filled)


def spark(values, width: int = 8) -> str:
    """A text sparkline of the last `width` percentages (0-100), one block per sample."""
    tail = list(values)[-width:]
    return "".join(BLOCKS[min(7, int(v / 100 * 8))] for v in tail).rjust(width)
