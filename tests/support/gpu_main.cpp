// The doctest main of `gpu`-labelled tests: without a CUDA device it prints why and exits 77,
// which CTest reports as skipped (SKIP_RETURN_CODE), so CI without a GPU stays green and honest.
#define DOCTEST_CONFIG_IMPLEMENT
#include <loom/core/cuda/error.hpp>

#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (loom::cuda_device_count() == 0) {
    std::printf("no CUDA device: skipping GPU test\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
