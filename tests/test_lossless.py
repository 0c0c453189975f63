"""Speculative output must equal the target's greedy output; the stage must catch it when not."""
import json
from itertools import pairwise

import pytest
import torch

from pipeline.data import conversations, target
from pipeline.evaluation import offline_decoding
from pipeline.layout.rundir import RunDir
from pipeline.run.runner import run_stages
from tests.helpers import copy_run_dir


def load(finished_run):
    run = RunDir.open(finished_run)
    tdir = run.stage_state("build-target")["figures"]["target_dir"]
    model = target.load_model(tdir, "float32")
    tok = target.load_tokenizer(tdir)
    draft = offline_decoding.load_draft(run.stage_state("train")["figures"]["checkpoint"])
    heldout = (run.data_dir / "heldout_prompts.jsonl").read_text()
    prompts = [json.loads(line)["messages"] for line in heldout.splitlines()]
    return run, model, tok, draft, prompts


def test_offline_evaluation_result(finished_run):
    run = RunDir.open(finished_run)
    res = json.loads((run.eval_dir / "offline.json").read_text())
    assert res["lossless"] and res["mismatches"] == []
    assert 1.0 <= res["tau"] <= 1 + res["k"]
    assert res["tau"] == pytest.approx(1 + res["accepted"] / res["rounds"], abs=1e-3)
    acc = res["acceptance_per_position"]
    assert all(a >= b for a, b in pairwise(acc))  # a chain: position i+1 needs position i
    assert sum(acc) == pytest.approx(res["tau"] - 1, abs=1e-3)


@pytest.mark.parametrize("k", [1, 4])
def test_trained_and_untrained_heads_are_lossless(finished_run, k):
    _, model, tok, draft, prompts = load(finished_run)
    eos = offline_decoding.eos_ids(model)
    untrained = offline_decoding.load_draft(RunDir.open(finished_run).stage_state("train")["figures"]["checkpoint"])
    torch.manual_seed(0)
    for p in untrained.fc.parameters():
        torch.nn.init.normal_(p, std=1.0)  # scramble: acceptance collapses, correctness must not
    for head in (draft, untrained):
        proposer = offline_decoding.DraftProposer(head)
        reader = target.HiddenStateReader(model, proposer.aux_ids)
        for msgs in prompts[:2]:
            ids = conversations.render_ids(tok, msgs, add_generation_prompt=True)
            out, stats = offline_decoding.speculative_generate_batch(reader, proposer, [ids], k, 20, eos)[0]
            assert out == offline_decoding.greedy_reference_batch(model, [ids], 20, eos)[0]
            assert stats.rounds > 0 and len(stats.per_position) == k


def test_draft_step0_matches_speculators_forward(finished_run):
    """The proposer's first step is speculators' own Eagle3DraftModel.forward on the same inputs."""
    _, model, tok, draft, prompts = load(finished_run)
    proposer = offline_decoding.DraftProposer(draft)
    reader = target.HiddenStateReader(model, proposer.aux_ids)
    ids = conversations.render_ids(tok, prompts[0], add_generation_prompt=True)
    _, states = reader(torch.tensor([ids]))
    aux = states.flatten(2)[:, :-1]
    nxt = ids[1:]
    ref_model = offline_decoding.load_draft(RunDir.open(finished_run).stage_state("train")["figures"]["checkpoint"])
    with torch.no_grad():
        tokens = ref_model(hidden_states=aux, input_ids=torch.tensor([nxt]),
                           document_ids=torch.zeros(1, len(nxt), dtype=torch.long), ttt_steps=1)
    step0 = int(tokens[0][0, -1])
    expected = step0 + int(ref_model.d2t[step0])
    assert proposer.propose(aux, nxt, 1) == [expected]


def test_stage_fails_when_output_differs_from_greedy(finished_run, tmp_path, monkeypatch):
    run_dir = copy_run_dir(finished_run, tmp_path / "copy")
    run = RunDir.open(run_dir)
    real = offline_decoding.greedy_reference_batch
    monkeypatch.setattr(offline_decoding, "greedy_reference_batch",
                        lambda *a, **k: [[t + 1 for t in row] for row in real(*a, **k)])  # a verifier that disagrees
    run.update_stage("evaluate-offline", status="pending")
    with pytest.raises(Exception, match="lossless check failed: 4/4"):
        run_stages(run, start="evaluate-offline")
    assert run.stage_state("evaluate-offline")["status"] == "failed"
    assert json.loads((run.eval_dir / "offline.json").read_text())["lossless"] is False


def test_batched_speculation_equals_one_prompt_at_a_time(finished_run):
    """Right padding must change nothing: each row of a batch gets the drafts, acceptances and output it
    gets alone, and the batched greedy reference equals the one-prompt one."""
    _, model, tok, draft, prompts = load(finished_run)
    eos = offline_decoding.eos_ids(model)
    proposer = offline_decoding.DraftProposer(draft)
    reader = target.HiddenStateReader(model, proposer.aux_ids)
    ids = [conversations.render_ids(tok, msgs, add_generation_prompt=True) for msgs in prompts[:4]]
    assert len({len(i) for i in ids}) > 1  # rows of different lengths: padding is exercised
    batched = offline_decoding.speculative_generate_batch(reader, proposer, ids, 3, 24, eos)
    refs = offline_decoding.greedy_reference_batch(model, ids, 24, eos)
    for p, (out, st), ref in zip(ids, batched, refs, strict=True):
        alone, st1 = offline_decoding.speculative_generate_batch(reader, proposer, [p], 3, 24, eos)[0]
        assert out == alone == ref == offline_decoding.greedy_reference_batch(model, [p], 24, eos)[0]
        assert (st.rounds, st.accepted, st.per_position, st.target_forwards) == \
            (st1.rounds, st1.accepted, st1.per_position, st1.target_forwards)
