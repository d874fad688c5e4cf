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
