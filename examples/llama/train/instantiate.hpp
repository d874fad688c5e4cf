#pragma once
// The run_rank instantiations llama_train_lib holds: LLAMA_TRAIN_RUN_RANK(P) is parameter type
// P's run over any_comm, the one communicator type a run takes on every backend (one rank,
// thread ranks, MPI processes), so that train.cpp can declare them extern and train_rank.cpp
// define them.

#include "train.hpp"

#include <loom/comm/any_comm.hpp>
#include <loom/io/ds_config.hpp>

#include <ostream>

namespace llama_train {
template <class P, loom::comm::communicator C>
train_result run_rank(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log);
}  // namespace llama_train

#define LLAMA_TRAIN_RUN_RANK(EXTERN, P)                                                                           \
  EXTERN template llama_train::train_result llama_train::run_rank<P, loom::comm::any_comm>(loom::comm::any_comm&,  \
                                                                                           const llama_train::options&, \
                                                                                           const loom::io::ds_config&,  \
                                                                                           std::ostream*);
