#!/usr/bin/env bash
# Runs loom's tests under sanitizers, each in its own build folder:
#   scripts/sanitize.sh asan   ASan + UBSan (build-asan): the test suite, less the tests below
#   scripts/sanitize.sh tsan   TSan (build-tsan): the tests whose code runs on several threads
#                              (thread ranks, the thread pool, the serving scheduler, the
#                              collectives and executors over thread ranks, the HTTP server)
# Any sanitizer report fails its test (-fno-sanitize-recover=all, halt_on_error). Extra
# arguments go to ctest (e.g. -R thread_pool). The CUDA backend is off in these builds (nvcc
# does not take the host sanitizer flags); benchmarks and header tests are off (no code of
# their own runs under the tests that matter here, and they would double the build).
# SANITIZE_STEP=build stops after the build (.ci/run builds ahead in the background this way;
# running the script again then finds the build done and runs the tests).
# Optimisation (LOOM_SANITIZE_FLAGS overrides it, e.g. "-O1 -g" for file:line in reports):
#   asan: -Og, no debug info. Compiling is most of this part's time on 2 cores, and ASan +
#         UBSan instrumentation makes -O1's passes and the debug info the costly part of each
#         template-heavy unit (figures: docs/reliability.md). Reports still name every frame's
#         function; reproduce a failure with -g for file:line. The compute-bound GEMM test keeps
#         -O1 (tests/ops/host/CMakeLists.txt).
#   tsan: -O1 -g1: few targets, and a race report needs both accesses' file:line.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/sanitize.sh asan|tsan [ctest arguments]}
shift
jobs=${JOBS:-$(nproc)}
export OPENBLAS_NUM_THREADS=1
common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_ENABLE_CUDA=OFF -DLOOM_HEADER_TESTS=OFF -DLOOM_BUILD_BENCHMARKS=OFF)
case "$mode" in
  asan)
    dir=build-asan
    cmake -S . -B "$dir" "${common[@]}" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=${LOOM_SANITIZE_FLAGS:--Og}" \
          -DLOOM_SANITIZE=address,undefined "-DLOOM_SKIP_TESTS=test_train3d_mpi" >/dev/null
    cmake --build "$dir" -j "$jobs"
    [[ "${SANITIZE_STEP:-}" != build ]] || exit 0
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    # Left out: install_consumer_test builds and installs a separate project without the
    # sanitizers (nothing of it runs sanitized), and mpi_comm's 4-rank run repeats its 2-rank
    # run's cases (the 2-rank run, sweep included, stays; 4 ranks run unsanitized).
    # Not built (LOOM_SKIP_TESTS): test_train3d_mpi, the trainer's cases again on MPI processes.
    # Its trainer is the thread-rank tests' (over any_comm), sanitized in the trainer group, and
    # mpi_comm under it is sanitized in comm_mpi_comm_test.np2; its unit is the costliest of
    # this build for a 3 s run.
    # The programs' mpirun runs (llama-generate, llama-serve) are the thread-rank paths over
    # mpi_comm, both sanitized here apart (the engine's and the CLIs' thread-rank tests, the
    # MPI suites): of them, the np 2 runs, the fault and the server stay; np 4, the hostfile,
    # the 32-sequence workloads and the checkpoint files (and their fixtures, and the memory
    # refusal that reads one) run unsanitized in the main suite.
    exclude='^(install_consumer_test|comm_thread_comm_test|comm_mpi_comm_test\.np4'
    exclude+='|llama_generate_mpi_(np4_.*|np2_32seq_.*|np2_a_v1\.bin|np2_hf|hostfile4|tp_mismatch|checkpoints|hf_.*)'
    exclude+='|llama_generate_cli_memory_checkpoint_refused|llama_serve_mpi_np4)$'
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -E "$exclude" -LE mpi "$@"
    # thread_comm's op x type x size sweep (2^20+3 elements on 1..8 ranks) runs past its
    # timeout under ASan as under TSan; its other cases run here, the sweep unsanitized in
    # the main suite.
    "$dir/tests/comm/comm_thread_comm_test" --test-case-exclude='*every op x type x size*'
    # Under mpirun, Open MPI's own allocations still held at MPI_Finalize (hwloc, PMIx, its
    # dlopened plugins) are reported as thousands of leaks; the MPI tests run with leak
    # detection off, every other ASan and UBSan check on.
    ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" ctest --test-dir "$dir" --output-on-failure -j "$jobs" -E "$exclude" -L mpi "$@"
    ;;
  tsan)
    dir=build-tsan
    # the targets to build, and the CTest tests to run (the server's five tests are one
    # binary, llama_serve_tests: tests/serve)
    targets=(core_thread_pool_test comm_thread_comm_test comm_mesh_test sched_all_gather_test sched_reduce_scatter_test
             kv_scheduler_test zero_engine_test pipeline_executor_test comm_fault_thread_test llama_serve_tests)
    cmake -S . -B "$dir" "${common[@]}" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=${LOOM_SANITIZE_FLAGS:--O1 -g1}" \
          -DLOOM_SANITIZE=thread -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_ENABLE_MPI=OFF >/dev/null
    # the server's tests exist only where cpp-httplib and BLAS were found
    known=$(cmake --build "$dir" --target help)
    targets=($(for t in "${targets[@]}"; do grep -qw -- "$t" <<<"$known" && echo "$t"; done))
    cmake --build "$dir" -j "$jobs" --target "${targets[@]}"
    [[ "${SANITIZE_STEP:-}" != build ]] || exit 0
    tests=("${targets[@]/llama_serve_tests/llama_serve_test llama_serve_limits_test llama_serve_load_test llama_serve_chat_test llama_serve_lora_test}")
    tests=(${tests[@]})
    # scripts/tsan.supp: the uninstrumented cpp-httplib library's own accesses (why, in the file)
    export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp}
    # comm_thread_comm_test's sweep (every op x type x size on 1..8 ranks, 50 s unsanitized)
    # runs past its timeout under TSan's 5-15x; its other cases (split, async, point-to-point,
    # faults) run here directly, the sweep runs under ASan, and the collectives themselves also
    # run under TSan inside the sched, zero and pipeline tests.
    regex="^($(IFS='|'; echo "${tests[*]}"))\$"
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -R "$regex" -E '^comm_thread_comm_test$' "$@"
    "$dir/tests/comm/comm_thread_comm_test" --test-case-exclude='*every op x type x size*'
    ;;
  *) echo "usage: scripts/sanitize.sh asan|tsan [ctest arguments]" >&2; exit 2 ;;
esac
