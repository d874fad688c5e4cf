// layers_test.cu, the GPU test, compiled by g++ and run on the CPU through the emulated
// runtime (tests/ops/cuda/emulation.hpp): the layers' CUDA path as the GPU runs it.
#include "ops/cuda/emulation.hpp"

#include "layers_test.cu"
