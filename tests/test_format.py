"""The files the pipeline writes are the ones speculators' own code reads."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.data import target
from pipeline.data.target import resolve_layer_ids
from pipeline.layout.rundir import RunDir


def layers(run):
    """The run's own profile: hidden size and vLLM-style layer ids (aux ids, then the final layer)."""
    p = run.profile()
    ids = resolve_layer_ids(p.extract.layer_ids, p.demo_target.num_layers)
    assert len(ids) >= 2 and ids[-1] == p.demo_target.num_layers  # the last slot is the final layer
    return p.demo_target.hidden_size, ids


def test_prepared_data_and_hidden_states_pass_speculators_loader(finished_run):
    from speculators.train.data import ArrowDataset

    run = RunDir.open(finished_run)
    ds = ArrowDataset(max_len=run.profile().train.total_seq_len, datapath=run.prepared_dir, on_missing="raise",
                      train_ratio=1.0)
    assert len(ds) == run.stage_state("prepare")["figures"]["rows"]
    hidden, ids = layers(run)
    aux = len(ids) - 1
    for i in range(len(ds)):
        item = ds[i]
        assert not type(item).__name__ == "SampleUnavailable", f"sample {i} rejected"
        n = item["input_ids"].shape[0]
        assert item["input_ids"].dtype == torch.int64
        assert item["hidden_states"].shape == (n, aux * hidden)  # the aux layers, flattened
        assert item["verifier_last_hidden_states"].shape == (n, hidden)
        assert item["loss_mask"].shape == (n,)


def test_hidden_state_file_layout_and_prenorm_last_layer(finished_run):
    run = RunDir.open(finished_run)
    tdir = run.stage_state("build-target")["figures"]["target_dir"]
    model = target.load_model(tdir, "float32")
    f = load_file(str(run.hidden_states_dir / "hs_0.safetensors"))
    assert set(f) == {"token_ids", "hidden_states"} and f["token_ids"].dtype == torch.int64
    ids = f["token_ids"].unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hs = f["hidden_states"]
    hidden, layer_ids = layers(run)
    assert hs.shape == (ids.shape[1], len(layer_ids), hidden)
    for slot, layer in enumerate(layer_ids[:-1]):
        torch.testing.assert_close(hs[:, slot], out.hidden_states[layer][0], rtol=1e-5, atol=1e-5)
    # The last slot is the final layer before the final norm; normalising it gives what transformers returns.
    last, final = hs[:, -1], out.hidden_states[layer_ids[-1]][0]
    assert not torch.allclose(last, final, atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(last), final, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.lm_head(model.model.norm(last)), out.logits[0], rtol=1e-4, atol=1e-4)


def test_vocab_files_equal_speculators_mapping(finished_run):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    run = RunDir.open(finished_run)
    p = run.profile()
    draft, vocab = p.vocab.draft_vocab_size, p.demo_target.vocab_size
    freq = torch.load(run.prepared_dir / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft, vocab)
    assert np.array_equal(np.load(run.prepared_dir / f"d2t-{draft}.npy"), d2t.numpy())
    assert np.array_equal(np.load(run.prepared_dir / f"t2d-{draft}.npy"), t2d.numpy())
    assert d2t.shape == (draft,) and t2d.shape == (vocab,)
    # every counted (assistant) token is reachable by the draft when D exceeds the distinct count
    assert len(freq) <= draft, "the profile's draft vocabulary no longer exceeds the distinct tokens counted"
    assert all(t2d[t] for t in freq)


def test_checkpoint_is_a_speculators_eagle3_model(finished_run):
    run = RunDir.open(finished_run)
    ckpt = run.stage_state("train")["figures"]["checkpoint"]
    from pipeline.evaluation.offline_decoding import load_draft
    draft = load_draft(ckpt)
    _, ids = layers(run)
    assert draft.target_layer_ids == ids[:-1]  # the trainer takes the final layer as its target, not an aux id
    assert draft.lm_head.weight.shape[0] == run.profile().vocab.draft_vocab_size


@pytest.mark.parametrize("total,world", [(10, 3), (7, 4), (3, 5), (100, 8), (8, 1)])
def test_extraction_shards_cover_every_row_once_like_speculators(total, world):
    """Several extraction servers split the rows as generate-offline-data --world-size/--rank does."""
    from speculators.data_generation.offline import get_indices_to_process  # noqa: PLC0415

    from pipeline.stages.extract import shard
    slices = [shard(total, world, r) for r in range(world)]
    assert sorted(i for s in slices for i in s) == list(range(total))
    for r, s in enumerate(slices):
        assert list(s) == get_indices_to_process(total, None, [], world, r)


def test_two_extraction_shards_together_write_what_one_extraction_writes(finished_run, tmp_path):
    """extract.world_size = 2: ranks 0 and 1 (as on two machines) each write only their slice; together
    they reproduce the single extraction file for file."""
    from datasets import load_from_disk

    from pipeline.stages.extract import extract, hs_path, shard

    run = RunDir.open(finished_run)
    model = target.load_model(run.stage_state("build-target")["figures"]["target_dir"], "float32")
    ds = load_from_disk(str(run.prepared_dir))
    ids = run.stage_state("extract")["figures"]["layer_ids"]
    out = tmp_path / "hs"
    counts = [extract(model, ds, out, ids, 4, 4096, 2, indices=shard(len(ds), 2, r))["extracted"] for r in (0, 1)]
    assert counts == [len(shard(len(ds), 2, 0)), len(shard(len(ds), 2, 1))] and sum(counts) == len(ds)
    for i in range(len(ds)):
        mine, whole = load_file(str(hs_path(out, i))), load_file(str(hs_path(run.hidden_states_dir, i)))
        assert torch.equal(mine["token_ids"], whole["token_ids"])
        torch.testing.assert_close(mine["hidden_states"], whole["hidden_states"], rtol=1e-5, atol=1e-5)
