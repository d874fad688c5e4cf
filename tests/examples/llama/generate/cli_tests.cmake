# llama-generate's command-line tests (loom_example_tests: run in examples/llama/generate's scope).
# Bad command lines name the flag and the value (examples/common/cli.hpp), never a bare std::stoi error.
add_test(NAME llama_generate_cli_bad_number COMMAND llama-generate --random --max-new abc)
add_test(NAME llama_generate_cli_unknown COMMAND llama-generate --random --frobnicate)
add_test(NAME llama_generate_cli_missing_value COMMAND llama-generate --random --blocks)
set_tests_properties(llama_generate_cli_bad_number PROPERTIES PASS_REGULAR_EXPRESSION "flag --max-new needs a number, got 'abc'" TIMEOUT 30)
set_tests_properties(llama_generate_cli_unknown PROPERTIES PASS_REGULAR_EXPRESSION "unknown argument '--frobnicate'" TIMEOUT 30)
set_tests_properties(llama_generate_cli_missing_value PROPERTIES PASS_REGULAR_EXPRESSION "flag --blocks needs a value" TIMEOUT 30)
if(LOOM_TOKENIZER_ORACLE)  # a SentencePiece tokenizer.model made by the tests/data fixture
  add_test(NAME llama_generate_sentencepiece
           COMMAND llama-generate --random --tokenizer ${LOOM_TOKENIZER_FIXTURES_DIR}/tiny.model --prompt "the quick fox" --max-new 8)
  set_tests_properties(llama_generate_sentencepiece PROPERTIES PASS_REGULAR_EXPRESSION "\\[0\\] the quick fox.*1 prompts, [0-9]+ tokens generated"
                                                               FIXTURES_REQUIRED tokenizer_fixtures TIMEOUT 30)
  add_test(NAME llama_generate_tokenizer_too_large
           COMMAND llama-generate --random --tokenizer ${LOOM_TOKENIZER_FIXTURES_DIR}/bpe.model --prompt "x")
  set_tests_properties(llama_generate_tokenizer_too_large PROPERTIES
                       PASS_REGULAR_EXPRESSION "bpe.model': vocab_size=1400 is larger than the model's vocab_size=256"
                       FIXTURES_REQUIRED tokenizer_fixtures TIMEOUT 30)
endif()
# --tp: thread ranks of this process. The greedy tokens at tp 2 and 4 are the tp 1 run's, made
# in the same test (same_tokens.cmake; llama_tp_engine_test checks the engine itself against
# one rank).
foreach(_tp 2 4)
  add_test(NAME llama_generate_cli_tp${_tp}
           COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;--random;--prompt;1 2 3;--max-new;8;--temperature;0"
                   -DTP=${_tp} -P ${PROJECT_SOURCE_DIR}/tests/examples/llama/generate/same_tokens.cmake)
  set_tests_properties(llama_generate_cli_tp${_tp} PROPERTIES TIMEOUT 60)
endforeach()
# --pp: the layers over pipeline stages of --tp ranks each; with several prompts (so that a
# step's sequences make micro-batches), at pp 2, tp 2 x pp 2, and pp 2 in three micro-batches,
# the tokens are the tp 1 run's (same_tokens.cmake; llama_tp_engine_test checks the engine).
set(_prompts "--random;--prompt;1 2 3;--prompt;4 5 6 7 8 9;--prompt;10;--max-new;8;--temperature;0")
foreach(_run "pp2;1;2" "tp2_pp2;2;2" "pp2_mb3;1;2;--micro-batches;3")
  list(POP_FRONT _run _name _tp _pp)
  add_test(NAME llama_generate_cli_${_name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;${_prompts};${_run}"
                   -DTP=${_tp} -DPP=${_pp} -P ${PROJECT_SOURCE_DIR}/tests/examples/llama/generate/same_tokens.cmake)
  set_tests_properties(llama_generate_cli_${_name} PROPERTIES TIMEOUT 60)
endforeach()
# The same under mpirun: the ranks are its processes (np 2 and 4), each reading only its slice
# of the checkpoint's files; the oracle is the --tp 1 run of the same test. np 2 (tp 2) on the
# llama2.c and HF checkpoints of the tests/io/weights fixture (their 2 key/value heads split at
# most 2 ways) and on the random model; np 4 on an HF LLaMA folder (tp 4), an HF ChatGLM folder
# and the random model (tp 2 x pp 2). --tp x --pp other than the world's size is refused
# naming both; a rank that fails ends the job with its rank and error, never a hang.
if(LOOM_HAS_MPI)
  set(_mpi ${MPIEXEC_EXECUTABLE} ${LOOM_MPIEXEC_FLAGS} ${MPIEXEC_NUMPROC_FLAG})
  set(_same ${PROJECT_SOURCE_DIR}/tests/examples/llama/generate/same_tokens.cmake)
  foreach(_run "2;2;1" "4;2;2")
    list(POP_FRONT _run _np _tp _pp)
    add_test(NAME llama_generate_mpi_np${_np}_random
             COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;--random;--prompt;1 2 3;--prompt;9 8;--max-new;8;--temperature;0"
                     -DTP=${_tp} -DPP=${_pp} "-DLAUNCH=${_mpi};${_np}" -P ${_same})
    set_tests_properties(llama_generate_mpi_np${_np}_random PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2
                         ENVIRONMENT OPENBLAS_NUM_THREADS=1)
  endforeach()
  if(LOOM_HAS_TORCH)  # the fixture's writer is numpy + PyTorch
    set(_ckpt ${CMAKE_CURRENT_BINARY_DIR}/mpi_checkpoints)
    add_test(NAME llama_generate_mpi_checkpoints COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/io/weights/make_checkpoints.py ${_ckpt})
    set_tests_properties(llama_generate_mpi_checkpoints PROPERTIES FIXTURES_SETUP llama_generate_ckpt TIMEOUT 60)
    foreach(_file a_v1.bin hf)
      add_test(NAME llama_generate_mpi_np2_${_file}
               COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;--checkpoint;${_ckpt}/${_file};--prompt;1 5 7;--prompt;4;--max-new;8;--temperature;0"
                       -DTP=2 "-DLAUNCH=${_mpi};2" -P ${_same})
      set_tests_properties(llama_generate_mpi_np2_${_file} PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2 FIXTURES_REQUIRED llama_generate_ckpt
                           ENVIRONMENT OPENBLAS_NUM_THREADS=1)
    endforeach()
  endif()
  # np 4 on files: HF LLaMA and ChatGLM folders of 4 key/value heads, written by llama-train's
  # --export-hf after one step (the weights need not be good, only the same for every run).
  # seq 64: the ChatGLM folder also serves the 32-sequence workload below.
  if(LOOM_HAS_JSON)  # llama-train is built
    foreach(_arch llama chatglm)
      set(_hf ${CMAKE_CURRENT_BINARY_DIR}/mpi_hf_${_arch})
      if(_arch STREQUAL "llama")
        set(_ranks -DTP=4)
      else()
        set(_ranks -DTP=2 -DPP=2)
      endif()
      add_test(NAME llama_generate_mpi_hf_${_arch}
               COMMAND $<TARGET_FILE:llama-train> --arch ${_arch} --dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 4 --hidden-dim 128
                       --vocab 256 --seq 64 --batch 2 --micro-batches 1 --steps 1 --data counting --save ${_hf}-ckpt --export-hf ${_hf})
      set_tests_properties(llama_generate_mpi_hf_${_arch} PROPERTIES FIXTURES_SETUP llama_generate_hf_${_arch} TIMEOUT 60
                           ENVIRONMENT OPENBLAS_NUM_THREADS=1)
      add_test(NAME llama_generate_mpi_np4_${_arch}
               COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;--checkpoint;${_hf};--prompt;1 5 7;--prompt;9 9;--max-new;8;--temperature;0"
                       ${_ranks} "-DLAUNCH=${_mpi};4" -P ${_same})
      set_tests_properties(llama_generate_mpi_np4_${_arch} PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2
                           FIXTURES_REQUIRED llama_generate_hf_${_arch} ENVIRONMENT OPENBLAS_NUM_THREADS=1)
    endforeach()
  endif()
  # The engine test's workload under mpirun -np 4 at tp 2 x pp 2: 32 sequences sharing four
  # 20-token prefixes (prefix-cache hits), chunked prefill (--budget 48) and a pool too small
  # for them all (40 blocks of 4: the run must preempt), against --tp 1 --pp 1 on one process.
  set(_p32 ${CMAKE_CURRENT_BINARY_DIR}/prompts32.txt)
  set(_lines "")
  foreach(_i RANGE 31)
    math(EXPR _s "${_i} % 4")
    math(EXPR _n "1 + ${_i} % 7")
    set(_line "")
    foreach(_k RANGE 19)
      math(EXPR _t "2 + (${_s} * 53 + ${_k} * 11) % 240")
      string(APPEND _line "${_t} ")
    endforeach()
    foreach(_k RANGE 1 ${_n})
      math(EXPR _t "2 + (${_i} * 31 + ${_k} * 7) % 240")
      string(APPEND _line "${_t} ")
    endforeach()
    string(APPEND _lines "${_line}\n")
  endforeach()
  file(WRITE ${_p32} "${_lines}")
  # The same workload on the ChatGLM folder (its fused query_key_value split over tp 2, its
  # layers over 2 pipeline stages, each process reading only its slice of the files); both
  # models at tp 2 x pp 2 on 4 processes and at tp 2 and at pp 2 alone on 2.
  set(_w32 "--prompt-file;${_p32};--max-new;24;--temperature;0;--blocks;40;--block-size;4;--budget;48")
  set(_models llama)
  if(LOOM_HAS_JSON)  # llama-train wrote the folder
    list(APPEND _models chatglm)
  endif()
  foreach(_model ${_models})
    if(_model STREQUAL "chatglm")
      set(_source "--checkpoint;${CMAKE_CURRENT_BINARY_DIR}/mpi_hf_chatglm")
      set(_np4 np4_chatglm_32seq)
    else()
      set(_source "--random")
      set(_np4 np4_32seq)
    endif()
    # name|processes|tp|pp
    foreach(_run "${_np4}|4|2|2" "np2_32seq_${_model}_tp2|2|2|1" "np2_32seq_${_model}_pp2|2|1|2")
      string(REPLACE "|" ";" _run "${_run}")
      list(GET _run 0 _name)
      list(GET _run 1 _np)
      list(GET _run 2 _tp)
      list(GET _run 3 _pp)
      add_test(NAME llama_generate_mpi_${_name}
               COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;${_source};${_w32}" -DTP=${_tp} -DPP=${_pp}
                       "-DLAUNCH=${_mpi};${_np}" -P ${_same})
      set_tests_properties(llama_generate_mpi_${_name} PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2 ENVIRONMENT OPENBLAS_NUM_THREADS=1
                           FAIL_REGULAR_EXPRESSION "; 0 preemptions")
      if(_model STREQUAL "chatglm")
        set_tests_properties(llama_generate_mpi_${_name} PROPERTIES FIXTURES_REQUIRED llama_generate_hf_chatglm)
      endif()
    endforeach()
  endforeach()
  # A checkpoint larger than the memory limit per rank: refused on one rank with the figures and
  # the smallest tp that fits; the same files and limit on 4 processes generate.
  if(LOOM_HAS_JSON)
    add_test(NAME llama_generate_cli_memory_checkpoint_refused
             COMMAND llama-generate --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/mpi_hf_llama --tp 1 --max-memory-per-rank 2M)
    set_tests_properties(llama_generate_cli_memory_checkpoint_refused PROPERTIES TIMEOUT 60 FIXTURES_REQUIRED llama_generate_hf_llama
                         PASS_REGULAR_EXPRESSION "does not fit --max-memory-per-rank 2097152 bytes at --tp 1: each rank needs [0-9]+ bytes \\(weights [0-9]+ \\+ KV pool [0-9]+ \\+ workspace [0-9]+\\); the smallest tp that fits is 4")
    add_test(NAME llama_generate_mpi_np4_memory_checkpoint
             COMMAND ${_mpi} 4 $<TARGET_FILE:llama-generate> --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/mpi_hf_llama --max-memory-per-rank 2M
                     --prompt "1 5 7" --max-new 4 --temperature 0)
    set_tests_properties(llama_generate_mpi_np4_memory_checkpoint PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2 FIXTURES_REQUIRED llama_generate_hf_llama
                         ENVIRONMENT OPENBLAS_NUM_THREADS=1 PASS_REGULAR_EXPRESSION "rank 0 of 4 holds weights [0-9]+ .*tokens generated")
  endif()
  # Launched from a DeepSpeed-format hostfile as llama-train is: 4 slots on localhost, no --oversubscribe.
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/hostfile.slots4 "localhost slots=4\n")
  set(_hostfile_flags ${LOOM_MPIEXEC_FLAGS})
  list(REMOVE_ITEM _hostfile_flags --oversubscribe)
  add_test(NAME llama_generate_mpi_hostfile4
           COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-generate>;--random;--prompt;5 6 7;--max-new;6;--temperature;0" -DTP=4
                   "-DLAUNCH=${MPIEXEC_EXECUTABLE};${_hostfile_flags};--hostfile;${CMAKE_CURRENT_BINARY_DIR}/hostfile.slots4;-np;4" -P ${_same})
  set_tests_properties(llama_generate_mpi_hostfile4 PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2 ENVIRONMENT OPENBLAS_NUM_THREADS=1)
  add_test(NAME llama_generate_mpi_tp_mismatch COMMAND ${_mpi} 2 $<TARGET_FILE:llama-generate> --random --tp 4)
  set_tests_properties(llama_generate_mpi_tp_mismatch PROPERTIES TIMEOUT 60 LABELS mpi PROCESSORS 2 PASS_REGULAR_EXPRESSION
                       "flag --tp 4 but mpirun started 2 processes")
  add_test(NAME llama_generate_mpi_fault
           COMMAND bash ${PROJECT_SOURCE_DIR}/tests/comm/fault_run.sh 45 "llama-generate: error: rank 1 of 2: injected fault" --
                   ${_mpi} 2 $<TARGET_FILE:llama-generate> --random --max-new 4)
  set_tests_properties(llama_generate_mpi_fault PROPERTIES TIMEOUT 60 LABELS "mpi;fault" PROCESSORS 2
                       ENVIRONMENT "LOOM_FAULT_INJECT=1:0:throw;LOOM_COMM_TIMEOUT=5;OPENBLAS_NUM_THREADS=1")
endif()
# Bad --tp values are named: zero, not a number, one that does not divide the heads (4).
add_test(NAME llama_generate_cli_tp_zero COMMAND llama-generate --random --tp 0)
set_tests_properties(llama_generate_cli_tp_zero PROPERTIES PASS_REGULAR_EXPRESSION "flag --tp must be in \\[1, 1024\\], got 0" TIMEOUT 30)
add_test(NAME llama_generate_cli_tp_word COMMAND llama-generate --random --tp two)
set_tests_properties(llama_generate_cli_tp_word PROPERTIES PASS_REGULAR_EXPRESSION "flag --tp needs a number, got 'two'" TIMEOUT 30)
add_test(NAME llama_generate_cli_tp_split COMMAND llama-generate --random --tp 3)
set_tests_properties(llama_generate_cli_tp_split PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --tp 3 cannot split this model: .*n_heads \\(4\\) must be divisible by tp \\(3\\)" TIMEOUT 30)
# Bad --pp values are named: zero, more stages than the model's layers (2), more ranks than the limit.
add_test(NAME llama_generate_cli_pp_zero COMMAND llama-generate --random --pp 0)
set_tests_properties(llama_generate_cli_pp_zero PROPERTIES PASS_REGULAR_EXPRESSION "flag --pp must be in \\[1, 1024\\], got 0" TIMEOUT 30)
add_test(NAME llama_generate_cli_pp_split COMMAND llama-generate --random --pp 3)
set_tests_properties(llama_generate_cli_pp_split PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --pp 3 cannot split this model: .*n_layers \\(2\\) must be >= pp \\(3\\)" TIMEOUT 30)
add_test(NAME llama_generate_cli_pp_ranks COMMAND llama-generate --random --tp 64 --pp 32)
set_tests_properties(llama_generate_cli_pp_ranks PROPERTIES
                     PASS_REGULAR_EXPRESSION "flags --tp 64 --pp 32 make 2048 ranks, more than 1024" TIMEOUT 30)
# --max-memory-per-rank: the random model needs about 6 MiB per rank at tp 1 and under 2 MiB at
# tp 4 (printed at start-up); with 2M it is refused before loading at tp 1, naming the figures
# and the smallest tp that fits, and runs at tp 4. A bad size is named.
add_test(NAME llama_generate_cli_memory_refused COMMAND llama-generate --random --tp 1 --max-memory-per-rank 2M)
set_tests_properties(llama_generate_cli_memory_refused PROPERTIES
                     PASS_REGULAR_EXPRESSION "does not fit --max-memory-per-rank 2097152 bytes at --tp 1: each rank needs [0-9]+ bytes \\(weights [0-9]+ \\+ KV pool [0-9]+ \\+ workspace [0-9]+\\); the smallest tp that fits is 4"
                     FAIL_REGULAR_EXPRESSION "generated" TIMEOUT 30)
add_test(NAME llama_generate_cli_memory_fits COMMAND llama-generate --random --tp 4 --max-memory-per-rank 2M --max-new 4)
set_tests_properties(llama_generate_cli_memory_fits PROPERTIES
                     PASS_REGULAR_EXPRESSION "the smallest tp that fits is 4.*1 prompts, 4 tokens generated" TIMEOUT 30)
# Pipeline stages halve what each rank holds of this two-layer model: 4M is refused at --tp 1
# alone and fits at --pp 2 (the plan printed is the larger stage's).
add_test(NAME llama_generate_cli_memory_pp COMMAND llama-generate --random --pp 2 --max-memory-per-rank 4M --max-new 4)
set_tests_properties(llama_generate_cli_memory_pp PROPERTIES
                     PASS_REGULAR_EXPRESSION "memory per rank at --tp 1 --pp 2: .*the smallest tp that fits is 1.*1 prompts, 4 tokens generated" TIMEOUT 30)
add_test(NAME llama_generate_cli_memory_pp1 COMMAND llama-generate --random --max-memory-per-rank 4M)
set_tests_properties(llama_generate_cli_memory_pp1 PROPERTIES
                     PASS_REGULAR_EXPRESSION "does not fit --max-memory-per-rank 4194304 bytes at --tp 1: "
                     FAIL_REGULAR_EXPRESSION "generated" TIMEOUT 30)
add_test(NAME llama_generate_cli_memory_bad COMMAND llama-generate --random --max-memory-per-rank 12Q)
set_tests_properties(llama_generate_cli_memory_bad PROPERTIES
                     PASS_REGULAR_EXPRESSION "flag --max-memory-per-rank needs a positive number of bytes \\(e.g. 1048576, 512M, 2G\\), got '12Q'"
                     TIMEOUT 30)
