"""regenerate (optional): replace the assistant turns with the target's own greedy output, so the
draft learns the distribution it will be asked to predict (speculators' regenerate-responses, here
with transformers). Output: pre-tokenized rows (input_ids + loss_mask), one per assistant turn."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline import atomicio, conversations, target
from pipeline.stages.base import Stage, StageContext, StageError


class Regenerate(Stage):
    name = "regenerate"

    def applies(self, profile) -> bool:
        return profile.data.regenerate

    def inputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.source_conversations()]

    def outputs(self, ctx: StageContext) -> list[Path]:
        return [ctx.training_conversations()]

    def run(self, ctx: StageContext) -> dict:
        data = ctx.profile.data
        loaded = conversations.load(ctx.source_conversations())
        for lineno, reason in loaded.bad:
            ctx.log.warning("%s:%d: skipped: %s", ctx.source_conversations(), lineno, reason)
        try:
            train, _ = conversations.split_heldout(loaded.conversations, data.heldout)
        except ValueError as exc:
            raise StageError(f"{ctx.source_conversations()}: {exc}") from None
        tok = target.load_tokenizer(ctx.target_dir())
        model = target.load_model(ctx.target_dir(), ctx.profile.target.dtype)
        tok.padding_side = "left"
        histories = [[m for m in c["messages"]] for c in train]
        rows: list[dict] = []
        max_turns = max(sum(m["role"] == "assistant" for m in h) for h in histories)
        total = sum(sum(m["role"] == "assistant" for m in h) for h in histories)
        generated_tokens = 0
        for turn in range(max_turns):
            # Conversations that still have an assistant turn number `turn` to regenerate.
            work = []
            for h_idx, history in enumerate(histories):
                a_positions = [i for i, m in enumerate(history) if m["role"] == "assistant"]
                if turn < len(a_positions):
                    work.append((h_idx, a_positions[turn]))
            for start in range(0, len(work), data.regenerate_batch_size):
                batch = work[start:start + data.regenerate_batch_size]
                prompts = [conversations.render_ids(tok, histories[h][:pos], True) for h, pos in batch]
                completions = _greedy(model, tok, prompts, data.regenerate_max_tokens)
                for (h, pos), prompt, completion in zip(batch, prompts, completions, strict=True):
                    rows.append({"input_ids": prompt + completion,
                                 "loss_mask": [0] * len(prompt) + [1] * len(completion)})
                    text = tok.decode([t for t in completion if t not in tok.all_special_ids])
                    histories[h][pos] = {"role": "assistant", "content": text}
                    generated_tokens += len(completion)
                ctx.progress(self.name, len(rows), total, "turns")
        atomicio.atomic_write_text(ctx.training_conversations(), "".join(json.dumps(r) + "\n" for r in rows))
        return {"rows": len(rows), "generated_tokens": generated_tokens, "skipped_rows": len(loaded.bad),
                **answer_variety(rows)}


def answer_variety(rows: list[dict]) -> dict:
    """How much the target's answers say: distinct tokens over all of them, and the share of answer tokens
    that complete a trigram already in their context (what prompt lookup can copy; a looping model
    scores near 1)."""
    distinct: set[int] = set()
    repeated = total = 0
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        seen: set[tuple[int, ...]] = set()
        for i, token in enumerate(ids):
            if i >= 2 and mask[i]:
                total += 1
                repeated += (ids[i - 2], ids[i - 1], token) in seen
                distinct.add(token)
            if i >= 2:
                seen.add((ids[i - 2], ids[i - 1], token))
    return {"answer_distinct_tokens": len(distinct),
            "answer_repeated_trigram_share": round(repeated / total, 3) if total else 0.0}


def _greedy(model, tok, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch

    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    completions = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        completions.append(row[:cut])
    return completions
