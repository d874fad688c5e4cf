# cpp-httplib as the interface target llama_httplib (Debian ships it compiled, with a
# pkg-config file whose flags must match the library's build: SSL, zlib, brotli). Sets
# LLAMA_HAS_HTTPLIB and LLAMA_HTTPLIB_VERSION; a version the server cannot use fails the
# configuration, naming it. Included by the server example and its tests.
if(TARGET llama_httplib)
  set(LLAMA_HAS_HTTPLIB TRUE)
  return()
endif()
set(LLAMA_HAS_HTTPLIB FALSE)
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(CPP_HTTPLIB QUIET IMPORTED_TARGET GLOBAL cpp-httplib)
endif()
if(CPP_HTTPLIB_FOUND)
  add_library(llama_httplib INTERFACE IMPORTED GLOBAL)
  target_link_libraries(llama_httplib INTERFACE PkgConfig::CPP_HTTPLIB Threads::Threads)
  set(LLAMA_HAS_HTTPLIB TRUE)
else()
  find_path(LLAMA_HTTPLIB_INCLUDE httplib.h)
  if(LLAMA_HTTPLIB_INCLUDE)  # the single-header version
    add_library(llama_httplib INTERFACE IMPORTED GLOBAL)
    target_include_directories(llama_httplib SYSTEM INTERFACE ${LLAMA_HTTPLIB_INCLUDE})
    target_link_libraries(llama_httplib INTERFACE Threads::Threads)
    set(LLAMA_HAS_HTTPLIB TRUE)
  else()
    message(STATUS "llama-serve: cpp-httplib not found, the server is not built")
  endif()
endif()

# The version: http_guard.hpp overrides httplib internals that match its signatures only in
# [httplib_min_version, httplib_end_version) (read from that header, which also checks it at
# compile time). Outside that range the build would fail deep in httplib's classes, or, for
# the internals a later version keeps but uses differently, build a server without its limits.
if(LLAMA_HAS_HTTPLIB)
  find_path(LLAMA_HTTPLIB_HEADER_DIR httplib.h HINTS ${CPP_HTTPLIB_INCLUDE_DIRS} ${LLAMA_HTTPLIB_INCLUDE})
  set(_found "")
  if(LLAMA_HTTPLIB_HEADER_DIR)
    file(STRINGS "${LLAMA_HTTPLIB_HEADER_DIR}/httplib.h" _line REGEX "^#define CPPHTTPLIB_VERSION \"[0-9.]+\"")
    string(REGEX REPLACE ".*\"([0-9.]+)\".*" "\\1" _found "${_line}")
  endif()
  file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/http_guard.hpp" _range REGEX "httplib_(min|end)_version\\[\\] = \"[0-9.]+\"")
  string(REGEX REPLACE ".*httplib_min_version\\[\\] = \"([0-9.]+)\".*" "\\1" _min "${_range}")
  string(REGEX REPLACE ".*httplib_end_version\\[\\] = \"([0-9.]+)\".*" "\\1" _end "${_range}")
  if(NOT _found)
    message(FATAL_ERROR "llama-serve: cannot read CPPHTTPLIB_VERSION from httplib.h (looked in '${LLAMA_HTTPLIB_HEADER_DIR}'); "
                        "the server needs cpp-httplib >= ${_min} and < ${_end}. Configure with -DLOOM_BUILD_EXAMPLES=OFF to build without the examples.")
  elseif(_found VERSION_LESS _min OR NOT _found VERSION_LESS _end)
    message(FATAL_ERROR "llama-serve needs cpp-httplib >= ${_min} and < ${_end} (it overrides httplib's connection loop and "
                        "task queue, whose interfaces differ outside that range); found ${_found} in ${LLAMA_HTTPLIB_HEADER_DIR}/httplib.h. "
                        "Install a version in range, or configure with -DLOOM_BUILD_EXAMPLES=OFF to build without the examples.")
  endif()
  set(LLAMA_HTTPLIB_VERSION "${_found}")
  message(STATUS "llama-serve: cpp-httplib ${_found} (needs >= ${_min}, < ${_end})")
endif()
