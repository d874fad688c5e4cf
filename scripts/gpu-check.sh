#!/usr/bin/env bash
# The GPU check in one command: scripts/gpu-check.sh OUTDIR
#
# Configures a build of only what the GPU needs (CUDA on; examples and header tests off) in
# build-gpu/, builds the executables of the tests labelled `gpu` (the loom_gpu_tests target)
# and the short GPU benchmark (loom-bench-gpu) with every core, runs the tests, runs the kernel
# test under compute-sanitizer when it is installed, runs the benchmark, and writes under OUTDIR:
#   summary.txt          one line per phase with its seconds, and the verdict
#   nvidia-smi.txt       the device (or why there is none)
#   bench.txt            loom-bench-gpu's table (GEMM TFLOP/s, paged decode GB/s, ... vs peak)
#   configure.log, build.log, ctest.log, ctest-junit.xml, compute-sanitizer.log
# Without a CUDA device it still builds, says so in its first line and in summary.txt, and
# the GPU tests report themselves skipped (exit code 77). Exit status: 0 when every GPU test
# passed or was skipped, 1 otherwise, 2 for a usage error. Meant to finish well inside
# 8 minutes on a 16-core machine: it compiles a handful of translation units.
set -uo pipefail
if [[ $# -ne 1 || "$1" == -* ]]; then
  echo "usage: scripts/gpu-check.sh OUTDIR   (writes the GPU test results under OUTDIR)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
mkdir -p "$1" || exit 2
out="$(cd "$1" && pwd)"
build=build-gpu
jobs="$(nproc)"
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, compute-sanitizer
: > "$out/summary.txt"
note() { echo "gpu-check: $*" | tee -a "$out/summary.txt"; }
phase() {  # phase NAME LOG COMMAND...: runs it, logs it, notes its seconds; returns its status
  local name=$1 log=$2 start=$SECONDS rc
  shift 2
  "$@" > "$out/$log" 2>&1
  rc=$?
  note "$name: $((SECONDS - start)) s (exit $rc, $log)"
  return $rc
}

if command -v nvidia-smi > /dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1 && nvidia-smi -L | grep -q GPU; then
  device=1
  arch=native
  note "device: $(nvidia-smi -L | head -n 1)"
else
  device=0
  arch=90
  echo "no usable nvidia-smi or no GPU listed" >> "$out/nvidia-smi.txt"
  note "NO CUDA DEVICE: the GPU tests are built and report themselves skipped; nothing ran on a GPU"
fi

phase configure configure.log cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCHMARKS=ON -DLOOM_HEADER_TESTS=OFF \
  -DLOOM_BUILD_TESTS=ON || { note "FAILED: configure (see configure.log)"; exit 1; }
phase build build.log cmake --build "$build" --target loom_gpu_tests loom-bench-gpu -j "$jobs" || { note "FAILED: build (see build.log)"; exit 1; }

export OPENBLAS_NUM_THREADS=1
phase ctest ctest.log ctest --test-dir "$build" -L gpu --output-on-failure --output-junit "$out/ctest-junit.xml" -j 1
status=$?
grep -E "tests passed|Skipped|Failed|Passed" "$out/ctest.log" | sed 's/^/  /' | tee -a "$out/summary.txt"

if [[ $device == 1 ]] && command -v compute-sanitizer > /dev/null; then
  phase compute-sanitizer compute-sanitizer.log timeout 180 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$build/tests/ops/cuda/ops_cuda_kernels_test" || status=1
elif [[ $device == 1 ]]; then
  note "compute-sanitizer not found: memcheck not run"
fi

# A measurement, not a verdict: its exit status only says whether it ran
if [[ $device == 1 ]]; then
  phase bench bench.txt timeout 240 "$build/benchmarks/gpu/loom-bench-gpu" || note "the benchmark did not finish (see bench.txt)"
  sed 's/^/  /' "$out/bench.txt" >> "$out/summary.txt"
fi

if [[ $status == 0 && $device == 0 ]]; then
  note "BUILT; NOTHING RAN ON A GPU (no device: every GPU test skipped; results in $out)"
elif [[ $status == 0 ]]; then
  note "PASSED (results in $out)"
else
  note "FAILED (results in $out)"
  exit 1
fi
