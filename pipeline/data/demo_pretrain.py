"""Teaching the demo target its corpus: a short causal-LM training run over the demo conversations, so
the target answers with text it has learned instead of a random model's loops (NOTES.md "The demo").

The corpus is the demo's own conversation generator (every conversation the demo uses, held-out ones
included: the target knows the answers, as a real target knows its pretraining data; the held-out split
only keeps them from the draft), and for a GPU-sized target the stdlib's own source files as plain text.
Seeded and step-counted, so the same spec builds the same weights on the same machine. On a GPU it trains
in bfloat16 (corpus_dtype), the loss recorded along the way for the notes.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

from pipeline.data import conversations, demo_data
from pipeline.profile import DemoTargetSection


def corpus(spec: DemoTargetSection, tokenizer) -> list[list[int]]:
    """Every demo conversation rendered through the chat template, one token row each; then each of the
    first corpus_source_files stdlib sources as plain text, one row each."""
    convs = demo_data.conversations(spec.corpus_conversations, spec.corpus_seed, spec.corpus_answers)
    rows = [conversations.render_ids(tokenizer, c["messages"], False) for c in convs]
    if spec.corpus_source_files:
        files = demo_data.stdlib_tree(spec.corpus_source_files)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        eos = tokenizer.eos_token_id
        rows += [ids + [eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return rows


def packed_batches(rows: list[list[int]], batch: int, seq: int, seed: int) -> Iterator[list[list[int]]]:
    """Endless batches of `batch` windows of `seq` tokens over the rows concatenated in a fresh
    shuffled order each pass."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        stream = [t for i in order for t in rows[i]]
        span = batch * seq
        for start in range(0, len(stream) - span + 1, span):
            yield [stream[start + j * seq: start + (j + 1) * seq] for j in range(batch)]


def learning_rate(spec: DemoTargetSection, step: int) -> float:
    """Linear warm-up over the first 10 % of the steps, then linear decay to 10 % of the peak."""
    warm = max(1, spec.corpus_steps // 10)
    if step < warm:
        return spec.corpus_lr * (step + 1) / warm
    return spec.corpus_lr * (1.0 - 0.9 * (step - warm) / max(1, spec.corpus_steps - warm))


def pretrain(model, tokenizer, spec: DemoTargetSection,
             on_step: Callable[[int, int, float], None] = lambda step, total, loss: None) -> dict:
    """Train `model` in place for `spec.corpus_steps` steps; returns the corpus size and the loss curve's
    ends."""
    import torch

    rows = corpus(spec, tokenizer)
    tokens = sum(len(r) for r in rows)
    if tokens < spec.corpus_batch * spec.corpus_seq:
        raise ValueError(f"demo_target: the corpus has {tokens} tokens, fewer than one batch "
                         f"({spec.corpus_batch} x {spec.corpus_seq})")
    torch.manual_seed(spec.seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.corpus_device == "auto" else spec.corpus_device
    model.to(device=device, dtype=getattr(torch, spec.corpus_dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.corpus_lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = packed_batches(rows, spec.corpus_batch, spec.corpus_seq, spec.seed)
    model.train()
    first = last = float("nan")
    curve: list[list[float]] = []
    every = max(1, spec.corpus_steps // 20)
    t0 = time.perf_counter()
    for step in range(spec.corpus_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        ids = torch.tensor(next(batches), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()
        first = last if step == 0 else first
        if step % every == 0 or step == spec.corpus_steps - 1:
            curve.append([step + 1, round(last, 3)])
        on_step(step + 1, spec.corpus_steps, last)
    seconds = time.perf_counter() - t0
    model.eval().to("cpu")
    trained = spec.corpus_steps * spec.corpus_batch * spec.corpus_seq
    return {"corpus_rows": len(rows), "corpus_tokens": tokens, "corpus_steps": spec.corpus_steps,
            "corpus_lr": spec.corpus_lr, "corpus_epochs": round(trained / tokens, 1),
            "corpus_loss_first": round(first, 3), "corpus_loss_last": round(last, 3),
            "corpus_seconds": round(seconds, 1), "corpus_tokens_per_s": round(trained / seconds, 1),
            "corpus_device": device, "corpus_dtype": spec.corpus_dtype, "corpus_loss_curve": curve}
