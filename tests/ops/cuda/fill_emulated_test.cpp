// fill_test.cu, a GPU test, compiled by g++ and run on the CPU through the emulated runtime
// (as kernels_emulated_test.cpp does for kernels_test.cu).
#include "emulation.hpp"

#include "fill_test.cu"
