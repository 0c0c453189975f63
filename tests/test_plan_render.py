"""`eagle3-console plan` as people read it (issue 43 item 6): at 80 columns one profile per block with its
notes as a wrapped list, side by side where the terminal is wide enough; every total says its mode and adds
up with the figures above it; a box where no online split fits shows no online time."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.planning import plan
from pipeline.profile import load_profile
from pipeline.units import GIB
from tests.helpers import cli

PROFILES = sorted(f.stem for f in (Path(__file__).resolve().parents[1] / "profiles").glob("*.toml")
                  if f.stem != "base")  # base.toml is what the others extend, not a runnable profile
KIMI = ("kimi-k2.5-b300x8-full", "kimi-k2.5-rtx6000x8-lowered")
LABELS = [label for group in plan.ROWS for label, _ in group]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "s": 1, "min": 60, "h": 3600}


def make(name: str, **sets) -> plan.Plan:
    """A plan for the box the profile is written for (its disk), as `plan` makes it, not this machine's."""
    p = load_profile(name, sets, check_inputs=False)
    return plan.make_plan(p, free=int(p.hardware.disk_gib * GIB) if p.hardware.disk_gib else None)


def amount(text: str) -> float:
    """The first figure with its unit in a rendered value: "22.1 TiB (online)" -> 22.1 × 2**40, "51 min" -> 3060."""
    return sum(bounds(text)) / 2


def bounds(text: str) -> tuple[float, float]:
    """The range a rendered figure was rounded from: "2.3 TiB" -> 2.25 to 2.35 × 2**40."""
    m = re.search(r"([\d,]+)(\.\d+)? (PiB|TiB|GiB|MiB|KiB|B|h|min|s)\b", text)
    assert m, f"no figure in {text!r}"
    value = float(m.group(1).replace(",", "") + (m.group(2) or ""))
    half = 0.5 * 10 ** -len((m.group(2) or ".")[1:])
    return (value - half) * UNITS[m.group(3)], (value + half) * UNITS[m.group(3)]


def block_rows(text: str, profile: str) -> dict[str, str]:
    """label -> value of one profile's block in the narrow layout (a wrapped value joined again)."""
    lines = text.splitlines()
    start = lines.index(profile)
    rows: dict[str, str] = {}
    label = None
    for line in lines[start + 2:]:
        if line.startswith(f"{profile}: "):  # its notes: the block is over
            break
        if (found := next((lbl for lbl in LABELS if line.startswith(f"  {lbl}  ")), None)):
            label = found
            rows[label] = line[2 + len(label):].strip()
        elif label and line.startswith(" " * 20):  # a value's next line
            rows[label] += " " + line.strip()
    return rows


@pytest.mark.parametrize("name", PROFILES)
def test_every_shipped_profile_reads_at_80_columns(name):
    text = plan.table([make(name)], width=80)
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, too_wide


def test_all_profiles_together_read_at_80_and_fill_a_wide_terminal():
    plans = [make(n) for n in PROFILES]
    assert max(map(len, plan.table(plans, width=80).splitlines())) <= 80
    wide = plan.table(plans[:2], width=200).splitlines()
    assert 80 < max(map(len, wide)) <= 200  # side by side where it fits


def test_narrow_terminals_get_a_block_per_profile_wide_ones_a_table():
    plans = [make(n) for n in KIMI]
    narrow = plan.table(plans, width=80).splitlines()
    for name in KIMI:  # each profile heads its own block, underlined
        i = narrow.index(name)
        assert set(narrow[i + 1]) == {"-"}
    assert narrow.index(KIMI[0]) < narrow.index(KIMI[1])
    wide = plan.table(plans, width=200).splitlines()
    assert wide[0].split() == ["profile", *KIMI]


def test_the_notes_are_a_wrapped_list_that_says_everything():
    p = make("kimi-k2.5-b300x8-full")
    lines = plan.table([p], width=80).splitlines()
    start = lines.index(f"{p.profile}: where the figures come from")
    notes = []
    for line in lines[start + 1:]:
        if not line.startswith(("  - ", "    ")):
            break
        notes.append(line)
    items = [n for n in notes if n.startswith("  - ")]
    assert len(items) >= 9 and len(notes) > len(items)  # one item per source, the long ones wrapped
    assert all(len(n) <= 80 for n in notes)
    joined = " ".join(n.strip() for n in notes)
    for source in (p.extract.source, p.mode_why, p.evaluate_offline.why, p.break_even_tau.why):
        assert source in joined  # wrapped between words, nothing cut


@pytest.mark.parametrize("name", PROFILES)
def test_every_total_says_its_mode_and_adds_up(name):
    p = make(name)
    rows = block_rows(plan.table([p], width=40), p.profile)  # 40 columns: a block for any profile
    assert rows["disk: total (the run's mode)"].endswith(f"({p.mode})")
    assert amount(rows["disk: total (the run's mode)"]) == amount(rows[f"{p.mode}: disk total"])
    parts = [rows["disk: prepared data"], rows["disk: checkpoints"]]
    for mode, states in (("offline", rows["offline: hidden states"]), ("online", rows["online: states on disk"])):
        lo, hi = bounds(rows[f"{mode}: disk total"])
        each = [bounds(v) for v in (states, *parts)]  # what adds up, each as rounded for the screen
        assert lo <= sum(b[1] for b in each) and hi >= sum(b[0] for b in each) and hi >= each[0][0], (mode, rows)
    # the run's own totals, and only they, are marked as the run's
    for mode in ("offline", "online"):
        marked = [rows[f"total {what} ({mode})"].endswith("(the run's)") for what in ("wall", "GPU-hours")]
        assert marked == [mode == p.mode and p.totals[mode]["wall_s"] is not None] * 2, (mode, rows)


def test_the_online_wall_time_is_the_cache_and_the_planned_split():
    p = make("kimi-k2.5-b300x8-full")
    assert p.mode == "online" and p.online.fits and p.online.cache_s
    text = plan.table([p], width=40)  # a block, whatever fits
    rows = block_rows(text, p.profile)
    m = re.fullmatch(r"(.+) \(cache (.+) \+ split (.+)\)", rows["online: wall time"])
    assert m, rows["online: wall time"]
    (wall_lo, wall_hi), cache, split = (bounds(g) for g in m.groups())
    assert wall_lo <= cache[1] + split[1] and wall_hi >= cache[0] + split[0]
    planned = [line for line in text.splitlines() if line.startswith("▸ ")]
    assert len(planned) == 1 and bounds(planned[0].split("  ")[-2]) == split  # the split table's wall column
    assert amount(rows["total wall (online)"]) > wall_hi and amount(rows["total wall (offline)"]) > amount(
        rows["offline: extraction time"])


def test_no_split_fits_means_no_online_time_anywhere():
    low = make("kimi-k2.5-rtx6000x8-lowered")
    assert low.mode == "offline" and not low.online.fits and low.online.splits
    rows = block_rows(plan.table([low], width=40), low.profile)
    for label in ("online: wall time", "online: GPU-hours", "total wall (online)", "total GPU-hours (online)"):
        assert rows[label] == plan.NO_SPLIT
    assert not any(c.isdigit() for c in rows["online: split"])
    assert low.totals["online"] == {"wall_s": None, "gpu_hours": None} and low.online.gpu_hours is None
    # where the run itself would go online (no disk for offline), preflight's time line says there is none
    forced = replace(low, mode="online")
    assert plan.time_summary(forced).startswith("online: no time planned, no split fits this box")
    assert "online: no time planned" not in plan.time_summary(low)


def test_json_keeps_its_fields_and_says_whether_online_fits():
    proc = cli("plan", *KIMI, "--json")
    assert proc.returncode == 0, proc.stderr
    full, low = json.loads(proc.stdout)
    for d in (full, low):
        assert {"disk_total", "disk_offline", "disk_online", "totals", "online", "mode"} <= d.keys()
    assert full["online_fits"] and not low["online_fits"]
    assert full["online"]["wall_s"] == pytest.approx(full["online"]["cache_s"] + min(
        s["wall_s"] for s in full["online"]["splits"] if s["fits"]))
    assert low["online"]["wall_s"] is None and low["totals"]["online"]["wall_s"] is None


def test_the_cli_lays_out_for_the_terminals_width():
    for columns, side_by_side in (("80", False), ("200", True)):
        out = cli("plan", *KIMI, env={"COLUMNS": columns})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert max(map(len, lines)) <= int(columns)
        assert (lines[0].split() == ["profile", *KIMI]) is side_by_side and (lines[0] == KIMI[0]) is not side_by_side
