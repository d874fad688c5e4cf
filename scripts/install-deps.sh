#!/usr/bin/env bash
# Installs, from Debian 12's apt, whatever loom's build, tests, benchmarks and examples need
# and the machine lacks. Idempotent; needs root (or sudo). The CUDA toolkit is optional and
# not installed here: when nvcc is present (/usr/local/cuda), the CUDA backend is built too.
set -euo pipefail
packages=(
  cmake ninja-build g++ git pkg-config
  doctest-dev libbenchmark-dev
  libopenblas-dev
  libopenmpi-dev openmpi-bin libboost-mpi-dev
  nlohmann-json3-dev libcpp-httplib-dev
  python3-torch python3-numpy
  libsentencepiece-dev sentencepiece python3-sentencepiece  # tokenizer.model; spm_train and the Python oracle for the tests
  clang libclang-rt-14-dev  # libFuzzer and the sanitizer runtimes (scripts/fuzz.sh)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "loom: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
