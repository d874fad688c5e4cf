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
