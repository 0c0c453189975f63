"""The target's next release in miniature (issue 44 item 4, demo_target.next_release_steps): the old target
cached as itself, the new one the same shape and tokenizer trained further on other conversations — so that a
head of the old target can be measured on the new one, and trained on from (bench/next_release.py)."""
import json

import pytest

from pipeline.profile import ProfileError, load_profile
from pipeline.stages.build_target import PRETRAIN_RECORD, build_target, cache_key
from tests.helpers import TINY

SMALL = {"demo_target.vocab_size": 512, "demo_target.hidden_size": 32, "demo_target.intermediate_size": 64,
         "demo_target.num_layers": 2, "demo_target.tokenizer_source_files": 20, "demo_target.corpus_conversations": 16,
         "demo_target.corpus_steps": 3, "demo_target.corpus_batch": 2, "demo_target.corpus_seq": 32}


def spec(**over):
    return load_profile(TINY, overrides={**SMALL, **over}).demo_target


def test_the_old_target_keeps_its_key_and_the_new_one_has_its_own():
    old, new = spec(), spec(**{"demo_target.next_release_steps": 3})
    assert cache_key(old) == cache_key(old.model_copy(update={"next_release_seed": 1}))  # defaults kept out
    assert cache_key(new) != cache_key(old) != cache_key(spec(**{"demo_target.next_release_steps": 3,
                                                                  "demo_target.next_release_seed": 2}))
    slow = spec(**{"demo_target.next_release_steps": 3, "demo_target.next_release_lr": 1e-4})
    assert cache_key(slow) not in (cache_key(new), cache_key(old))  # another release, the same old one
    with pytest.raises(ProfileError, match=r"demo_target.next_release_lr"):
        spec(**{"demo_target.next_release_steps": 3, "demo_target.next_release_lr": -1})
    with pytest.raises(ProfileError, match=r"demo_target.next_release_lr.*needs next_release_steps > 0"):
        spec(**{"demo_target.next_release_lr": 1e-3})
    with pytest.raises(ProfileError, match=r"demo_target.next_release_steps.*corpus_conversations > 0"):
        spec(**{"demo_target.next_release_steps": 3, "demo_target.corpus_conversations": 0})


def test_the_new_release_is_the_old_one_trained_further(tmp_path):
    from safetensors.torch import load_file

    new_dir = build_target(spec(**{"demo_target.next_release_steps": 3, "demo_target.next_release_seed": 2,
                                   "demo_target.next_release_lr": 1e-3}), tmp_path)
    old_dir = tmp_path / f"demo-target-{cache_key(spec())}"  # whatever seed and rate the new release asks
    assert (old_dir / "model.safetensors").is_file()  # built on the way, cached as itself
    assert build_target(spec(), tmp_path) == old_dir  # and found there
    assert (new_dir / "tokenizer.json").read_text() == (old_dir / "tokenizer.json").read_text()
    old_w, new_w = load_file(old_dir / "model.safetensors"), load_file(new_dir / "model.safetensors")
    assert old_w.keys() == new_w.keys() and all(old_w[k].shape == new_w[k].shape for k in old_w)
    assert any(not old_w[k].equal(new_w[k]) for k in old_w)  # trained further
    record = json.loads((new_dir / PRETRAIN_RECORD).read_text())
    assert record["next_release"]["old_target"] == str(old_dir) and record["next_release"]["corpus_steps"] == 3
    assert record["corpus_steps"] == 3 and record["next_release"]["corpus_loss_last"] > 0
    assert record["next_release"]["corpus_lr"] == 1e-3 != record["corpus_lr"]
