# Compiles every public header on its own: one generated translation unit per header that
# includes it twice (include guard) and nothing else. `.hpp` headers are compiled by the C++
# compiler, `.cuh` headers by nvcc. A header's dependencies follow from its path (see
# docs/conventions.md): `.cuh` or a `cuda/` folder -> loom::cuda; `mpi` in the file name ->
# loom::mpi; `nccl` -> loom::cuda + loom::mpi; `blas` in the name or under a `host/` folder, `nn` or
# `lora` -> loom::blas; `sentencepiece` in the file name -> loom::sentencepiece; `http` in the file
# name -> loom::httplib; a header that includes
# <nlohmann/...> -> nlohmann_json. Headers whose dependency is not available are skipped.

function(loom_add_header_tests include_dir)
  file(GLOB_RECURSE headers RELATIVE ${include_dir} CONFIGURE_DEPENDS ${include_dir}/loom/*.hpp ${include_dir}/loom/*.cuh)
  set(out_dir ${CMAKE_CURRENT_BINARY_DIR}/header_tests)
  set(sources_cxx)
  set(sources_cuda)
  foreach(h IN LISTS headers)
    set(needs_cuda FALSE)
    set(needs_mpi FALSE)
    set(needs_blas FALSE)
    set(needs_json FALSE)
    set(needs_sp FALSE)
    set(needs_http FALSE)
    file(STRINGS ${include_dir}/${h} json_include REGEX "#include <nlohmann/")
    if(json_include)
      set(needs_json TRUE)
    endif()
    if(h MATCHES "\\.cuh$" OR h MATCHES "/cuda/" OR h MATCHES "nccl")
      set(needs_cuda TRUE)
    endif()
    get_filename_component(fname ${h} NAME)
    if(fname MATCHES "mpi" OR fname MATCHES "nccl")
      set(needs_mpi TRUE)
    endif()
    if(fname MATCHES "blas" OR h MATCHES "^loom/[a-z_]+/host/" OR h MATCHES "^loom/nn/" OR h MATCHES "^loom/lora/")
      set(needs_blas TRUE)
    endif()
    if(fname MATCHES "sentencepiece")
      set(needs_sp TRUE)
    endif()
    if(fname MATCHES "http")
      set(needs_http TRUE)
    endif()
    if((needs_sp AND NOT LOOM_HAS_SENTENCEPIECE) OR (needs_http AND NOT LOOM_HAS_HTTPLIB) OR (needs_cuda AND NOT LOOM_HAS_CUDA) OR (needs_mpi AND NOT LOOM_HAS_MPI) OR (needs_blas AND NOT LOOM_HAS_BLAS) OR (needs_json AND NOT LOOM_HAS_JSON))
      continue()
    endif()
    string(MAKE_C_IDENTIFIER ${h} id)
    if(h MATCHES "\\.cuh$")
      set(tu ${out_dir}/${id}.cu)
    else()
      set(tu ${out_dir}/${id}.cpp)
    endif()
    set(content "#include <${h}>\n#include <${h}>\n")
    if(EXISTS ${tu})
      file(READ ${tu} old)
    endif()
    if(NOT old STREQUAL content)
      file(WRITE ${tu} "${content}")
    endif()
    if(h MATCHES "\\.cuh$")
      list(APPEND sources_cuda ${tu})
    else()
      list(APPEND sources_cxx ${tu})
    endif()
  endforeach()

  set(deps loom::loom)
  foreach(t blas mpi cuda sentencepiece httplib)
    if(TARGET loom::${t})
      list(APPEND deps loom::${t})
    endif()
  endforeach()
  if(LOOM_HAS_JSON)
    list(APPEND deps nlohmann_json::nlohmann_json)
  endif()
  add_library(loom_header_tests OBJECT ${sources_cxx} ${sources_cuda})
  target_link_libraries(loom_header_tests PRIVATE ${deps} loom_warnings)
  # The C++ units share a precompiled set of standard headers. Parsing those was about half of
  # each unit's time (docs/reliability.md), and what these units check -- that a loom header
  # includes the loom headers and libraries it uses -- does not depend on it. What it gives up,
  # a missing #include of one of these standard headers, one libstdc++ version could not show
  # reliably anyway: its headers include each other.
  set(std_headers algorithm array atomic chrono cmath condition_variable cstdint cstring functional map memory mutex
                  numeric optional span string string_view thread unordered_map utility vector)
  list(TRANSFORM std_headers REPLACE "(.+)" "$<$<COMPILE_LANGUAGE:CXX>:<\\1>>")
  target_precompile_headers(loom_header_tests PRIVATE ${std_headers})
  # Compiling is what these units check, not code: no optimisation (faster, and free of the
  # optimiser's flow warnings, which the test programs' own units report where code runs).
  target_compile_options(loom_header_tests PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
  if(sources_cuda)
    set_target_properties(loom_header_tests PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  endif()
  list(LENGTH sources_cxx n_cxx)
  list(LENGTH sources_cuda n_cuda)
  message(STATUS "loom header tests: ${n_cxx} with the C++ compiler, ${n_cuda} with nvcc")
endfunction()
