# ctest -P script: runs CMD (a ;-list: the program and its arguments) once with `--tp 1` and once
# with `--tp ${TP} --pp ${PP}` (each 1 when not given), and fails unless both print the same
# generated-token lines ("[i]  ids") and each reports its ranks ("tp N, pp P"). The one-rank
# run is the oracle, made on the machine that runs the test (so its kernel, whichever the CPU
# has, decides both).
# LAUNCH (optional, a ;-list): what starts the split run, e.g. "mpiexec;-n;2;--oversubscribe":
# its ranks are then mpirun's processes, not threads.
if(NOT DEFINED TP)
  set(TP 1)
endif()
if(NOT DEFINED PP)
  set(PP 1)
endif()
foreach(run oracle split)
  set(launch "")
  if(run STREQUAL "oracle")
    set(ranks 1 1)
  else()
    set(ranks ${TP} ${PP})
    set(launch ${LAUNCH})
  endif()
  list(GET ranks 0 tp)
  list(GET ranks 1 pp)
  execute_process(COMMAND ${launch} ${CMD} --tp ${tp} --pp ${pp} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  message("${launch} --tp ${tp} --pp ${pp}:\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the --tp ${tp} --pp ${pp} run exited with ${rc}")
  endif()
  string(REGEX MATCHALL "\\[[0-9]+\\]  [0-9 ]+" tokens_${run} "${out}")
  if(NOT tokens_${run})
    message(FATAL_ERROR "the --tp ${tp} --pp ${pp} run printed no token lines")
  endif()
  if(NOT out MATCHES "tp ${tp}, pp ${pp}\n")
    message(FATAL_ERROR "the --tp ${tp} --pp ${pp} run does not report tp ${tp}, pp ${pp}")
  endif()
endforeach()
if(NOT tokens_oracle STREQUAL tokens_split)
  message(FATAL_ERROR "--tp ${TP} --pp ${PP} generated\n  ${tokens_split}\nbut --tp 1\n  ${tokens_oracle}")
endif()
