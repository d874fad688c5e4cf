# A save killed (SIGKILL) at each point of its protocol leaves the previous checkpoint
# loadable: train 2 steps and save; resume, train to step 4 and save with the process killed
# at POINT; then resume again: it must start from step 2 and finish.
# Inputs: TRAIN (llama-train), WORKDIR.
set(common --dp 2 --tp 1 --pp 1 --zero 3 --dim 32 --n-layers 2 --seq 16 --batch 2 --micro-batches 2 --data counting)
foreach(point rank-files manifest renamed latest-tmp)
  set(dir ${WORKDIR}/crash-${point})
  file(REMOVE_RECURSE ${dir})
  execute_process(COMMAND ${TRAIN} ${common} --steps 2 --save ${dir} OUTPUT_VARIABLE out RESULT_VARIABLE rc TIMEOUT 60)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${point}: the first save failed (${rc})\n${out}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env LOOM_CHECKPOINT_CRASH=${point} ${TRAIN} ${common} --steps 4 --resume ${dir}
                          --save ${dir} OUTPUT_VARIABLE out RESULT_VARIABLE rc TIMEOUT 60)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${point}: the save was not killed\n${out}")
  endif()
  execute_process(COMMAND ${TRAIN} ${common} --steps 5 --resume ${dir} OUTPUT_VARIABLE out RESULT_VARIABLE rc TIMEOUT 60)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "resumed from [^\n]*step-2 at step 2" OR NOT out MATCHES "step 5/5 \\| loss")
    message(FATAL_ERROR "${point}: resuming after the crash failed (${rc})\n${out}")
  endif()
  message(STATUS "${point}: killed mid-save, resumed from step 2")
endforeach()
