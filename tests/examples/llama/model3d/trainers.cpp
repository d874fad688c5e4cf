// The tests' double-precision trainer over any_comm, compiled once for the trainer test group
// (thread ranks) and test_train3d_mpi (MPI processes); train3d_suite.hpp declares it extern.
#include <llama/train3d/train3d.hpp>

#include <loom/comm/any_comm.hpp>

template class llama3d::trainer<double, double, loom::comm::any_comm>;
