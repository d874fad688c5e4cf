// llama_train_lib: run_rank with parameters stored as loom::half (instantiate.hpp).
#include "instantiate.hpp"
#include "run_rank.hpp"

LLAMA_TRAIN_RUN_RANK(, loom::half)
