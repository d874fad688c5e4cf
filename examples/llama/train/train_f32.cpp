// llama_train_lib: run_rank with parameters stored as float (instantiate.hpp).
#include "instantiate.hpp"
#include "run_rank.hpp"

LLAMA_TRAIN_RUN_RANK(, float)
