"""Online training on one node: the states cached once, the tokens generated again every epoch, the
states in flight on disk, and each way the box could serve and train at once (a Split), the fastest
that fits planned."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.planning import calibration
from pipeline.planning.rates import Rate, calibrated_rate
from pipeline.profile import Profile
from pipeline.units import GIB


@dataclass(frozen=True)
class Split:
    """Online training on one node: `serve` GPUs run the extraction server, `train` GPUs the trainer
    (0 = both on the same GPUs, taking turns)."""
    serve: int
    train: int
    generate_tok_s: float
    train_tok_s: float
    wall_s: float
    bottleneck: str  # "generation" / "training" / "shared GPUs"
    fits: bool
    why: str


@dataclass(frozen=True)
class OnlinePlan:
    cached_rows: int
    disk_cache: int
    disk_in_flight: int
    generate_tokens: int  # every epoch generates what is not cached
    generate_s: float | None
    wall_s: float | None
    gpu_hours: float | None
    splits: list[Split]
    recommended: str
    cache_s: float | None = 0.0  # extracting the cached rows' states, before the split's wall (in wall_s)

    @property
    def fits(self) -> bool:
        """False where splits were planned and none fits the box: then online has no wall time or GPU-hours."""
        return not self.splits or any(s.fits for s in self.splits)

    @property
    def disk_states(self) -> int:
        return self.disk_cache + self.disk_in_flight


def online_plan(profile: Profile, tokens: int, samples: int, state_bytes_per_token: float, extract: Rate,
                train_tokens: float, train_s: float | None, train_mem: int, overhead_s: float = 0.0) -> OnlinePlan:
    """Online training: states of the first rows up to extract.cache_gib are extracted once; the rest
    is generated again every epoch (train and validation rows) while the draft trains, each sample's
    states deleted once loaded. On disk in flight: the requests the data loaders keep open
    (train.requests_per_worker per worker, one worker at least, per rank), at the longest sequence, and no
    more than one packed batch a worker (its requests are that batch's rows). `overhead_s`: the trainer's
    start-up and epochs beyond its steps (rates.trainer_overhead), on the wall as offline."""
    ex, t = profile.extract, profile.train
    cache = min(int(ex.cache_gib * GIB), int(tokens * state_bytes_per_token))
    cached_tokens = int(cache / state_bytes_per_token) if state_bytes_per_token else 0
    cached_rows = int(samples * cached_tokens / tokens) if tokens else 0
    ranks = t.nproc_per_node * t.nnodes
    # a worker's requests are its batch's rows: no more than a packed batch (total_seq_len tokens) at once
    per_worker = min(t.requests_per_worker * profile.data.seq_length, max(t.total_seq_len, profile.data.seq_length))
    in_flight = int(ranks * max(1, t.num_workers) * per_worker * state_bytes_per_token)
    generate_tokens = (tokens - cached_tokens) * t.epochs
    generate_s = generate_tokens / extract.tokens_per_s if extract.tokens_per_s else None
    cache_s = cached_tokens / extract.tokens_per_s if extract.tokens_per_s else 0.0
    splits = candidate_splits(profile, generate_tokens, train_tokens, train_mem)
    best = min((s for s in splits if s.fits), key=lambda s: s.wall_s, default=None)
    if best is None and splits:  # planned and infeasible: a wall time would price a run that cannot start
        wall = None
        recommended = "no split fits this box: " + splits[-1].why
    elif best is None:  # nothing to plan splits from: generation and training overlap at best
        wall = max(generate_s, train_s) if generate_s is not None and train_s is not None else None
        recommended = ("no split measured or estimated: set hardware.gpus, extraction/training rates and "
                       "target.weights_gib")
    else:
        wall = best.wall_s
        recommended = (f"serve on {best.serve} GPU(s), train on {best.train} ({best.bottleneck} bound)" if best.train
                       else f"serve and train on the same {best.serve} GPUs: {best.why}")
    wall = wall + cache_s + overhead_s if wall is not None else None
    gpus = profile.hardware.gpus or (profile.server.tensor_parallel_size + ranks)
    return OnlinePlan(cached_rows=cached_rows, disk_cache=cache, disk_in_flight=in_flight,
                      generate_tokens=generate_tokens, generate_s=generate_s, wall_s=wall,
                      gpu_hours=wall * gpus / 3600 if wall is not None else None, splits=splits,
                      recommended=recommended, cache_s=cache_s if extract.tokens_per_s else None)


def candidate_splits(profile: Profile, generate_tokens: float, train_tokens: float, train_mem: int) -> list[Split]:
    """Each way one node of the profile's hardware could serve and train at once: a power-of-two
    server (tensor parallel) on some GPUs and the trainer on the rest, or both on all GPUs taking
    turns (vLLM keeps server.gpu_memory_utilization of each GPU, the trainer needs the rest). Generation:
    the calibration carried to a server of that many GPUs, else the profile's per-GPU rate × the count;
    training: the per-GPU rate × the count (estimates until a run measures them)."""
    hw, weights = profile.hardware, profile.target.weights_gib * GIB
    per_gpu = hw.gpu_memory_gib * GIB
    if not (hw.gpus and (hw.extract_tokens_per_s or hw.calibration) and hw.train_tokens_per_s and weights
            and per_gpu):
        return []
    out = []
    for serve in (1 << i for i in range(hw.gpus.bit_length())):  # 1, 2, 4, … GPUs
        rate = calibrated_rate(profile, serve, calibration.extract_rate)
        gen = rate.tokens_per_s if rate and rate.tokens_per_s else hw.extract_tokens_per_s * serve
        trainers = hw.gpus - serve
        trn = hw.train_tokens_per_s * (trainers or serve)
        util = profile.server.gpu_memory_utilization
        if not trainers:  # serve and train on every GPU: vLLM's share lowered to leave the trainer its memory
            util = min(util, 1 - (train_mem + GIB) / per_gpu)
        # weights plus a sixth for the KV cache and activations must fit the server's share
        holds = serve * per_gpu * util >= weights * 1.15
        held = f"{serve * per_gpu * util / GIB:.0f} GiB for {weights / GIB:.0f} GiB of weights" + (
            "" if holds else ": too small")
        if trainers:
            out.append(Split(serve, trainers, gen, trn, max(generate_tokens / gen, train_tokens / trn),
                             "generation" if generate_tokens / gen > train_tokens / trn else "training", holds,
                             f"{serve} GPU(s) hold {held}"))
        else:
            out.append(Split(serve, 0, gen, trn, generate_tokens / gen + train_tokens / trn, "shared GPUs", holds,
                             f"server.gpu_memory_utilization {util:.2f} leaves the trainer {train_mem / GIB:.0f} GiB "
                             f"+ 1 GiB per GPU; vLLM then holds {held}"))
    return out
