# Script mode (cmake -P): install loom, build and run the consumer both ways.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${LOOM_BINARY_DIR} --prefix ${prefix})
if(NOT EXISTS ${prefix}/include/loom/core/buffer.hpp)
  message(FATAL_ERROR "headers were not installed under ${prefix}/include")
endif()

foreach(mode find_package add_subdirectory)
  set(bdir ${WORK_DIR}/build-${mode})
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${bdir} -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${prefix}
      -DCONSUMER_MODE=${mode} -DLOOM_SOURCE_DIR=${LOOM_SOURCE_DIR} -DLOOM_ENABLE_CUDA=OFF)
  run(${CMAKE_COMMAND} --build ${bdir})
  run(${bdir}/consumer_app)
  if(NOT last_output MATCHES "consumer ok: sum=6 half=0x3c00")
    message(FATAL_ERROR "consumer (${mode}) printed unexpected output: ${last_output}")
  endif()
  message(STATUS "${mode}: ${last_output}")
endforeach()
