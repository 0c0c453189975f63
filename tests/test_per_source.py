"""Acceptance per source (issue 44 item 5): a mix's held-out prompts come from every source, any first n of
them span the sources, and the report gives τ per source (an average hides where a head is weak)."""
import json

from pipeline.data import conversations, sources
from pipeline.data.conversations import heldout_shares, split_heldout
from pipeline.profile import load_profile
from pipeline.report.notes import source_lines
from tests.helpers import TINY


def conv(i: int, source: str | None) -> dict:
    c = {"id": f"{source}{i}", "messages": [{"role": "user", "content": f"q {i}"},
                                           {"role": "assistant", "content": f"a {i}"}]}
    return {**c, "source": source} if source else c


def test_every_source_gives_one_then_its_share():
    assert heldout_shares({"a": 90, "b": 9, "c": 1}, 10) == {"a": 8, "b": 2, "c": 0}  # c's only row stays in training
    assert heldout_shares({"a": 50, "b": 50}, 3) in ({"a": 2, "b": 1}, {"a": 1, "b": 2})
    assert heldout_shares({"a": 5, "b": 5, "c": 5}, 2) == {"a": 1, "b": 1, "c": 0}  # fewer than the sources
    assert sum(heldout_shares({"a": 7, "b": 3, "c": 40}, 11).values()) == 11


def test_a_mix_is_held_out_from_every_source_and_its_prefix_spans_them():
    rows = [conv(i, "0:big") for i in range(40)] + [conv(i, "1:small") for i in range(4)]
    train, held = split_heldout(rows, 6)
    assert len(train) == 38 and len(held) == 6 and not {c["id"] for c in train} & {c["id"] for c in held}
    assert {c["source"] for c in held[:2]} == {"0:big", "1:small"}  # taken in turn: num_prompts = 2 sees both
    assert [c["id"] for c in held if c["source"] == "1:small"] == ["1:small3"]  # each source's last ones
    plain = [conv(i, None) for i in range(10)]
    assert split_heldout(plain, 3) == (plain[:7], plain[7:])  # one source: the last rows, as before


def test_the_gathered_mix_names_each_rows_source_and_the_loader_keeps_it(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(conv(i, None)) + "\n" for i in range(6)))
    b.write_text("".join(json.dumps(conv(i + 100, None)) + "\n" for i in range(3)))
    data = load_profile(TINY, {"data.conversations": [{"source": str(a)}, {"source": str(b)}]}).data
    out = tmp_path / "mix.jsonl"
    sources.gather(data, tmp_path / "no-demo.jsonl", out, tmp_path / "record.json")
    loaded = conversations.load(out).conversations
    assert sorted({c["source"] for c in loaded}) == ["0:a.jsonl", "1:b.jsonl"]
    assert all(c["id"].startswith(c["source"]) for c in loaded)
    _, held = split_heldout(loaded, 2)
    assert {c["source"] for c in held} == {"0:a.jsonl", "1:b.jsonl"}


def test_the_report_gives_tau_per_source():
    per = {"0:gsm8k": {"prompts": 3, "tau": 2.5, "acceptance_per_position": [0.8, 0.5, 0.2]},
           "1:sharegpt": {"prompts": 5, "tau": 1.75, "acceptance_per_position": [0.5, 0.2, 0.05]}}
    lines = source_lines(per)
    assert lines[0].startswith("τ per source") and "| 0:gsm8k | 3 | 2.5 | 0.80 / 0.50 / 0.20 |" in lines
    assert source_lines({"0:only": per["0:gsm8k"]}) == []  # one source: the overall τ says it


def test_through_vllm_each_source_is_sent_alone_between_two_scrapes(monkeypatch):
    """A server's /metrics count every request: each source's prompts go alone, its counters are the difference
    of two scrapes (a stand-in server here: prompts of source a accept 2 tokens a draft, of source b none)."""
    from types import SimpleNamespace

    from pipeline.serving.client import SpecCounters
    from pipeline.stages import served

    seen = {"counters": SpecCounters(0, 0, 0, (0.0, 0.0, 0.0)), "sent": []}

    def send_all(url, model, prompts, max_tokens, concurrency, **kw):
        seen["sent"].append((len(prompts), concurrency))
        drafts = 4 * len(prompts)
        accepted = 2 * drafts if prompts[0][0] == 1 else 0
        c = seen["counters"]
        per = (c.per_position[0] + (drafts if accepted else 0), c.per_position[1] + (drafts if accepted else 0),
               c.per_position[2])
        seen["counters"] = SpecCounters(c.drafts + drafts, c.draft_tokens + 3 * drafts, c.accepted + accepted, per)
        return {}

    monkeypatch.setattr(served, "send_all", send_all)
    monkeypatch.setattr(served.client, "scrape", lambda url: seen["counters"])
    ev = SimpleNamespace(concurrency=[1, 8], max_new_tokens=16, min_new_tokens=0)
    prompts = [[1, 5], [2, 5], [1, 6], [2, 6], [1, 7]]
    per = served.per_source(SimpleNamespace(base_url="http://x"), "m", prompts, ["a", "b", "a", "b", "a"], ev, None)
    assert per["a"] == {"prompts": 3, "tau": 3.0, "acceptance_per_position": [1.0, 1.0, 0.0]}
    assert per["b"]["tau"] == 1.0 and per["b"]["prompts"] == 2
    assert seen["sent"] == [(3, 3), (2, 2)]  # each source alone, at most the highest concurrency
    lines = notes_lines({"existing": per, "eagle3": {"a": {"prompts": 3, "tau": 3.5}}})
    assert "| source | prompts | existing | eagle3 |" in lines
    assert "| a | 3 | 3 | 3.5 |" in lines and "| b | 2 | 1 | – |" in lines


def notes_lines(rows):
    from pipeline.report.notes import served_source_lines
    return served_source_lines(rows)
