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
#
# A GPU machine without the build's dependencies (doctest, a CBLAS), or with little time to
# spend compiling, takes the two-step form instead:
#   scripts/gpu-check.sh --pack DIR             here: builds for sm_90 (CUDA_ARCH overrides),
#                                                puts the GPU tests that need no mpirun, the
#                                                benchmark and the shared libraries they need
#                                                that a CUDA machine lacks (a CBLAS, libgfortran;
#                                                libstdc++ and libcudart as a fallback) in DIR
#   scripts/gpu-check.sh --prebuilt DIR OUTDIR  there: runs them (tests, benchmark, then the
#                                                kernel test under compute-sanitizer) and writes
#                                                summary.txt, nvidia-smi.txt, tests.log, bench.txt
#                                                and compute-sanitizer.log under OUTDIR; each tool
#                                                of SANITIZER_TOOLS (default memcheck) runs for at
#                                                most SANITIZER_TIMEOUT s, each test TEST_TIMEOUT s
# cuBLAS comes from the GPU machine's CUDA toolkit (or its Python wheels): it is too large to
# carry. MPI tests (the NCCL communicator) need mpirun and are left out of the pack.
set -uo pipefail
usage() {
  echo "usage: scripts/gpu-check.sh OUTDIR | --pack DIR | --prebuilt DIR OUTDIR" >&2
  exit 2
}
absdir() { mkdir -p "$1" && (cd "$1" && pwd) || usage; }  # before the cd below
case "${1:-}" in
  --pack) [[ $# -eq 2 ]] || usage; mode=pack; pack_dir="$(absdir "$2")"; out="$pack_dir" ;;
  --prebuilt) [[ $# -eq 3 && -f "$2/tests.txt" ]] || { echo "gpu-check: --prebuilt needs a DIR made by --pack" >&2; usage; }
    mode=prebuilt; pack_dir="$(cd "$2" && pwd)"; out="$(absdir "$3")" ;;
  -*|"") usage ;;
  *) [[ $# -eq 1 ]] || usage; mode=build; out="$(absdir "$1")" ;;
esac
cd "$(dirname "$0")/.."
jobs="$(nproc)"
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, compute-sanitizer
: > "$out/summary.txt"
note() { echo "gpu-check: $*" | tee -a "$out/summary.txt"; }
phase() {  # phase NAME LOG COMMAND...: runs it, appends to its log, notes its seconds; returns its status
  local name=$1 log=$2 start=$SECONDS rc
  shift 2
  "$@" >> "$out/$log" 2>&1
  rc=$?
  note "$name: $((SECONDS - start)) s (exit $rc, $log)"
  return $rc
}
rm -f "$out"/{configure,build,ctest,tests,compute-sanitizer,ldd}.log "$out/bench.txt"

if [[ $mode == pack ]]; then
  build=build-gpu
  phase configure configure.log cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCHMARKS=ON \
    -DLOOM_HEADER_TESTS=OFF -DLOOM_BUILD_TESTS=ON || { note "FAILED: configure"; exit 1; }
  phase build build.log cmake --build "$build" --target loom_gpu_tests loom-bench-gpu -j "$jobs" || { note "FAILED: build"; exit 1; }
  rm -rf "$pack_dir"/{bin,lib,fallback,libs.tar.xz,tests.txt}
  mkdir -p "$pack_dir"/{bin,lib,fallback}
  # ctest -N -V prints each test's command line: the executable and its arguments
  while read -r exe args; do
    case "$exe" in
      *mpiexec|*mpirun) note "left out (needs mpirun): ${args##* }" ;;
      *) cp "$exe" "$pack_dir/bin/" && echo "$(basename "$exe") $args" >> "$pack_dir/tests.txt" ;;
    esac
  done < <(ctest --test-dir "$build" -N -V -L gpu | sed -n 's/^[0-9]*: Test command: //p')
  cp "$build/benchmarks/gpu/loom-bench-gpu" "$pack_dir/bin/" || { note "FAILED: no loom-bench-gpu (no CBLAS?)"; exit 1; }
  for exe in "$pack_dir"/bin/*; do ldd "$exe"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    while read -r lib; do
      case "$(basename "$lib")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda.so*|libcublas*) ;;  # system, driver, toolkit
        libstdc++*|libgcc_s*|libcudart*) cp -L "$lib" "$pack_dir/fallback/" ;;
        *) cp -L "$lib" "$pack_dir/lib/" ;;
      esac
    done
  tar -C "$pack_dir" -cJf "$pack_dir/libs.tar.xz" lib fallback && rm -rf "$pack_dir"/{lib,fallback}
  note "packed $(wc -l < "$pack_dir/tests.txt") tests and loom-bench-gpu for sm_${CUDA_ARCH:-90} in $pack_dir ($(du -sh "$pack_dir" | cut -f1))"
  exit 0
fi

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

# device_checks BENCH KERNEL_TEST: on a device, the benchmark (a measurement, not a verdict: its
# exit status only says whether it ran), then the kernel test under each compute-sanitizer tool
# of SANITIZER_TOOLS; returns 1 when a tool found an error
device_checks() {
  [[ $device == 1 ]] || return 0
  local rc=0 tool
  phase bench bench.txt timeout 240 "$1" || note "the benchmark did not finish (see bench.txt)"
  sed 's/^/  /' "$out/bench.txt" >> "$out/summary.txt"
  if ! command -v compute-sanitizer > /dev/null; then
    note "compute-sanitizer not found: $2 not checked"
    return 0
  fi
  for tool in ${SANITIZER_TOOLS:-memcheck}; do  # memcheck, racecheck, initcheck, synccheck
    phase "compute-sanitizer --tool $tool" compute-sanitizer.log timeout "${SANITIZER_TIMEOUT:-180}" compute-sanitizer \
      --tool "$tool" --error-exitcode 1 "$2" || rc=1
  done
  return $rc
}

verdict() {  # verdict STATUS
  if [[ $1 == 0 && $device == 0 ]]; then
    note "BUILT; NOTHING RAN ON A GPU (no device: every GPU test skipped; results in $out)"
  elif [[ $1 == 0 ]]; then
    note "PASSED (results in $out)"
  else
    note "FAILED (results in $out)"
    exit 1
  fi
  exit 0
}

if [[ $mode == prebuilt ]]; then
  [[ -f "$pack_dir/libs.tar.xz" ]] && tar -C "$pack_dir" -xJf "$pack_dir/libs.tar.xz"
  # cuBLAS and the CUDA runtime: the toolkit's, else the first found under /opt or /usr (wheels)
  cuda_libs=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           $(find /opt /usr/local/lib /usr/lib -maxdepth 9 \( -name 'libcublas.so.1*' -o -name 'libcudart.so.1*' \) \
               -printf '%h\n' 2>/dev/null | sort -u); do
    [[ -d $d ]] && cuda_libs+="$d:"
  done
  export LD_LIBRARY_PATH="$pack_dir/lib:$cuda_libs${LD_LIBRARY_PATH:-}"
  if ldd "$pack_dir"/bin/* 2>&1 | grep -q "not found"; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$pack_dir/fallback"
    note "some libraries not found on this machine: using the pack's libstdc++ / libcudart (see ldd.log)"
  fi
  ldd "$pack_dir"/bin/* > "$out/ldd.log" 2>&1
  export OPENBLAS_NUM_THREADS=1
  status=0
  while read -r exe args; do
    # shellcheck disable=SC2086  # the test's own arguments, as ctest gave them
    phase "$exe" tests.log timeout "${TEST_TIMEOUT:-300}" "$pack_dir/bin/$exe" $args --duration=true
    rc=$?
    [[ $rc == 0 || $rc == 77 ]] || status=1
  done < "$pack_dir/tests.txt"
  device_checks "$pack_dir/bin/loom-bench-gpu" "$pack_dir/bin/ops_cuda_kernels_test" || status=1
  verdict $status
fi

build=build-gpu

phase configure configure.log cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCHMARKS=ON -DLOOM_HEADER_TESTS=OFF \
  -DLOOM_BUILD_TESTS=ON || { note "FAILED: configure (see configure.log)"; exit 1; }
phase build build.log cmake --build "$build" --target loom_gpu_tests loom-bench-gpu -j "$jobs" || { note "FAILED: build (see build.log)"; exit 1; }

export OPENBLAS_NUM_THREADS=1
phase ctest ctest.log ctest --test-dir "$build" -L gpu --output-on-failure --output-junit "$out/ctest-junit.xml" -j 1
status=$?
grep -E "tests passed|Skipped|Failed|Passed" "$out/ctest.log" | sed 's/^/  /' | tee -a "$out/summary.txt"

device_checks "$build/benchmarks/gpu/loom-bench-gpu" "$build/tests/ops/cuda/ops_cuda_kernels_test" || status=1
verdict $status
