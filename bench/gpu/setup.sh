# Source this on a GPU box with no network (the device machine's image holds torch, transformers,
# numpy, safetensors, pyarrow, nvidia-ml-py, …): installs the wheels bench/gpu/fetch_wheels.sh downloaded
# into .whl/ under /tmp/site and makes this repository importable. Caches stay under /tmp/eagle3.
#   . bench/gpu/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1 2>/dev/null || exit 1
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  HF_HOME=/tmp/eagle3/hf TORCHINDUCTOR_CACHE_DIR=/tmp/eagle3/inductor TRITON_CACHE_DIR=/tmp/eagle3/triton \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "GPU(s)",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("speculators", "transformers", "triton", "datasets", "nvidia-ml-py", "textual"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")
PY
