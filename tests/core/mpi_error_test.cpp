// LOOM_MPI_CHECK: a failing MPI call (with MPI_ERRORS_RETURN) throws loom::error carrying
// MPI's own error string.
#include <loom/core/mpi_error.hpp>

#include <doctest/doctest.h>
#include <mpi.h>

#include <string>

TEST_CASE("a failing MPI call throws loom::error with MPI's message") {
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int value = 1;
  const int rc = MPI_Bcast(&value, -1, MPI_INT, 0, MPI_COMM_WORLD);  // negative count
  REQUIRE(rc != MPI_SUCCESS);
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  try {
    LOOM_MPI_CHECK(MPI_Bcast(&value, -1, MPI_INT, 0, MPI_COMM_WORLD));
    FAIL("no throw");
  } catch (const loom::error& e) {
    const std::string m = e.what();
    CHECK(m.find("MPI_Bcast") != std::string::npos);
    CHECK(m.find(std::string(text, len)) != std::string::npos);
  }
  CHECK_NOTHROW(LOOM_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)));
}
