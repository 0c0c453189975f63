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

from pipeline.compat import draft_attention
from pipeline.data import conversations, target
from pipeline.data.target import HiddenStateReader


def load_draft(checkpoint: Path, dtype: torch.dtype = torch.float32):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))
    draft_attention.use_sdpa(config)  # the proposer passes dense masks (pipeline/compat/draft_attention.py)
    return Eagle3DraftModel.from_pretrained(str(checkpoint), config=config, dtype=dtype).eval()


class DraftProposer:
    def __init__(self, draft):
        self.draft = draft
        self.window = getattr(draft.config.transformer_layer_config, "sliding_window", None)
        self.sliding = set(draft.sliding_window_indices)
        self.aux_ids = list(draft.target_layer_ids)
        self.device = draft.fc.weight.device

    def _step0_mask(self, n: int, sliding: bool) -> torch.Tensor:
        q = torch.arange(n, device=self.device).unsqueeze(1)
        k = torch.arange(n, device=self.device).unsqueeze(0)
        mask = k <= q
        if sliding and self.window:
            mask &= (q - k) < self.window
        return mask.view(1, 1, n, n)

    def _extra_mask(self, lengths: torch.Tensor, width: int, step: int, sliding: bool) -> torch.Tensor:
        """Keys a step-`step` query of each row sees: that row's own context (not the padding after
        it, not outside its sliding window) and its own earlier steps."""
        j = torch.arange(width, device=self.device).unsqueeze(0)
        n = lengths.unsqueeze(1)
        context = j < n
        if sliding and self.window:
            context &= (n - 1 - j) < self.window
        own = torch.ones(len(lengths), step, dtype=torch.bool, device=self.device)
        return torch.cat([context, own], dim=1).view(len(lengths), 1, 1, width + step)

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, next_ids, k: int, lengths: list[int] | None = None) -> list:
        """aux: [B, n, n_aux*H] target states of positions 0..n-1 (rows right-padded to n, real length
        `lengths[b]`); next_ids: [B, n] tokens 1..n. Returns k draft tokens (target vocabulary) per row
        continuing each sequence; a single unpadded row may be given as plain lists."""
        from transformers import DynamicCache

        single = not isinstance(next_ids, torch.Tensor)
        if single:
            next_ids = torch.tensor([next_ids], dtype=torch.long)
        d, dev = self.draft, self.device
        next_ids = next_ids.to(dev)
        batch, n = next_ids.shape
        lens = torch.tensor(lengths if lengths is not None else [n] * batch, device=dev)
        rows = torch.arange(batch, device=dev)
        h = aux.to(device=dev, dtype=d.fc.weight.dtype)
        if d.input_norm is not None:
            h = d.input_norm(h)
        if d.fc_norm is not None:
            chunks = h.chunk(len(d.fc_norm), dim=-1)
            h = torch.cat([norm(c) for norm, c in zip(d.fc_norm, chunks, strict=True)], dim=-1)
        h = d.fc(h)
        cache = DynamicCache()
        ids = next_ids
        positions = 1 + torch.arange(n, device=dev).unsqueeze(0).expand(batch, n)
        out = torch.empty(batch, k, dtype=torch.long, device=dev)
        for step in range(k):
            x = torch.cat([d.embed_tokens(ids), h], dim=-1)
            pe = d.rotary_emb(x, positions)
            cache_position = torch.arange(n, device=dev) if step == 0 else torch.tensor([n + step - 1], device=dev)
            for i, layer in enumerate(d.layers):
                sliding = i in self.sliding
                mask = self._step0_mask(n, sliding) if step == 0 else self._extra_mask(lens, n, step, sliding)
                x = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          cache_position=cache_position, position_embeddings=pe)
            last = x[rows, lens - 1] if step == 0 else x[:, -1]  # [B, H]: each row's newest position
            normed = d.norm(last)
            if d.config.norm_output:  # the next step reads the normed state, as speculators' forward
                last = normed
            draft_ids = d.lm_head(normed).argmax(-1)
            tokens = draft_ids + d.d2t[draft_ids] if d.d2t is not None else draft_ids
            out[:, step] = tokens
            h = last.unsqueeze(1)
            ids = tokens.unsqueeze(1)
            positions = (lens + 1 + step).unsqueeze(1)
        return out[0].tolist() if single else out.tolist()


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

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.target_forwards += other.target_forwards
        self.generated += other.generated
        self.per_position = [a + b for a, b in zip(self.per_position, other.per_position, strict=True)]


def _truncate(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    return tokens[: next((i + 1 for i, t in enumerate(tokens[:limit]) if t in eos), limit)]


def _right_padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


@torch.no_grad()
def speculative_generate_batch(reader: HiddenStateReader, proposer: DraftProposer, prompts: list[list[int]], k: int,
                               max_new_tokens: int, eos: set[int]) -> list[tuple[list[int], SpecStats]]:
    """Chain speculation for several prompts at once: every target forward (prefill, verify) and
    every draft step runs over the rows still generating, right-padded. The target is causal, so
    padding after a row's last real token changes nothing at its real positions."""
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    stats = [SpecStats(k=k) for _ in prompts]
    aux: list[torch.Tensor] = [torch.empty(0)] * len(prompts)

    def verify(rows: list[int], tails: list[list[int]]) -> torch.Tensor:
        """Target forward over seq+tail of each row; returns logits and stores each row's aux states."""
        full = [seqs[r] + t for r, t in zip(rows, tails, strict=True)]
        logits, states = reader(_right_padded(full, pad=0))
        states = states.flatten(2)  # the reader reads the head's aux layers only
        for b, r in enumerate(rows):
            aux[r] = states[b, : len(full[b])]
            stats[r].target_forwards += 1
        return logits

    active = list(range(len(prompts)))
    logits = verify(active, [[] for _ in active])
    for b, r in enumerate(active):
        first = int(logits[b, len(seqs[r]) - 1].argmax())
        outs[r].append(first)
        seqs[r].append(first)
    while active := [r for r in active if len(outs[r]) < max_new_tokens and not eos.intersection(outs[r])]:
        lengths = [len(seqs[r]) - 1 for r in active]
        ctx = torch.nn.utils.rnn.pad_sequence([aux[r][:n] for r, n in zip(active, lengths, strict=True)],
                                              batch_first=True)  # right-padded with zeros
        drafts = proposer.propose(ctx, _right_padded([seqs[r][1:] for r in active], pad=0), k, lengths)
        logits = verify(active, drafts)
        for b, r in enumerate(active):
            n = len(seqs[r])
            preds = logits[b, n - 1: n + k].argmax(-1).tolist()
            accepted = next((i for i in range(k) if drafts[b][i] != preds[i]), k)
            st = stats[r]
            st.rounds += 1
            st.accepted += accepted
            for i in range(accepted):
                st.per_position[i] += 1
            new = drafts[b][:accepted] + [preds[accepted]]
            seqs[r] += new
            outs[r] += new
    outs = [_truncate(out, eos, max_new_tokens) for out in outs]
    for out, st in zip(outs, stats, strict=True):
        st.generated = len(out)
    return list(zip(outs, stats, strict=True))


@torch.no_grad()
def greedy_reference_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                           pad: int = 0) -> list[list[int]]:
    """The target's own greedy outputs, through transformers' generate (an independent code path),
    left-padded (with `pad`) as generate expects; positions come from the attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad)
    return [_truncate(row[width:].tolist(), eos, max_new_tokens) for row in out]


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()


class OfflineTarget:
    """The target in transformers with its tokenizer, loaded once, and any trained head beside it."""

    def __init__(self, profile, target_dir: Path):
        self.ev = profile.evaluate
        self.tok = target.load_tokenizer(target_dir)
        self.model = target.load_model(target_dir, profile.target.dtype)
        self.eos = eos_ids(self.model)
        self._reader: HiddenStateReader | None = None

    def prompt_ids(self, rows: list[dict]) -> list[list[int]]:
        return conversations.prompt_ids(self.tok, rows)

    def head(self, checkpoint: Path):
        draft = load_draft(checkpoint).to(self.model.get_input_embeddings().weight.device)
        proposer = DraftProposer(draft)
        if self._reader is None:
            self._reader = HiddenStateReader(self.model, proposer.aux_ids)
        self._reader.layer_ids = list(proposer.aux_ids)  # the reader's hook stays one per target
        return proposer

    def speculate(self, proposer, ids: list[list[int]]) -> list:
        if self._reader is None:
            raise RuntimeError("OfflineTarget.speculate before head(): no reader for the head's layers")
        return speculative_generate_batch(self._reader, proposer, ids, self.ev.k, self.ev.max_new_tokens, self.eos)

    def reference(self, ids: list[list[int]], extra: int = 0) -> list[list[int]]:
        return greedy_reference_batch(self.model, ids, self.ev.max_new_tokens + extra, self.eos)
