#!/usr/bin/env bash
# Copied from the project's shared GPU notes (measured 2026-11-30) so that the repository stands alone.
# Build vLLM 0.26.0 (+ its missing dependencies) for the H200 device machine as xz parts of <= 60 MiB,
# into ignored folders .vl1/ .vl2/ .vl3/ of the current checkout, plus .vls/ with the device-side scripts.
# Run in the project's root. Needs pip access to the package registry; ~10 min on 2 cores (xz).
# Why 0.26.0: it is the newest vLLM that pins torch==2.11.0, the torch the device image holds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
grep -qx '/.vl\*/' .git/info/exclude 2>/dev/null || echo '/.vl*/' >> .git/info/exclude
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
work=${VL_WORK:-/tmp/vlbuild}; rm -rf "$work"; mkdir -p "$work/all" "$work/site"
python3 -m pip download -q --no-deps $P -d "$work/all" -r "$here/wheels.txt"
python3 -m pip install -q --no-index --no-deps --no-compile $P --target "$work/site" "$work"/all/*.whl
# Not needed on Hopper (FlashAttention 3 is used; FA2 is imported under try/except), and large:
rm -f "$work"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$work"/site/vllm/vllm-rs \
      "$work"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so
tar -cf - -C "$work/site" . | xz -T0 -6 > "$work/site.tar.xz"
rm -rf .vl1 .vl2 .vl3 .vls && mkdir -p .vls
(cd "$work" && split -b 60m -d -a 2 site.tar.xz site.tar.xz.part)
i=1; for p in "$work"/site.tar.xz.part*; do mkdir -p ".vl$i"; mv "$p" ".vl$i/"; i=$((i+1)); done
(cd "$work" && sha256sum site.tar.xz | awk '{print $1"  /tmp/site.tar.xz"}') > .vls/site.sha256
cp "$here"/env.sh "$here"/client.py "$here"/install_on_device.sh .vls/
du -sh .vl* ; echo "parts ready: send them with back-to-back device runs (README.md beside this script)"
