#!/usr/bin/env bash
# README command (1): install what is missing, configure, build and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/configure.sh
cmake --build build --target loom-demo
export OPENBLAS_NUM_THREADS=1  # 8 thread ranks share the cores
./build/examples/demo/loom-demo "$@"
