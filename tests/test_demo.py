"""The demo convinces (issue 15): its target has learned its corpus, so its answers are not a random
model's loops, and the head the demo trains beats n-gram prompt lookup on the held-out prompts. Every
figure is computed by the runs here and compared with another computed figure, never with a constant
taken from an earlier run."""
import json

import pytest

from tests.conftest import ROOT, cli, completed_run, free_port

pytestmark = pytest.mark.integration  # the demo profile's whole run, and a second one up to regenerate

DEMO = ROOT / "profiles" / "demo.toml"
# The demo itself, without its three vLLM servers: the offline evaluation replays vLLM's n-gram proposer
# (pipeline/evaluation/prompt_lookup.py, held to vLLM's own function by tests/test_compat_adaptations.py).
OFFLINE = ('extract.backend="transformers"', "evaluate.online=false")
# Every epoch's head measured on the held-out prompts, the best deployed (pick-checkpoint)
EACH = ('evaluate.checkpoints="each"',)


def test_the_demo_target_has_learned_its_corpus_and_the_head_beats_ngram(tmp_path, cache_dir):
    demo = completed_run(tmp_path / "demo", DEMO, cache_dir, *OFFLINE, *EACH)
    # The same demo up to regeneration with the random-weight target the demo used to have
    proc = cli("run", DEMO, "--no-tui", "--until", "regenerate", "--run-dir", tmp_path / "random",
               "--set", f'run.cache_dir="{cache_dir}"', "--set", f"server.port={free_port()}",
               "--set", "demo_target.corpus_conversations=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    random_state = json.loads((tmp_path / "random" / "state.json").read_text())

    learned, loops = demo.stage_state("regenerate")["figures"], random_state["stages"]["regenerate"]["figures"]
    assert learned["answer_distinct_tokens"] >= 3 * loops["answer_distinct_tokens"], (learned, loops)
    assert learned["answer_repeated_trigram_share"] <= loops["answer_repeated_trigram_share"] / 3, (learned, loops)
    corpus = demo.stage_state("build-target")["figures"]
    assert corpus["corpus_loss_last"] < corpus["corpus_loss_first"] / 5, corpus

    picked = json.loads(demo.checkpoints_result.read_text())
    epochs = demo.profile().train.epochs
    assert [e["label"] for e in picked["checkpoints"]] == [str(i) for i in range(epochs)]  # every epoch measured
    best = max(e["tau"] for e in picked["checkpoints"])
    chosen = next(e for e in picked["checkpoints"] if e["label"] == picked["chosen"]["label"])
    assert chosen["tau"] == best and picked["checkpoints"][0]["tau"] < best  # training taught it something
    result = json.loads(demo.offline_result.read_text())
    assert result["tau"] == best  # the deployed head is the one evaluate-offline measures
    assert result["lossless"] and result["k"] == 3
    ngram = result["ngram"]
    # τ per verify step against n-gram's tokens per step: n-gram's own τ counts only the steps where it
    # found a match (vLLM's /metrics), the head drafts at every step (NOTES.md "The demo")
    assert result["tau"] >= 1.3 * ngram["tokens_per_step"], (result["tau"], ngram)
    assert result["tokens_per_target_forward"] > ngram["tokens_per_step"], result
