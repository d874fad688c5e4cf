// kernels_test.cu, the GPU test, compiled by g++ and run on the CPU: its kernels on fibers
// (emulation.hpp), its launches, copies, allocations and cuBLAS calls through the emulated
// runtime (emulated_runtime/: the launch and copy checks a GPU makes, plus a pointer check a
// GPU makes only by crashing). What this shows that the kernel-level emulated tests do not: the
// launch code the GPU runs (grids, workspaces, argument order), the test itself (so the first
// GPU run fails only for what a GPU does differently), and loom's cuBLAS operand layout.
#include "emulation.hpp"

#include "kernels_test.cu"
