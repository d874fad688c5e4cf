# llama-train under mpirun reproduces the single-rank run: the same binary, ZeRO stage 3 on
# NP processes with micro batch 8/NP, against one process with stage 0 and micro batch 8.
# The printed losses (4 decimals) of every step must agree.
# Inputs: TRAIN (llama-train), MPIEXEC, NP, FLAGS (mpirun flags, ;-list), WORKDIR.
file(MAKE_DIRECTORY ${WORKDIR})
foreach(stage 0 3)
  file(WRITE ${WORKDIR}/stage${stage}.json
       "{\"train_batch_size\": 8, \"gradient_clipping\": 0.5, \"zero_optimization\": {\"stage\": ${stage}, "
       "\"reduce_bucket_size\": 20000, \"stage3_prefetch_bucket_size\": 20000, \"stage3_param_persistence_threshold\": 100}}")
endforeach()
set(common --steps 4 --dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --hidden-dim 64 --seq-len 16)
execute_process(COMMAND ${TRAIN} --config ${WORKDIR}/stage0.json ${common} OUTPUT_VARIABLE one RESULT_VARIABLE rc1)
execute_process(COMMAND ${MPIEXEC} -np ${NP} ${FLAGS} ${TRAIN} --config ${WORKDIR}/stage3.json ${common}
                OUTPUT_VARIABLE many RESULT_VARIABLE rc2 TIMEOUT 100)
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "llama-train failed (single: ${rc1}, mpirun: ${rc2})\n${one}\n${many}")
endif()
string(REGEX MATCHALL "loss [0-9.]+" l1 "${one}")
string(REGEX MATCHALL "loss [0-9.]+" l2 "${many}")
list(LENGTH l1 n1)
if(NOT n1 EQUAL 4 OR NOT l1 STREQUAL l2)
  message(FATAL_ERROR "losses differ: single rank [${l1}], mpirun -np ${NP} stage 3 [${l2}]\n${many}")
endif()
if(NOT many MATCHES "zero stage 3 x ${NP} data-parallel ranks")
  message(FATAL_ERROR "mpirun output lacks the ZeRO summary line:\n${many}")
endif()
message(STATUS "single rank and mpirun -np ${NP} (stage 3) agree: ${l2}")
