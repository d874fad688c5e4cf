# loom_add_test(<name> SOURCES ... [LIBS ...] [LABELS ...] [NP n...] [ARGS ...] [MPI] [GPU] [EMULATED] [TIMEOUT s])
#
# One doctest executable registered as one CTest test (every test has a timeout: nothing may
# hang CI). MPI: the executable uses the MPI test main (tests/support/mpi_main.cpp) and is
# registered once per NP value as `<name>.np<N>` under mpirun. GPU: the test main exits 77
# (reported as skipped) when no CUDA device is present; the test carries the label `gpu`.
# EMULATED: CUDA code compiled by g++ for the CPU (tests/ops/cuda/emulation.hpp): the emulated
# runtime's headers (tests/ops/cuda/emulated_runtime) come first on the include path, and
# nvcc's `#pragma unroll` is not a warning.

find_package(doctest REQUIRED)

# doctest's implementation once (a static library, so every main's executables link it); each
# main below is then only its main().
add_library(loom_test_doctest STATIC ${PROJECT_SOURCE_DIR}/tests/support/doctest_impl.cpp)
target_link_libraries(loom_test_doctest PUBLIC doctest::doctest)
add_library(loom_test_main OBJECT ${PROJECT_SOURCE_DIR}/tests/support/doctest_main.cpp)
target_link_libraries(loom_test_main PUBLIC loom::loom loom_test_doctest)

if(LOOM_HAS_CUDA)
  add_library(loom_test_main_gpu OBJECT ${PROJECT_SOURCE_DIR}/tests/support/gpu_main.cpp)
  target_link_libraries(loom_test_main_gpu PUBLIC loom::cuda loom_test_doctest)
  # Every executable of a GPU test: what scripts/gpu-check.sh builds (and nothing else).
  add_custom_target(loom_gpu_tests)
endif()

if(LOOM_HAS_MPI)
  add_library(loom_test_main_mpi OBJECT ${PROJECT_SOURCE_DIR}/tests/support/mpi_main.cpp)
  target_link_libraries(loom_test_main_mpi PUBLIC loom::mpi loom_test_doctest)
  # mpirun as root and with more ranks than cores (CI has 2 cores, tests use up to 4 ranks).
  set(LOOM_MPIEXEC_FLAGS --oversubscribe --bind-to none)
  if(LOOM_HAS_CUDA)
    # MPI tests that need one GPU per rank (MPI + GPU): exit 77 (skipped) without enough devices.
    add_library(loom_test_main_mpi_gpu OBJECT ${PROJECT_SOURCE_DIR}/tests/support/mpi_main.cpp)
    target_link_libraries(loom_test_main_mpi_gpu PUBLIC loom::mpi loom::cuda loom_test_doctest)
    target_compile_definitions(loom_test_main_mpi_gpu PRIVATE LOOM_TEST_MPI_GPU=1)
  endif()
  execute_process(COMMAND id -u OUTPUT_VARIABLE _uid OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_uid STREQUAL "0")
    list(APPEND LOOM_MPIEXEC_FLAGS --allow-run-as-root)
  endif()
endif()

# doctest and the standard headers most tests include, precompiled once per build: every C++
# test program reuses it (loom_use_test_pch). Parsing them was about a third of a small test's
# unit (docs/reliability.md). A unit whose flags make the PCH invalid for it (GCC says so with
# -Winvalid-pch) parses the same headers instead: slower, never different.
add_library(loom_test_pch OBJECT ${PROJECT_SOURCE_DIR}/tests/support/pch.cpp)
target_link_libraries(loom_test_pch PRIVATE loom::loom doctest::doctest)
loom_precompile(loom_test_pch doctest/doctest.h ${LOOM_PCH_STD_HEADERS} random sstream)
function(loom_use_test_pch target)
  target_precompile_headers(${target} REUSE_FROM loom_test_pch)
endfunction()

set(LOOM_TEST_TIMEOUT 300 CACHE STRING "Default timeout of each test in seconds")
# Test executables a build leaves out: not built by default and their tests not registered
# (scripts/sanitize.sh: the sanitizer builds skip what only repeats sanitized paths).
set(LOOM_SKIP_TESTS "" CACHE STRING "Test executables (loom_add_test names) to leave out of this build")

# PyTorch, the oracle of the parity tests: probed once here (Debian's python3-torch is at
# /usr/bin/python3, not the pyenv python3 on PATH). LOOM_HAS_TORCH gates those tests.
set(LOOM_TORCH_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with torch for the PyTorch parity tests")
execute_process(COMMAND ${LOOM_TORCH_PYTHON} -c "import torch, numpy" RESULT_VARIABLE _loom_no_torch OUTPUT_QUIET ERROR_QUIET)
if(_loom_no_torch EQUAL 0)
  set(LOOM_HAS_TORCH TRUE)
else()
  set(LOOM_HAS_TORCH FALSE)
endif()

# SentencePiece tokenizers and chat templates are checked against Debian's python3-sentencepiece:
# the fixture (tests/data) trains two tokenizer.model files with spm_train into
# LOOM_TOKENIZER_FIXTURES_DIR and writes what Python gives. Probed here, before any folder is
# added, because tests/ and the examples' CLI tests (registered from examples/) both read them.
set(LOOM_TOKENIZER_ORACLE FALSE)
set(LOOM_TOKENIZER_FIXTURES_DIR ${PROJECT_BINARY_DIR}/tests/data/tokenizer_fixtures)
if(LOOM_HAS_SENTENCEPIECE AND LOOM_HAS_JSON)
  find_program(LOOM_SPM_TRAIN spm_train)
  execute_process(COMMAND /usr/bin/python3 -c "import sentencepiece" RESULT_VARIABLE _py_sp OUTPUT_QUIET ERROR_QUIET)
  if(LOOM_SPM_TRAIN AND _py_sp EQUAL 0)
    set(LOOM_TOKENIZER_ORACLE TRUE)
  else()
    message(STATUS "loom: spm_train or /usr/bin/python3's sentencepiece missing (apt-get install sentencepiece "
                   "python3-sentencepiece): the SentencePiece tests are skipped")
  endif()
endif()

# loom_test_torch_oracle(<target>): LOOM_TEST_DIR (the calling folder, where the oracle script
# lies) and, where /usr/bin/python3 has torch and numpy, LOOM_TORCH_PYTHON, which compiles the
# test's PyTorch/numpy comparison in; elsewhere a warning says it runs without it.
function(loom_test_torch_oracle target)
  target_compile_definitions(${target} PRIVATE LOOM_TEST_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
  if(LOOM_HAS_TORCH)
    target_compile_definitions(${target} PRIVATE LOOM_TORCH_PYTHON="${LOOM_TORCH_PYTHON}")
  else()
    message(WARNING "${LOOM_TORCH_PYTHON} cannot import torch and numpy: ${target} runs without its PyTorch comparison")
  endif()
endfunction()

function(loom_add_test name)
  cmake_parse_arguments(T "MPI;GPU;EMULATED" "TIMEOUT" "SOURCES;LIBS;LABELS;NP;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT ${LOOM_TEST_TIMEOUT})
  endif()
  if(T_MPI AND NOT LOOM_HAS_MPI)
    return()
  endif()
  if(T_GPU AND NOT LOOM_HAS_CUDA)
    return()
  endif()
  set(skip)
  if(name IN_LIST LOOM_SKIP_TESTS)
    set(skip EXCLUDE_FROM_ALL)  # still a target (its folder may set its properties), but not built
  endif()
  add_executable(${name} ${skip} ${T_SOURCES})
  if(T_MPI AND T_GPU)
    set(main loom_test_main_mpi_gpu)
  elseif(T_MPI)
    set(main loom_test_main_mpi)
  elseif(T_GPU)
    set(main loom_test_main_gpu)
  else()
    set(main loom_test_main)
  endif()
  target_link_libraries(${name} PRIVATE ${main} loom::loom doctest::doctest loom_warnings ${T_LIBS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)  # <support/...>
  if(T_EMULATED)
    target_include_directories(${name} BEFORE PRIVATE ${PROJECT_SOURCE_DIR}/tests/ops/cuda/emulated_runtime)
    target_compile_options(${name} PRIVATE -Wno-unknown-pragmas)
  endif()
  if(NOT T_GPU)  # nvcc takes no precompiled header
    loom_use_test_pch(${name})
  else()
    set_target_properties(${name} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
    list(APPEND T_LABELS gpu)
    add_dependencies(loom_gpu_tests ${name})
  endif()
  if(skip)
    return()
  endif()
  set(env "OPENBLAS_NUM_THREADS=1;OMP_NUM_THREADS=1")
  if(T_MPI)
    foreach(np IN LISTS T_NP)
      add_test(NAME ${name}.np${np}
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${LOOM_MPIEXEC_FLAGS} ${MPIEXEC_PREFLAGS}
                       $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS} ${T_ARGS})
      set_tests_properties(${name}.np${np} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "mpi;${T_LABELS}" ENVIRONMENT "${env}"
                                                      PROCESSORS ${np})
      if(T_GPU)
        set_tests_properties(${name}.np${np} PROPERTIES SKIP_RETURN_CODE 77)
      endif()
    endforeach()
  else()
    add_test(NAME ${name} COMMAND ${name} ${T_ARGS})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} ENVIRONMENT "${env}")
    if(T_LABELS)
      set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}")
    endif()
    if(T_GPU)
      set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
    endif()
  endif()
endfunction()

# loom_add_test_group(<binary> TESTS <name> <source> [<name> <source> ...] [LIBS ...] [LABELS ...]
#                     [TIMEOUT s])
#
# Several doctest files that instantiate the same heavy templates (the mesh trainer, the
# server) compiled as ONE translation unit (CMake's unity build) into one executable, and
# still registered as one CTest test per file: test <name> runs the binary on the test cases
# of <source> only (doctest --source-file). Why: each file would otherwise instantiate the
# same templates again, and compile time is most of CI's time on 2 cores. The files must not
# define the same names at namespace scope (give helpers distinct names).
function(loom_add_test_group binary)
  cmake_parse_arguments(T "" "TIMEOUT" "TESTS;LIBS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT ${LOOM_TEST_TIMEOUT})
  endif()
  set(names)
  set(sources)
  while(T_TESTS)
    list(POP_FRONT T_TESTS name source)
    list(APPEND names ${name})
    list(APPEND sources ${source})
  endwhile()
  add_executable(${binary} ${sources})
  set_target_properties(${binary} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
  target_link_libraries(${binary} PRIVATE loom_test_main loom::loom doctest::doctest loom_warnings ${T_LIBS})
  target_include_directories(${binary} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  loom_use_test_pch(${binary})
  foreach(name source IN ZIP_LISTS names sources)
    get_filename_component(file ${source} NAME)
    add_test(NAME ${name} COMMAND ${binary} --source-file=*/${file})
    # a filter that selects nothing (a renamed file) must fail, not pass with 0 test cases
    set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} ENVIRONMENT "OPENBLAS_NUM_THREADS=1;OMP_NUM_THREADS=1"
                                            FAIL_REGULAR_EXPRESSION "test cases: +0 \\|")
    if(T_LABELS)
      set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}")
    endif()
  endforeach()
endfunction()
