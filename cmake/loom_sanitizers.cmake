# Sanitizer and fuzzing options of loom's own builds (not exported to consumers).
#
# LOOM_SANITIZE: a -fsanitize= list applied to everything this build compiles and links, e.g.
#   "address,undefined" (scripts/sanitize.sh asan) or "thread" (scripts/sanitize.sh tsan).
#   Reports are fatal (-fno-sanitize-recover=all), so a test that trips one fails.
# LOOM_FUZZ: builds the libFuzzer targets in fuzz/ (needs clang; scripts/fuzz.sh).

set(LOOM_SANITIZE "" CACHE STRING "Sanitizers for loom's tests and examples: a -fsanitize= list (address,undefined or thread), empty for none")
option(LOOM_FUZZ "Build the libFuzzer targets in fuzz/ (clang)" OFF)

if(LOOM_SANITIZE)
  add_compile_options(-fsanitize=${LOOM_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${LOOM_SANITIZE})
endif()
if(LOOM_FUZZ AND NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "LOOM_FUZZ=ON needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
endif()
