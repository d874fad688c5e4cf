# loom_add_subdirectories(): adds every child folder that has a CMakeLists.txt, so that a
# module's tests, benchmarks or examples register themselves without editing a shared list.
macro(loom_add_subdirectories)
  file(GLOB _loom_children LIST_DIRECTORIES true ${CMAKE_CURRENT_SOURCE_DIR}/*)
  foreach(_loom_child IN LISTS _loom_children)
    if(IS_DIRECTORY ${_loom_child} AND EXISTS ${_loom_child}/CMakeLists.txt)
      add_subdirectory(${_loom_child})
    endif()
  endforeach()
endmacro()

# loom_bench_march(<target>): a header-only library is compiled for the machine it runs on, so
# benchmarks let the elementwise loops use it: -march=${LOOM_BENCH_MARCH} (default native).
# To measure what a CPU without AVX-512 runs on one that has it, configure a second build with
# -DLOOM_BENCH_MARCH=x86-64-v3 (AVX2 + FMA) and run with LOOM_SGEMM=avx2 (docs/benchmarks.md).
set(LOOM_BENCH_MARCH native CACHE STRING "-march= for benchmark programs (native, x86-64-v3, ...; empty: none)")
function(loom_bench_march target)
  if(LOOM_BENCH_MARCH)
    include(CheckCXXCompilerFlag)
    string(MAKE_C_IDENTIFIER "LOOM_HAS_MARCH_${LOOM_BENCH_MARCH}" _var)
    check_cxx_compiler_flag(-march=${LOOM_BENCH_MARCH} ${_var})
    if(${_var})
      target_compile_options(${target} PRIVATE -march=${LOOM_BENCH_MARCH})
    endif()
  endif()
endfunction()

# loom_example_tests(): registers the tests of the programs the calling examples/ folder defines
# from tests/<that folder>/cli_tests.cmake, so tests live under tests/ (mirroring the tree) while
# they run in the program's scope: CMAKE_CURRENT_SOURCE_DIR / _BINARY_DIR are the program's
# folders, and its targets are defined (tests/ is added before examples/).
function(loom_example_tests)
  if(NOT LOOM_BUILD_TESTS)
    return()
  endif()
  file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  include(${PROJECT_SOURCE_DIR}/tests/${_rel}/cli_tests.cmake)
endfunction()

# The standard headers that the header self-tests' and the test programs' precompiled headers
# hold: parsing them was much of a small unit's compile time (docs/reliability.md).
set(LOOM_PCH_STD_HEADERS algorithm array atomic chrono cmath condition_variable cstdint cstring functional map memory
                         mutex numeric optional span string string_view thread unordered_map utility vector)
# loom_precompile(<target> <header>...): the headers (as in #include <...>) precompiled for the
# target's C++ units
function(loom_precompile target)
  set(headers ${ARGN})
  list(TRANSFORM headers REPLACE "(.+)" "$<$<COMPILE_LANGUAGE:CXX>:<\\1>>")
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
