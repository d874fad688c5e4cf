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
