#!/usr/bin/env bash
# Builds loom's libFuzzer targets (fuzz/, clang, ASan + UBSan) into ./build-fuzz, replays each
# target's committed seeds (fuzz/corpus/<target>/) one file at a time (the regression: every
# seed runs whatever SECONDS is), then fuzzes it for SECONDS (default 20) from those seeds.
#   scripts/fuzz.sh [SECONDS] [TARGET...]      e.g. scripts/fuzz.sh 3600 safetensors
# FUZZ_RUNS=N stops a target after N executions (SECONDS stays the upper bound): the long runs
# of docs/reliability.md ("Figures") are FUZZ_RUNS=1000000 with a large SECONDS.
# A finding (crash, sanitizer report, exception other than loom::error, an input slower than
# 10 s, more than 2 GiB RSS) stops that target, leaves the input in build-fuzz/artifacts/ and
# makes the script fail. New inputs the fuzzer finds go to build-fuzz/corpus/<target>/ (kept
# between runs, not committed). Reproduce one: build-fuzz/fuzz/fuzz_<target> <file>, with
# LOOM_FUZZ_VERBOSE=1 to print the reader's refusals.
# FUZZ_STEP=build stops after building the targets (.ci/run builds ahead this way).
# FUZZ_LANES=N runs N targets at a time (default: one per core, or 1 with FUZZ_JOBS).
# FUZZ_JOBS=N runs N processes per target (libFuzzer -fork) on a machine with cores to spare.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
shift || true
all=(llama2c_checkpoint llama2c_tokenizer safetensors hf_config hf_index ds_config token_shard chat_jsonl chat_template
     serve_request checkpoint_manifest adapter_config sentencepiece_model)
targets=("$@")
((${#targets[@]})) || targets=("${all[@]}")

# Largest input per format: room for a few tensors / tokens / records past the seeds, small
# enough that each execution stays fast (the readers' cost grows with the input).
declare -A max_len=([llama2c_checkpoint]=4096 [llama2c_tokenizer]=8192 [safetensors]=4096 [hf_config]=2048
                    [hf_index]=2048 [ds_config]=4096 [token_shard]=1024 [chat_jsonl]=4096 [chat_template]=4096
                    [serve_request]=4096 [checkpoint_manifest]=4096 [adapter_config]=2048
                    [sentencepiece_model]=8192)

command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DLOOM_FUZZ=ON \
  -DLOOM_BUILD_TESTS=OFF -DLOOM_BUILD_BENCHMARKS=OFF -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_HEADER_TESTS=OFF \
  -DLOOM_ENABLE_CUDA=OFF -DLOOM_ENABLE_MPI=OFF -DLOOM_ENABLE_BLAS=OFF >/dev/null
for t in "${targets[@]}"; do
  [[ -n "${max_len[$t]:-}" ]] || { echo "fuzz.sh: unknown target '$t' (${all[*]})" >&2; exit 2; }
done
# A target whose optional dependency this machine lacks (sentencepiece_model: libsentencepiece-dev;
# the JSON readers: nlohmann-json) is not configured: skipped, saying so
read -r -a built <build-fuzz/fuzz/targets.txt
kept=()
for t in "${targets[@]}"; do
  if [[ " ${built[*]//;/ } " == *" $t "* ]]; then kept+=("$t"); else echo "fuzz.sh: skipping $t: not configured here (fuzz/CMakeLists.txt)"; fi
done
targets=("${kept[@]}")
((${#targets[@]})) || { echo "fuzz.sh: no target to run" >&2; exit 2; }
cmake --build build-fuzz --target "${targets[@]/#/fuzz_}"
[[ "${FUZZ_STEP:-}" != build ]] || exit 0  # .ci/run builds ahead in the background

mkdir -p build-fuzz/artifacts build-fuzz/logs
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}
# fuzz_one TARGET: the seeds, then the search; what it prints goes to logs/TARGET.out, its
# summary row to logs/TARGET.row, and logs/TARGET.rc says whether it found something.
fuzz_one() {
  local t=$1 rc=0 log="build-fuzz/logs/$1.log" execs rate rss units result=ok
  mkdir -p "build-fuzz/corpus/$t"
  local args=(-max_total_time="$seconds" -max_len="${max_len[$t]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
              -artifact_prefix="build-fuzz/artifacts/$t-")
  [[ -f "fuzz/dict/$t.dict" ]] && args+=(-dict="fuzz/dict/$t.dict")
  [[ -n "${FUZZ_JOBS:-}" ]] && args+=(-fork="$FUZZ_JOBS")
  [[ -n "${FUZZ_RUNS:-}" ]] && args+=(-runs="$FUZZ_RUNS")
  {
    echo "== fuzz_$t: the seeds, then ${seconds}s${FUZZ_RUNS:+ or $FUZZ_RUNS runs} (log: $log)"
    # The seeds as files: each runs once, whatever the time budget, and a failing one is named
    "build-fuzz/fuzz/fuzz_$t" -timeout=10 -rss_limit_mb=2048 "fuzz/corpus/$t"/* >"$log" 2>&1 || rc=$?
    # first corpus directory: where new inputs go; the second (the committed seeds) is read only
    ((rc != 0)) || "build-fuzz/fuzz/fuzz_$t" "${args[@]}" "build-fuzz/corpus/$t" "fuzz/corpus/$t" >>"$log" 2>&1 || rc=$?
    if ((rc != 0)); then
      result=FINDING
      echo "   FAILED (exit $rc); the report:"
      grep -E -A40 "^==[0-9]+==ERROR|runtime error|deadly signal|terminate called|Test unit written" "$log" | head -80 || tail -40 "$log"
    fi
  } >"build-fuzz/logs/$t.out"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
  units=$(ls "build-fuzz/corpus/$t" | wc -l)
  printf '%-20s %12s %8s %7s %7s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$units" "${rss:-?}" "$result" >"build-fuzz/logs/$t.row"
  echo "$rc" >"build-fuzz/logs/$t.rc"
}
# FUZZ_LANES targets at a time (default: one per core; one with FUZZ_JOBS, which forks per target):
# a libFuzzer process uses one core, so one lane would leave the others idle
lanes=${FUZZ_LANES:-$([[ -n "${FUZZ_JOBS:-}" ]] && echo 1 || nproc)}
rm -f build-fuzz/logs/*.rc
for t in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= lanes)); do wait -n || true; done
  fuzz_one "$t" &
done
wait
failed=()
summary=()
for t in "${targets[@]}"; do
  cat "build-fuzz/logs/$t.out"
  summary+=("$(cat "build-fuzz/logs/$t.row")")
  [[ "$(cat "build-fuzz/logs/$t.rc" 2>/dev/null)" == 0 ]] || failed+=("$t")
done
printf '%-20s %12s %8s %7s %7s  %s\n' target execs exec/s corpus rss_mb result
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs in build-fuzz/artifacts/)" >&2
  exit 1
fi
