"""Greedy chain speculative decoding with a transformers target and a trained EAGLE-3 head.

The head runs exactly as speculators trains it (models/eagle3/core.py): step 0 over the whole context
(aux hidden states of position j with the embedding of token j+1, positions from 1), then each further
step appends one query at the last position that sees the step-0 keys and its own earlier steps —
the train-time test (TTT) mask restricted to the position that matters. The target verifies all k
drafts in one forward; the longest agreeing prefix plus the target's own next token is kept, so the
output must equal the target's greedy output (checked, not assumed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.target import HiddenStateReader


def load_draft(checkpoint: Path, dtype: torch.dtype = torch.float32):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 - dense masks below
    model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=config, dtype=dtype)
    return model.eval()


class DraftProposer:
    def __init__(self, draft):
        self.draft = draft
        tl = draft.config.transformer_layer_config
        self.window = getattr(tl, "sliding_window", None)
        self.sliding = set(draft.sliding_window_indices)
        self.aux_ids = list(draft.target_layer_ids)

    def _step0_mask(self, n: int, sliding: bool) -> torch.Tensor:
        q = torch.arange(n).unsqueeze(1)
        k = torch.arange(n).unsqueeze(0)
        mask = k <= q
        if sliding and self.window:
            mask &= (q - k) < self.window
        return mask.view(1, 1, n, n)

    def _extra_mask(self, n: int, step: int, sliding: bool) -> torch.Tensor:
        keys = torch.ones(n + step, dtype=torch.bool)
        if sliding and self.window:
            keys[: n] = (n - 1 - torch.arange(n)) < self.window
        return keys.view(1, 1, 1, n + step)

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, next_ids: list[int], k: int) -> list[int]:
        """aux: [1, n, n_aux*H] target states of positions 0..n-1; next_ids: tokens 1..n. Returns k
        draft tokens (target vocabulary) continuing the sequence."""
        from transformers import DynamicCache

        d = self.draft
        n = aux.shape[1]
        h = aux.to(d.fc.weight.dtype)
        if d.input_norm is not None:
            h = d.input_norm(h)
        if d.fc_norm is not None:
            chunks = h.chunk(len(d.fc_norm), dim=-1)
            h = torch.cat([norm(c) for norm, c in zip(d.fc_norm, chunks)], dim=-1)
        h = d.fc(h)
        cache = DynamicCache()
        ids = torch.tensor([next_ids], dtype=torch.long)
        positions = 1 + torch.arange(n).unsqueeze(0)
        out: list[int] = []
        for step in range(k):
            x = torch.cat([d.embed_tokens(ids), h], dim=-1)
            pe = d.rotary_emb(x, positions)
            cache_position = torch.arange(n) if step == 0 else torch.tensor([n + step - 1])
            for i, layer in enumerate(d.layers):
                sliding = i in self.sliding
                mask = self._step0_mask(n, sliding) if step == 0 else self._extra_mask(n, step, sliding)
                x = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          cache_position=cache_position, position_embeddings=pe)
            if d.config.norm_output:
                x = d.norm(x)
                logits = d.lm_head(x)
            else:
                logits = d.lm_head(d.norm(x))
            draft_id = int(logits[0, -1].argmax())
            token = draft_id + int(d.d2t[draft_id]) if d.d2t is not None else draft_id
            out.append(token)
            h = x[:, -1:]
            ids = torch.tensor([[token]], dtype=torch.long)
            positions = positions[:, -1:] + 1
        return out


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    generated: int = 0

    def __post_init__(self):
        self.per_position = self.per_position or [0] * self.k

    @property
    def tau(self) -> float:
        """Mean acceptance length as vLLM reports it: 1 + accepted drafts per verify step."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def acceptance(self) -> list[float]:
        return [c / self.rounds if self.rounds else 0.0 for c in self.per_position]

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.target_forwards += other.target_forwards
        self.generated += other.generated
        self.per_position = [a + b for a, b in zip(self.per_position, other.per_position)]


def _truncate(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:limit]


@torch.no_grad()
def speculative_generate(reader: HiddenStateReader, proposer: DraftProposer, prompt: list[int], k: int,
                         max_new_tokens: int, eos: set[int]) -> tuple[list[int], SpecStats]:
    stats = SpecStats(k=k)
    seq = list(prompt)
    logits, states = reader(torch.tensor([seq]))
    stats.target_forwards += 1
    out = [int(logits[0, -1].argmax())]
    seq.append(out[0])
    aux = states.flatten(2)  # the reader reads the head's aux layers only
    while len(out) < max_new_tokens and not eos.intersection(out):
        drafts = proposer.propose(aux[:, : len(seq) - 1], seq[1:], k)
        logits, states = reader(torch.tensor([seq + drafts]))
        stats.target_forwards += 1
        preds = logits[0, len(seq) - 1: len(seq) + k].argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == preds[accepted]:
            accepted += 1
        stats.rounds += 1
        stats.accepted += accepted
        for i in range(accepted):
            stats.per_position[i] += 1
        new = drafts[:accepted] + [preds[accepted]]
        seq += new
        out += new
        aux = states.flatten(2)
    out = _truncate(out, eos, max_new_tokens)
    stats.generated = len(out)
    return out, stats


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The target's own greedy output, through transformers' generate (an independent code path)."""
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return _truncate(out[0, len(prompt):].tolist(), eos, max_new_tokens)
