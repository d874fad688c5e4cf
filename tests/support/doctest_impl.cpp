// doctest's implementation, compiled once for every test main (doctest_main.cpp, gpu_main.cpp,
// mpi_main.cpp): it is most of a main's compile time, and each main only adds its own main().
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
