"""A server's prefill rate from vLLM's own prompt-token counter, sampled while something else drives it (issue 26,
item 4): the whole window, and the steady middle that a short run's ramp and tail do not weigh on.

    python bench/gpu/prompt_rate.py sample --port 8811 --out FILE   # until stopped: "seconds tokens" a line
    python bench/gpu/prompt_rate.py rate FILE [FILE ...]            # per file: whole window, 10–90 % of its tokens

The whole window runs from the last sample before the counter moved to its last move; first-to-last, from its
first move to its last (what the extract stage reports as its tokens_per_s: pipeline.serving.client.PromptWindow); the
steady rate is the slope between the samples where 10 % and 90 % of the window's tokens had arrived.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.serving import client  # noqa: E402


def sample(port: int, out: Path, every: float) -> int:
    with out.open("a") as f:
        while True:
            n = client.prompt_tokens(f"http://127.0.0.1:{port}")
            if n is not None:
                f.write(f"{time.time():.3f} {n:.0f}\n")
                f.flush()
            time.sleep(every)


def rate(path: Path) -> dict:
    pts = [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line.strip()]
    if len(pts) < 3:
        return {"file": path.name, "samples": len(pts)}
    base = pts[0][1]
    moving = [(t, n - base) for t, n in pts if n > base]
    if not moving:
        return {"file": path.name, "samples": len(pts), "tokens": 0}
    start = max(t for t, n in pts if n == base)  # the last sample before the counter moved
    end_t, total = next((t, n) for t, n in moving if n == moving[-1][1])
    lo = next((t, n) for t, n in moving if n >= 0.1 * total)
    hi = next((t, n) for t, n in moving if n >= 0.9 * total)
    first_t, first_n = moving[0]
    return {"file": path.name, "tokens": int(total), "window_s": round(end_t - start, 2),
            "tokens_per_s": round(total / (end_t - start)),
            "first_to_last_tokens_per_s": round((total - first_n) / (end_t - first_t)) if end_t > first_t else None,
            "steady_tokens_per_s": round((hi[1] - lo[1]) / (hi[0] - lo[0])) if hi[0] > lo[0] else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--port", type=int, default=8811)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--every", type=float, default=0.25)
    r = sub.add_parser("rate")
    r.add_argument("files", type=Path, nargs="+")
    a = ap.parse_args()
    if a.cmd == "sample":
        return sample(a.port, a.out, a.every)
    for f in a.files:
        print(rate(f))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
