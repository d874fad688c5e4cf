# loom-make-corpus's command-line tests (loom_example_tests: run in examples/data's scope).
# Bad values are refused naming the flag or the input line.
add_test(NAME make_corpus_cli_bad_number COMMAND loom-make-corpus ${CMAKE_CURRENT_BINARY_DIR}/cli_test --bytes 1e)
set_tests_properties(make_corpus_cli_bad_number PROPERTIES PASS_REGULAR_EXPRESSION "flag --bytes needs a number, got '1e'"
                                                           TIMEOUT 30)
set(_d ${CMAKE_CURRENT_BINARY_DIR}/tokenize_test)
file(MAKE_DIRECTORY ${_d})
file(WRITE ${_d}/bad_line.jsonl "{\"prompt\": \"a\", \"response\": \"b\"}\n{\"prompt\": oops}\n")
file(WRITE ${_d}/garbage.model "not a sentencepiece model")
add_test(NAME make_corpus_bad_jsonl_line COMMAND loom-make-corpus ${_d}/out --input ${_d}/bad_line.jsonl)
set_tests_properties(make_corpus_bad_jsonl_line PROPERTIES PASS_REGULAR_EXPRESSION "bad_line.jsonl:2" TIMEOUT 30)
add_test(NAME make_corpus_missing_input COMMAND loom-make-corpus ${_d}/out --input ${_d}/missing.txt)
set_tests_properties(make_corpus_missing_input PROPERTIES PASS_REGULAR_EXPRESSION "cannot open --input '[^']*missing.txt'" TIMEOUT 30)
add_test(NAME make_corpus_bad_template COMMAND loom-make-corpus ${_d}/out --input ${_d}/bad_line.jsonl --template gpt)
set_tests_properties(make_corpus_bad_template PROPERTIES PASS_REGULAR_EXPRESSION "chat template 'gpt' is not one of" TIMEOUT 30)
if(LOOM_HAS_SENTENCEPIECE)
  add_test(NAME make_corpus_garbage_model COMMAND loom-make-corpus ${_d}/out --input ${_d}/bad_line.jsonl --tokenizer ${_d}/garbage.model)
  set_tests_properties(make_corpus_garbage_model PROPERTIES PASS_REGULAR_EXPRESSION "garbage.model' is not a SentencePiece model" TIMEOUT 30)
endif()
if(LOOM_TOKENIZER_ORACLE AND LOOM_HAS_JSON)
  # End to end: the fixture's records through tokenizer.model + chatglm3 into shards, checked
  # against the Python transcription (tests/data/tokenizer_fixtures.py, check_corpus.py).
  set(_fx ${LOOM_TOKENIZER_FIXTURES_DIR})
  add_test(NAME make_corpus_chat_shard
           COMMAND sh -c "\"$1\" \"$2/chat3\" --input \"$2/records.jsonl\" --tokenizer \"$2/bpe.model\" --template chatglm3 --system \"$3\" --max-source 64 --max-target 64 && /usr/bin/python3 \"$4\" \"$2/chat3\" \"$2/chat_chatglm3.txt\" 64 64"
                   sh $<TARGET_FILE:loom-make-corpus> ${_fx} "You are a helpful assistant. 请用中文回答。" ${PROJECT_SOURCE_DIR}/tests/data/check_corpus.py)
  set_tests_properties(make_corpus_chat_shard PROPERTIES FIXTURES_REQUIRED tokenizer_fixtures TIMEOUT 60)
endif()
