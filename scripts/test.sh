#!/usr/bin/env bash
# README command (2): install what is missing, configure, build everything and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/configure.sh
cmake --build build
export OPENBLAS_NUM_THREADS=1
ctest --test-dir build --output-on-failure -j "$(nproc)"
