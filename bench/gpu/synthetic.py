"""Synthetic 8B-class workloads for the GPU benches: a random Llama target config, a verifier stub
(the three tensors speculators' trainer reads: embeddings, final norm, lm_head; docs/reference.md §7), and a
prepared dataset with hidden-state files in the pipeline's own formats, written by its own functions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def llama_config(**sizes):
    from transformers import LlamaConfig
    return LlamaConfig(**{**LLAMA_8B, **sizes}, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_verifier_stub(out: Path, config, dtype="bfloat16", seed: int = 0) -> Path:
    """config.json plus model.safetensors with only what the trainer loads from a verifier."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    v, h = config.vocab_size, config.hidden_size
    tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(dt),
               "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(dt),
               "model.norm.weight": torch.ones(h, dtype=dt)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return out


def write_prepared(run, config, samples: int, seq_len: int, n_states: int, dtype="bfloat16", seed: int = 0) -> int:
    """A prepared dataset, token_freq.pt and hs_{i}.safetensors files for `run`; returns tokens."""
    import torch
    from datasets import Dataset

    from pipeline.stages.extract import hs_path, write_hs_file
    from pipeline.stages.prepare import _write_token_freq, dataset_features

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, config.vocab_size, (seq_len,), generator=g) for _ in range(samples)]
    cols = {"input_ids": [r.tolist() for r in rows], "loss_mask": [[0] * 16 + [1] * (seq_len - 16)] * samples,
            "seq_len": [seq_len] * samples}
    ds = Dataset.from_dict(cols, features=dataset_features())
    ds.set_format(type="torch")
    ds.save_to_disk(str(run.prepared_dir))
    _write_token_freq(ds, run.prepared_dir / "token_freq.pt")
    run.hidden_states_dir.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for i, ids in enumerate(rows):
        states = torch.randn(seq_len, n_states, config.hidden_size, device=dev, dtype=getattr(torch, dtype))
        write_hs_file(hs_path(run.hidden_states_dir, i), ids, states.cpu())
    return samples * seq_len
