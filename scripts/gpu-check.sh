#!/usr/bin/env bash
# The device check of the CUDA plugin (docs/cuda.md), for a machine with an NVIDIA GPU, in one call:
# builds the library and the plugin (SMARTGEN_CUDA=ON: no nvcc is an error here), runs the gpu
# tests (the plugin's kernels against the CPU twins), then P8 (each kernel's bandwidth ÷ a
# device-to-device copy's), then the two-process staged transfers between GPU pools (the same
# tests CI runs on the emulated plugin, here on the real one and cudaMalloc'd pools: device to
# device, host to device and back, selective, int8 on the wire; every byte checked), and writes the
# figures as JSON lines.
#
# Usage: scripts/gpu-check.sh [OUT_DIR]     (default: $OUT when set, else build/gpu-check)
# Needs the build dependencies of scripts/setup-deps.sh (it runs it when apt is reachable) and the
# CUDA toolkit (nvcc; /usr/local/cuda is looked at).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out"
jobs=$(nproc)

bash scripts/setup-deps.sh || echo "gpu-check: setup-deps failed (no archive?); going on with what is installed"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt" || true

cmake --preset release -B build/gpu -DSMARTGEN_CUDA=ON -DSMARTGEN_BINDINGS=OFF >"$out/configure.log"
cmake --build build/gpu --parallel "$jobs" --target smartgen smartgen_cuda cuda_kernels_test cuda_kernels_bench \
  cuda_staged_tests >"$out/build.log"
ctest --test-dir build/gpu -L gpu --output-on-failure | tee "$out/ctest-gpu.log"
build/gpu/kernels/cuda/cuda_kernels_bench build/gpu/libsmartgen-cuda.so.0 --reps 50 --json | tee "$out/p8.json"
# The staged path between two processes, on the device (the stream test needs the emulation's
# controllable streams and skips here).
SG_CUDA_PLUGIN=$PWD/build/gpu/libsmartgen-cuda.so.0 SG_CUDA_TEST_DEVICE=1 \
  LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} \
  build/gpu/tests/cuda_staged_tests --gtest_filter='Pools/*:CudaStream.*' | tee "$out/staged.log"
echo "gpu-check: figures in $out (p8.json: gbps, d2d_gbps and ratio per kernel)"
