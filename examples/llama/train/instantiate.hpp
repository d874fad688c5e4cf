#pragma once
// The run_rank instantiations llama_train_lib holds: LLAMA_TRAIN_RUN_RANK(P) names every
// communicator a run can take (one rank, thread ranks, MPI processes), so that train.cpp can
// declare them extern and train_rank.cpp define them.

#include "train.hpp"

#include <loom/comm/self_comm.hpp>
#include <loom/comm/thread_comm.hpp>
#include <loom/io/ds_config.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi_comm.hpp>
#endif

#include <ostream>

namespace llama_train {
template <class P, loom::comm::communicator C>
train_result run_rank(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log);
}  // namespace llama_train

#define LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, C) \
  EXTERN template llama_train::train_result llama_train::run_rank<P, C>(C&, const llama_train::options&, const loom::io::ds_config&, std::ostream*);
#ifdef LOOM_HAS_MPI
#define LLAMA_TRAIN_RUN_RANK(EXTERN, P)                      \
  LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, loom::comm::self_comm)   \
  LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, loom::comm::thread_comm) \
  LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, loom::comm::mpi_comm)
#else
#define LLAMA_TRAIN_RUN_RANK(EXTERN, P)                    \
  LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, loom::comm::self_comm) \
  LLAMA_TRAIN_RUN_RANK_ON(EXTERN, P, loom::comm::thread_comm)
#endif
