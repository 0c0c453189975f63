"""n-gram prompt lookup replayed offline (pipeline/evaluation/prompt_lookup.py), counted as vLLM counts it; the
proposer itself is held to vLLM's own function in tests/test_compat_adaptations.py."""
from pipeline.evaluation.prompt_lookup import Acceptance, acceptance, propose


def test_a_copied_prompt_is_drafted_once_a_bigram_matches():
    # The prefill samples 5; [9, 5] and the 1-gram [5] find nothing (min 2); after 6, [5, 6] matches the
    # prompt's start and proposes 7 8 9, all accepted; the target adds 2.
    result = acceptance([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 2], k=3, min_n=2, max_n=4, max_model_len=64)
    assert (result.drafts, result.accepted, result.steps, result.decoded) == (1, 3, 2, 5)
    assert result.per_position == [1, 1, 1]
    assert result.tau == 4.0  # vLLM's mean acceptance length: over the one drafting step
    assert result.tokens_per_step == 2.5  # what the speed sees: over both steps


def test_an_answer_with_no_repeats_is_never_drafted():
    result = acceptance([1, 2, 3], [4, 5, 6, 7, 8], k=3, min_n=2, max_n=4, max_model_len=64)
    assert (result.drafts, result.accepted, result.steps, result.decoded) == (0, 0, 4, 4)
    assert result.tau == 1.0 and result.tokens_per_step == 1.0


def test_a_wrong_draft_costs_a_step_and_counts_as_a_draft():
    # [1, 2] occurred before, followed by 3: proposed, but the target says 9
    result = acceptance([1, 2, 3, 1], [2, 9], k=3, min_n=2, max_n=4, max_model_len=64)
    assert (result.drafts, result.accepted, result.steps, result.decoded) == (1, 0, 1, 1)
    assert result.per_position == [0, 0, 0]


def test_the_longest_match_wins_and_ties_take_the_earliest_occurrence():
    assert propose([1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 2, 4, 2, 64) == [7, 2]  # [1, 2, 3] beats [2, 3]
    assert propose([2, 3, 7, 2, 3, 8, 2, 3], 2, 4, 1, 64) == [7]  # [2, 3] twice: the earliest
    assert propose([1, 2, 1, 2], 2, 4, 3, 5) == [1]  # one token left before max_model_len
    assert propose([1], 2, 4, 3, 64) == []


def test_merged_counts_add_up():
    a = acceptance([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 2], 3, 2, 4, 64)
    total = Acceptance(per_position=[0, 0, 0])
    total.add(a)
    total.add(a)
    assert (total.drafts, total.accepted, total.steps, total.decoded) == (2, 6, 4, 10)
    assert total.per_position == [2, 2, 2] and total.tau == a.tau


def test_the_last_step_counts_drafts_past_max_tokens_as_vllm_does():
    # The request returns 3 tokens; the target would go on with 8 9. The last step's draft [7 8 9] is
    # accepted in full before the request is cut, and vLLM's counters keep all three.
    full = acceptance([5, 6, 7, 8, 9], [5, 6, 7, 8, 9], k=3, min_n=2, max_n=4, max_model_len=64, emitted=3)
    assert (full.drafts, full.accepted, full.steps, full.decoded) == (1, 3, 2, 2)
    cut = acceptance([5, 6, 7, 8, 9], [5, 6, 7], k=3, min_n=2, max_n=4, max_model_len=64)
    assert (cut.drafts, cut.accepted) == (1, 1)  # without the tokens past the cut only one is known
