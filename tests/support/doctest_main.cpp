// The doctest main shared by loom's single-process tests (doctest itself: doctest_impl.cpp).
#include <doctest/doctest.h>

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
