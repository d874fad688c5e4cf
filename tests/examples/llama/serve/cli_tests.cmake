# llama-serve's command-line tests (loom_example_tests: run in examples/llama/serve's scope):
# a bad port is refused naming the flag and value, before anything listens.
add_test(NAME llama_serve_cli_bad_port COMMAND llama-serve --random --port eighty)
set_tests_properties(llama_serve_cli_bad_port PROPERTIES PASS_REGULAR_EXPRESSION "flag --port needs a number, got 'eighty'"
                                                         TIMEOUT 30)
add_test(NAME llama_serve_cli_port_range COMMAND llama-serve --random --port 70000)
set_tests_properties(llama_serve_cli_port_range PROPERTIES PASS_REGULAR_EXPRESSION "flag --port must be in \\[1, 65535\\], got 70000"
                                                           TIMEOUT 30)
# a chat template that does not exist, or one the byte codec cannot carry, is named
add_test(NAME llama_serve_cli_bad_template COMMAND llama-serve --random --template gpt4)
set_tests_properties(llama_serve_cli_bad_template PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --template: 'gpt4' is not one of chatglm2, chatglm3, llama2, none" TIMEOUT 30)
add_test(NAME llama_serve_cli_template_needs_tokenizer COMMAND llama-serve --random --template chatglm3 --port 1)
set_tests_properties(llama_serve_cli_template_needs_tokenizer PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --template chatglm3 needs --tokenizer" TIMEOUT 30)
add_test(NAME llama_serve_cli_template_lacks_specials COMMAND llama-serve --random --tokenizer bytes --template chatglm3 --port 1)
set_tests_properties(llama_serve_cli_template_lacks_specials PROPERTIES
                     PASS_REGULAR_EXPRESSION "chat template chatglm3 needs the special token \\[gMASK\\], which tokenizer 'bytes' lacks"
                     TIMEOUT 30)
# --lora: a value that is not NAME=DIR, and a folder that is not there, are named before anything listens
add_test(NAME llama_serve_cli_lora_bad_value COMMAND llama-serve --random --lora =dir --port 1)
set_tests_properties(llama_serve_cli_lora_bad_value PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --lora: '=dir' is not NAME=DIR or DIR" TIMEOUT 30)
add_test(NAME llama_serve_cli_lora_missing COMMAND llama-serve --random --lora sql=/nonexistent/sql-lora --port 1)
set_tests_properties(llama_serve_cli_lora_missing PROPERTIES
                     PASS_REGULAR_EXPRESSION "cannot open file '/nonexistent/sql-lora/adapter_config.json'" TIMEOUT 30)
# --tp and --max-memory-per-rank (the same flags as llama-generate's): a split --tp cannot make
# is named; a model over the per-rank limit is refused before loading with its figures and
# the smallest tp that fits; adapters need --tp 1.
add_test(NAME llama_serve_cli_tp_split COMMAND llama-serve --random --tp 3 --port 1)
set_tests_properties(llama_serve_cli_tp_split PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --tp 3 cannot split this model: .*n_heads \\(4\\) must be divisible by tp \\(3\\)" TIMEOUT 30)
add_test(NAME llama_serve_cli_memory_refused COMMAND llama-serve --random --tp 1 --max-memory-per-rank 1M --port 1)
set_tests_properties(llama_serve_cli_memory_refused PROPERTIES
                     PASS_REGULAR_EXPRESSION "does not fit --max-memory-per-rank 1048576 bytes at --tp 1: each rank needs [0-9]+ bytes \\(weights [0-9]+ \\+ KV pool [0-9]+ \\+ workspace [0-9]+\\); no tp up to n_heads=4 fits"
                     FAIL_REGULAR_EXPRESSION "listening" TIMEOUT 30)
add_test(NAME llama_serve_cli_lora_tp COMMAND llama-serve --random --tp 2 --lora sql=/nonexistent/sql-lora --port 1)
set_tests_properties(llama_serve_cli_lora_tp PROPERTIES PASS_REGULAR_EXPRESSION "flag --lora needs --tp 1 .*got --tp 2" TIMEOUT 30)
# --pp: more stages than the model's layers (2) is named; adapters need --tp 1 --pp 1.
add_test(NAME llama_serve_cli_pp_split COMMAND llama-serve --random --pp 3 --port 1)
set_tests_properties(llama_serve_cli_pp_split PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --pp 3 cannot split this model: .*n_layers \\(2\\) must be >= pp \\(3\\)" TIMEOUT 30)
add_test(NAME llama_serve_cli_lora_pp COMMAND llama-serve --random --pp 2 --lora sql=/nonexistent/sql-lora --port 1)
set_tests_properties(llama_serve_cli_lora_pp PROPERTIES PASS_REGULAR_EXPRESSION "flag --lora needs --tp 1 --pp 1 .*got --tp 1 --pp 2" TIMEOUT 30)
# Under mpirun (np 2: tp 2; np 4: tp 2 x pp 2) the server runs on process 0 and the others
# follow: greedy answers equal a --tp 1 --pp 1 server's (started by the same test), and SIGTERM
# ends every process.
if(LOOM_HAS_MPI)
  foreach(_run "2;1" "4;2")
    list(POP_FRONT _run _np _pp)
    add_test(NAME llama_serve_mpi_np${_np}
             COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/examples/llama/serve/same_answers.py ${MPIEXEC_EXECUTABLE}
                     ${LOOM_MPIEXEC_FLAGS} ${MPIEXEC_NUMPROC_FLAG} ${_np} -- $<TARGET_FILE:llama-serve> --random --pp ${_pp})
    set_tests_properties(llama_serve_mpi_np${_np} PROPERTIES TIMEOUT 90 LABELS mpi PROCESSORS 2 ENVIRONMENT OPENBLAS_NUM_THREADS=1)
  endforeach()
endif()
