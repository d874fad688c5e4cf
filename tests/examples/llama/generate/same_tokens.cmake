# ctest -P script: runs CMD (a ;-list: the program and its arguments) once with `--tp 1` and once
# with `--tp ${TP}`, and fails unless both print the same generated-token lines ("[i]  ids")
# and the second reports tp ${TP}. The one-rank run is the oracle, made on the machine that
# runs the test (so its kernel, whichever the CPU has, decides both).
# LAUNCH (optional, a ;-list): what starts the --tp ${TP} run, e.g. "mpiexec;-n;2;--oversubscribe":
# the tensor group is then mpirun's processes, not threads.
foreach(tp 1 ${TP})
  set(launch "")
  if(NOT tp EQUAL 1)
    set(launch ${LAUNCH})
  endif()
  execute_process(COMMAND ${launch} ${CMD} --tp ${tp} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  message("${launch} --tp ${tp}:\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the --tp ${tp} run exited with ${rc}")
  endif()
  string(REGEX MATCHALL "\\[[0-9]+\\]  [0-9 ]+" tokens_${tp} "${out}")
  if(NOT tokens_${tp})
    message(FATAL_ERROR "the --tp ${tp} run printed no token lines")
  endif()
  if(NOT out MATCHES "tp ${tp}\n")
    message(FATAL_ERROR "the --tp ${tp} run does not report tp ${tp}")
  endif()
endforeach()
if(NOT tokens_1 STREQUAL tokens_${TP})
  message(FATAL_ERROR "--tp ${TP} generated\n  ${tokens_${TP}}\nbut --tp 1\n  ${tokens_1}")
endif()
