"""Whether the offline evaluator measures the head on this box (evaluate.offline: off, on, or auto: where the
target loads in one transformers process), and that fit itself, which regenerate's transformers backend needs
too. The stages evaluate-offline and pick-checkpoint ask here, as do the planner, preflight and the report."""
from __future__ import annotations

from pipeline.data.targetinfo import TargetInfo, TargetInfoError, target_info
from pipeline.profile import Profile
from pipeline.units import GIB, count, human


def transformers_fit(profile: Profile, info: TargetInfo) -> tuple[bool, str]:
    """Whether the target loads in one transformers process on the box (regenerate's and evaluate-offline's
    transformers path): its dense weights (INT4 experts are decompressed) plus a fifth for activations,
    against 90 % of all GPUs' memory (device_map "auto"), or 80 % of the host's memory without GPUs."""
    import psutil

    hw = profile.hardware
    dense = info.dense_bytes(profile.target.dtype)
    if hw.gpus:
        have, where = hw.gpus * hw.gpu_memory_gib * GIB * 0.9, f"{hw.gpus} × {hw.gpu_memory_gib:g} GiB of GPU memory"
    else:
        mem = hw.host_memory_gib * GIB or psutil.virtual_memory().total
        have, where = mem * 0.8, f"{mem / GIB:.0f} GiB of host memory"
    fits = dense * 1.2 <= have
    return fits, (f"{count(info.params)} parameters = {human(dense)} dense in {profile.target.dtype} "
                  f"{'fit' if fits else 'do not fit'} {where}")


def offline_evaluation(profile: Profile, info: TargetInfo) -> tuple[bool, str]:
    """Whether evaluate-offline runs (evaluate.offline; auto: where the target fits one process)."""
    mode = profile.evaluate.offline
    if mode == "off":
        return False, "evaluate.offline = off: τ and the lossless check from vLLM (deploy-measure)"
    fits, why = transformers_fit(profile, info)
    if mode == "on":
        return True, f"evaluate.offline = on ({why})"
    return fits, (f"auto: {why}" + ("" if fits else "; τ and the lossless check from vLLM"))


def evaluates_offline(profile: Profile) -> bool:
    """Whether this node runs evaluate-offline (and pick-checkpoint measures offline): evaluate.offline off
    never, on always, auto where the target fits one process; a target too large is measured through vLLM
    only, in deploy-measure. The head is node 0's."""
    if not profile.train.first_node:
        return False
    try:
        return offline_evaluation(profile, target_info(profile))[0]
    except TargetInfoError:
        return profile.evaluate.offline != "off"  # preflight reports the missing config
