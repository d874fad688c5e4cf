# Finds loom's optional dependencies and sets LOOM_HAS_{BLAS,MPI,CUDA,NCCL,SENTENCEPIECE,HTTPLIB}.
# Each LOOM_ENABLE_* is ON (required), OFF, or AUTO (used when found).

find_package(Threads REQUIRED)

function(loom_resolve_option opt found out)
  if(${opt} STREQUAL "OFF")
    set(${out} FALSE PARENT_SCOPE)
  elseif(${found})
    set(${out} TRUE PARENT_SCOPE)
  elseif(${opt} STREQUAL "ON")
    message(FATAL_ERROR "${opt} is ON but the dependency was not found")
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# -- CBLAS (OpenBLAS preferred)
set(_blas_found FALSE)
if(NOT LOOM_ENABLE_BLAS STREQUAL "OFF")
  if(NOT DEFINED BLA_VENDOR)
    set(BLA_VENDOR OpenBLAS)
  endif()
  find_package(BLAS QUIET)
  find_path(LOOM_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu aarch64-linux-gnu)
  if(BLAS_FOUND AND LOOM_CBLAS_INCLUDE_DIR)
    set(_blas_found TRUE)
  endif()
endif()
loom_resolve_option(${LOOM_ENABLE_BLAS} _blas_found LOOM_HAS_BLAS)

# -- MPI + Boost.MPI
set(_mpi_found FALSE)
if(NOT LOOM_ENABLE_MPI STREQUAL "OFF")
  find_package(MPI QUIET COMPONENTS CXX)
  find_package(Boost QUIET COMPONENTS mpi)
  if(MPI_CXX_FOUND AND Boost_MPI_FOUND)
    set(_mpi_found TRUE)
  endif()
endif()
loom_resolve_option(${LOOM_ENABLE_MPI} _mpi_found LOOM_HAS_MPI)

# -- CUDA toolkit (+ CCCL, NCCL)
set(_cuda_found FALSE)
set(LOOM_HAS_NCCL FALSE)
if(NOT LOOM_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # CMake 3.25 does not know nvcc's C++20 flag yet.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200); override on the command line
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit QUIET)
    if(CUDAToolkit_FOUND)
      set(_cuda_found TRUE)
      find_path(LOOM_CCCL_INCLUDE_DIR cub/cub.cuh HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES cccl)
      find_path(LOOM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
      find_library(LOOM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
      if(LOOM_NCCL_INCLUDE_DIR AND LOOM_NCCL_LIBRARY)
        set(LOOM_HAS_NCCL TRUE)
      endif()
    endif()
  endif()
endif()
loom_resolve_option(${LOOM_ENABLE_CUDA} _cuda_found LOOM_HAS_CUDA)
if(NOT LOOM_HAS_CUDA)
  set(LOOM_HAS_NCCL FALSE)
endif()

# -- nlohmann-json (config files and JSONL readers; headers that include it need it)
find_package(nlohmann_json 3 QUIET)
set(LOOM_HAS_JSON ${nlohmann_json_FOUND})

# -- SentencePiece (Debian's libsentencepiece-dev: tokenizer.model files). It ships a
# pkg-config file but no CMake package, so the library and header are found by name.
set(_sp_found FALSE)
if(NOT LOOM_ENABLE_SENTENCEPIECE STREQUAL "OFF")
  find_path(LOOM_SENTENCEPIECE_INCLUDE_DIR sentencepiece_processor.h)
  find_library(LOOM_SENTENCEPIECE_LIBRARY sentencepiece)
  if(LOOM_SENTENCEPIECE_INCLUDE_DIR AND LOOM_SENTENCEPIECE_LIBRARY)
    set(_sp_found TRUE)
  endif()
endif()
loom_resolve_option(${LOOM_ENABLE_SENTENCEPIECE} _sp_found LOOM_HAS_SENTENCEPIECE)
if(NOT LOOM_HAS_SENTENCEPIECE AND NOT LOOM_ENABLE_SENTENCEPIECE STREQUAL "OFF")
  message(STATUS "loom: SentencePiece not found (apt-get install libsentencepiece-dev sentencepiece python3-sentencepiece): "
                 "no loom::sentencepiece, tokenizer.model files cannot be read and their tests are skipped")
endif()

# -- cpp-httplib (loom/serve's HTTP server). Debian ships it compiled, with a pkg-config file
# whose flags must match the library's build (SSL, zlib, brotli); upstream's single header
# needs nothing but itself. The library is linked by the path found here, as SentencePiece's
# is, so that the installed loom::httplib needs no pkg-config at the consumer.
# http_guard.hpp overrides httplib internals that match its signatures only in
# [httplib_min_version, httplib_end_version) (read from that header, which also checks it at
# compile time): a version outside fails the configuration, naming it, instead of failing deep
# in httplib's classes or building a server without its limits.
set(_httplib_found FALSE)
if(NOT LOOM_ENABLE_HTTPLIB STREQUAL "OFF")
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(LOOM_CPP_HTTPLIB QUIET cpp-httplib)
  endif()
  find_path(LOOM_HTTPLIB_INCLUDE_DIR httplib.h HINTS ${LOOM_CPP_HTTPLIB_INCLUDE_DIRS})
  if(LOOM_HTTPLIB_INCLUDE_DIR)
    set(_httplib_found TRUE)
    file(STRINGS "${LOOM_HTTPLIB_INCLUDE_DIR}/httplib.h" _line REGEX "^#define CPPHTTPLIB_VERSION \"[0-9.]+\"")
    string(REGEX REPLACE ".*\"([0-9.]+)\".*" "\\1" _found "${_line}")
    file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/../include/loom/serve/http_guard.hpp" _range
         REGEX "httplib_(min|end)_version\\[\\] = \"[0-9.]+\"")
    string(REGEX REPLACE ".*httplib_min_version\\[\\] = \"([0-9.]+)\".*" "\\1" _min "${_range}")
    string(REGEX REPLACE ".*httplib_end_version\\[\\] = \"([0-9.]+)\".*" "\\1" _end "${_range}")
    if(NOT _found)
      message(FATAL_ERROR "loom: cannot read CPPHTTPLIB_VERSION from ${LOOM_HTTPLIB_INCLUDE_DIR}/httplib.h; loom/serve needs "
                          "cpp-httplib >= ${_min} and < ${_end}. Configure with -DLOOM_ENABLE_HTTPLIB=OFF to build without it.")
    elseif(_found VERSION_LESS _min OR NOT _found VERSION_LESS _end)
      message(FATAL_ERROR "loom/serve needs cpp-httplib >= ${_min} and < ${_end} (it overrides httplib's connection loop and "
                          "task queue, whose interfaces differ outside that range); found ${_found} in "
                          "${LOOM_HTTPLIB_INCLUDE_DIR}/httplib.h. Install a version in range, or configure with "
                          "-DLOOM_ENABLE_HTTPLIB=OFF to build without it.")
    endif()
    set(LOOM_HTTPLIB_VERSION "${_found}")
  endif()
endif()
loom_resolve_option(${LOOM_ENABLE_HTTPLIB} _httplib_found LOOM_HAS_HTTPLIB)
if(LOOM_HAS_HTTPLIB)
  message(STATUS "loom: cpp-httplib ${LOOM_HTTPLIB_VERSION} (loom/serve needs >= ${_min}, < ${_end})")
elseif(NOT LOOM_ENABLE_HTTPLIB STREQUAL "OFF")
  message(STATUS "loom: cpp-httplib not found (apt-get install libcpp-httplib-dev): no loom::httplib, the HTTP server "
                 "and its tests are not built")
endif()
