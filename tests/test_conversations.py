import json

import pytest

from pipeline.data import conversations
from pipeline.layout.rundir import RunDir
from pipeline.profile import load_profile
from pipeline.run.runner import run_stages
from pipeline.stages.base import StageError
from tests.conftest import TINY


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
             json.dumps({"input_ids": [1, 2], "loss_mask": [0]}), json.dumps([1, 2]),
             json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}), ""]
    path.write_text("\n".join(lines))
    loaded = conversations.load(path)
    assert len(loaded.conversations) == 1 and len(loaded.token_rows) == 1
    assert [n for n, _ in loaded.bad] == [2, 3, 4, 5, 6]
    assert "role 'robot'" in dict(loaded.bad)[3]


def test_assistant_only_loss_mask(cache_dir):
    from pipeline.data.target import load_tokenizer
    from pipeline.stages.build_target import build_target

    tok = load_tokenizer(build_target(load_profile(TINY).demo_target, cache_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "four"}, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "six"}]
    rows = conversations.assistant_rows(tok, msgs)
    assert len(rows) == 2  # one row per assistant turn
    for row, answer in zip(rows, ["four", "six"], strict=True):
        learned = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(learned) == answer + "<|end|>"
    assert rows[0]["input_ids"] == rows[1]["input_ids"][: len(rows[0]["input_ids"])]


def test_prepare_reports_malformed_rows(tmp_path, cache_dir):
    conv = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"}]}
    conv.write_text("\n".join([json.dumps(good)] * 6 + ["garbage"]) + "\n")
    profile = load_profile(TINY, {"data.conversations": str(conv), "data.regenerate": False, "data.heldout": 2,
                                  "evaluate.num_prompts": 2, "run.cache_dir": str(cache_dir)})
    run = RunDir.create(profile, tmp_path / "run")
    run_stages(run, until="prepare")
    figs = run.stage_state("prepare")["figures"]
    assert figs["skipped_malformed"] == 1 and figs["rows"] == 4 and figs["heldout_prompts"] == 2
    assert "c.jsonl:7: skipped malformed row: not JSON" in run.log_path("prepare").read_text()


GOOD = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"}]})


@pytest.mark.parametrize("rows,why", [
    (["garbage", "[]"], r"c.jsonl: no usable training row \(2 malformed, 0 without assistant tokens"),
    ([GOOD, GOOD], r"c.jsonl: 2 valid conversations leave none for training after holding out 2"),
], ids=["only-malformed-rows", "everything-held-out"])
def test_prepare_fails_when_nothing_is_left_to_train_on(tmp_path, cache_dir, rows, why):
    conv = tmp_path / "c.jsonl"
    conv.write_text("\n".join(rows) + "\n")
    profile = load_profile(TINY, {"data.conversations": str(conv), "data.regenerate": False, "data.heldout": 2,
                                  "evaluate.num_prompts": 2, "run.cache_dir": str(cache_dir)})
    run = RunDir.create(profile, tmp_path / "run")
    with pytest.raises(StageError, match=why):
        run_stages(run, until="prepare")
    assert run.stage_state("prepare")["status"] == "failed"


@pytest.mark.slow  # nothing started, but ~25 s of reading the stdlib's sources on 2 cores
def test_demo_answers_as_sources_are_the_same_conversations_with_their_definitions_code():
    """data.demo_answers = "source" (gpu-demo): the same ids in the same order as the docstring answers, each
    first answer the definition's own source (within SOURCE_CHARS, cut at a line), longer than its docstring."""
    import ast

    from pipeline.data import demo_data
    docs, codes = demo_data.conversations(200, 3), demo_data.conversations(200, 3, "source")
    assert [c["id"] for c in docs] == [c["id"] for c in codes]
    for doc, code in zip(docs, codes, strict=True):
        name = code["id"].rsplit(".", 1)[1]
        answer = code["messages"][2]["content"]
        assert len(answer) <= demo_data.SOURCE_CHARS
        head = next(line for line in answer.splitlines() if not line.startswith("@"))
        assert head.startswith((f"def {name}", f"class {name}", f"async def {name}")), head
        assert len(answer) > len(doc["messages"][2]["content"]) / 2
        if len(answer) < demo_data.SOURCE_CHARS - 200:  # uncut: the definition itself, as Python reads it
            ast.parse(answer)
    assert sum(len(c["messages"][2]["content"]) for c in codes) > 2 * sum(len(c["messages"][2]["content"])
                                                                          for c in docs)


@pytest.mark.integration  # prepare: a vLLM probe, speculators' prepare-data
def test_render_prepare_passes_token_rows_through_without_a_server(tmp_path, cache_dir):
    """tokenize = "render" on a file of pre-tokenized rows whose only conversation is held out: speculators'
    prepare-data passes the rows through (no server started), the conversation becomes the evaluation prompt."""
    conv = tmp_path / "c.jsonl"
    rows = [{"input_ids": list(range(3 + i, 30 + i)), "loss_mask": [0] * 7 + [1] * 20} for i in range(4)]
    conv.write_text("".join(json.dumps(r) + "\n" for r in rows) + GOOD + "\n")
    profile = load_profile(TINY, {"data.conversations": str(conv), "data.regenerate": False, "data.heldout": 1,
                                  "data.tokenize": "render", "evaluate.num_prompts": 1,
                                  "run.cache_dir": str(cache_dir)})
    run = RunDir.create(profile, tmp_path / "run")
    run_stages(run, until="prepare")
    figs = run.stage_state("prepare")["figures"]
    assert figs["tokenize"] == "pass-through" and figs["rows"] == figs["token_rows"] == 4
    assert figs["heldout_prompts"] == 1 and run.token_freq.is_file()
    from datasets import load_from_disk
    ds = load_from_disk(str(run.prepared_dir)).with_format(None)
    assert sorted(ds["input_ids"]) == [r["input_ids"] for r in rows]
    assert not run.train_conversations.exists() and not list(run.root.glob("logs/server-*"))  # nothing rendered
