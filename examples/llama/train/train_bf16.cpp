// llama_train_lib: run_rank with parameters stored as loom::bfloat16 (instantiate.hpp).
#include "instantiate.hpp"
#include "run_rank.hpp"

LLAMA_TRAIN_RUN_RANK(, loom::bfloat16)
