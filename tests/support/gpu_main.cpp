// The doctest main of `gpu`-labelled tests: without a CUDA device it prints why and exits 77,
// which CTest reports as skipped (SKIP_RETURN_CODE), so CI without a GPU stays green and honest.
#include <loom/core/cuda/error.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (loom::cuda_device_count() == 0) {
    const char* slash = argc > 0 ? std::strrchr(argv[0], '/') : nullptr;
    std::printf("%s: no CUDA device, skipping this GPU test\n", slash ? slash + 1 : argc > 0 ? argv[0] : "gpu test");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
