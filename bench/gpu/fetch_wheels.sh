#!/usr/bin/env bash
# Download, on a machine with package-registry access, the wheels the project needs on a GPU box whose
# image already holds torch, transformers, numpy, safetensors, pyarrow, pandas, rich, nvidia-ml-py, …
# (the H200 image measured in NOTES.md "On H200s": torch 2.11.0+cu130, Python 3.12) but not speculators and its own needs.
# The GPU box installs them with bench/gpu/setup.sh, without any network.
set -euo pipefail
dest=${1:-.whl}
py=${PYTHON_VERSION:-3.12}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
pkgs=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill multiprocess
      pydantic pydantic-core annotated-types typing-inspection pydantic-settings python-dotenv
      openai jiter sniffio distro httpx2 loguru==0.7.3
      typing-extensions textual==8.2.8 linkify-it-py uc-micro-py mdit-py-plugins platformdirs tomli-w==1.2.0
      # vLLM's hidden-states writer stalls the engine with an older one (compat/versions.py SAFETENSORS_UNLOCKED)
      safetensors==0.8.0)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${plat[@]}" -d "$dest" "$p"
done
ls "$dest"
