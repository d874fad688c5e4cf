// llama_train_lib: run_rank for every parameter type and communicator (instantiate.hpp), and
// the trainers it runs (train3d.hpp's LLAMA3D_TRAINERS), which every unit linking the library
// then uses instead of instantiating its own. One translation unit for the three parameter
// types: what does not depend on the type (parsing the headers, the data, JSON and checkpoint
// I/O, the export) is compiled once, not thrice.
#include "instantiate.hpp"
#include "run_rank.hpp"

LLAMA3D_TRAINERS()
LLAMA_TRAIN_RUN_RANK(, float)
LLAMA_TRAIN_RUN_RANK(, loom::bfloat16)
LLAMA_TRAIN_RUN_RANK(, loom::half)
