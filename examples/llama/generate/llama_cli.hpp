#pragma once
// Command-line options shared by llama-generate and llama-serve: where the model comes from
// (a checkpoint, or random weights to try the programs without files), its tokenizer, the
// KV pool / scheduler sizes, and the ranks (--tp tensor-parallel x --pp pipeline stages:
// thread ranks of this process, or the processes of mpirun) with the memory each may hold
// (--max-memory-per-rank), checked before loading.
//
// Each rank makes its engine from the checkpoint's files itself (checkpoint_reader: only the
// bytes of its slice are read), so that no process ever holds the whole model; random
// weights are made whole on every process and cut (they exist to try the programs).

#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <common/cli.hpp>
#include <common/mpi_launch.hpp>

#include <loom/comm/fail_fast.hpp>
#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi_comm.hpp>
#endif

#include <atomic>
#include <cctype>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>

namespace llama {

/// A byte count with an optional binary suffix: "1048576", "512K", "512M", "2G", "1T" (also
/// "512MB", "512MiB"); `flag` is named when `v` is not one.
inline std::size_t byte_size(const std::string& flag, const std::string& v) {
  std::size_t digits = 0;
  while (digits < v.size() && std::isdigit(static_cast<unsigned char>(v[digits]))) ++digits;
  std::string unit = v.substr(digits);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  int shift = -1;
  for (const auto& [names, s] : {std::pair{"|B", 0}, std::pair{"K|KB|KIB", 10}, std::pair{"M|MB|MIB", 20},
                                 std::pair{"G|GB|GIB", 30}, std::pair{"T|TB|TIB", 40}}) {
    const std::string list = std::string("|") + names + "|";
    if (list.find("|" + unit + "|") != std::string::npos) shift = s;
  }
  const bool ok = digits > 0 && digits <= 15 && shift >= 0;
  const std::size_t n = ok ? std::stoull(v.substr(0, digits)) : 0;
  if (!ok || n == 0 || n > (std::numeric_limits<std::size_t>::max() >> shift))
    throw examples::cli::bad_args("flag " + flag + " needs a positive number of bytes (e.g. 1048576, 512M, 2G), got '" + v + "'");
  return n << shift;
}

inline std::string mib(std::size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  return s;
}

struct model_args {
  std::string checkpoint, tokenizer;
  bool random = false;
  int tp = 1;                            ///< --tp: tensor-parallel ranks (threads; under mpirun, its processes)
  bool tp_given = false;
  int pp = 1;                            ///< --pp: pipeline stages (tp ranks each)
  std::size_t max_memory_per_rank = 0;  ///< --max-memory-per-rank; 0: no limit

  /// Consumes option `a` if it is one of ours (`next()` yields its value); false otherwise.
  bool parse(const std::string& a, const std::function<std::string()>& next, engine_config& ec) {
    if (a == "--checkpoint") checkpoint = next();
    else if (a == "--random") random = true;
    else if (a == "--tokenizer") tokenizer = next();
    else if (a == "--blocks") ec.num_blocks = examples::cli::number<int>(a, next());
    else if (a == "--block-size") ec.block_size = examples::cli::number<int>(a, next());
    else if (a == "--budget") ec.scheduler.max_num_batched_tokens = examples::cli::number<int>(a, next());
    else if (a == "--tp") tp = examples::cli::number<int>(a, next()), tp_given = true;
    else if (a == "--pp") pp = examples::cli::number<int>(a, next());
    else if (a == "--micro-batches") {
      ec.micro_batches = examples::cli::number<int>(a, next());
      LOOM_CHECK(ec.micro_batches >= 1, "flag --micro-batches must be >= 1, got ", ec.micro_batches);
    }
    else if (a == "--max-memory-per-rank") max_memory_per_rank = byte_size(a, next());
    else return false;
    return true;
  }
  void validate() const {
    LOOM_CHECK(random != !checkpoint.empty(), "give exactly one of --checkpoint PATH and --random");
    LOOM_CHECK(tp >= 1 && tp <= 1024, "flag --tp must be in [1, 1024], got ", tp);
    LOOM_CHECK(pp >= 1 && pp <= 1024, "flag --pp must be in [1, 1024], got ", pp);
    LOOM_CHECK(tp * pp <= 1024, "flags --tp ", tp, " --pp ", pp, " make ", tp * pp, " ranks, more than 1024");
  }
  /// "--tp N", and " --pp P" when there are pipeline stages.
  std::string ranks() const { return "--tp " + std::to_string(tp) + (pp > 1 ? " --pp " + std::to_string(pp) : ""); }
  /// Under mpirun with more than one process the mesh is its world: tp x pp must equal the
  /// world's size; --tp defaults to the world's size / pp (a loom::error names the flags and
  /// the world when they do not fit). Call before plan_memory.
  void use_mpi_world() {
    const int world = examples::mpi_launch_size();
    if (world <= 1) return;
    LOOM_CHECK(pp >= 1 && world % pp == 0, "flag --pp ", pp, " but mpirun started ", world,
               " processes: under mpirun the ranks are the MPI world, so --pp must divide it");
    LOOM_CHECK(!tp_given || tp * pp == world, "flag --tp ", tp, (pp > 1 ? " --pp " + std::to_string(pp) : std::string()),
               " but mpirun started ", world, " processes: under mpirun the ranks are the MPI world (give --tp ", world / pp,
               " or mpirun -np ", tp * pp, ")");
#ifndef LOOM_HAS_MPI
    LOOM_THROW("started by mpirun with ", world, " processes, but this build has no MPI communicator (LOOM_ENABLE_MPI)");
#endif
    tp = world / pp;
  }
  /// The slice of rank comm's model: read from the checkpoint's files (only its bytes), or
  /// cut from `random` (the whole random model, made by the caller with load()).
  /// `reader` holds the open checkpoint while the engine is made.
  slice_source slice(std::optional<checkpoint_reader>& reader, const flat_weights* random) const {
    if (random) return slice_from(*random);
    reader.emplace(checkpoint);
    return slice_from(*reader);
  }
  /// The model's config before any tensor is read: `random_config`, or the checkpoint's
  /// (checkpoint_config: config.json and the shards' headers, or a llama2.c header).
  config config_before_loading(const config& random_config) const {
    return random ? random_config : checkpoint_config(checkpoint);
  }
  /// The checkpoint's weights, or random weights of `random_config`.
  flat_weights load(const config& random_config) const {
    return random ? flat_weights::random(random_config, 1) : load_checkpoint(checkpoint);
  }
  /// Prints what each of the --tp x --pp ranks will hold (weights, KV pool, workspace: the
  /// stage that needs the most) and, with --max-memory-per-rank, the smallest tp that fits it
  /// at that pp; refuses (loom::error with the figures) a model that does not fit, or a split
  /// --tp or --pp cannot make (naming the flag).
  template <class Engine>
  rank_memory plan_memory(const char* program, const config& c, const engine_config& ec) const {
    const auto plan = [&](const std::string& flag, int n, int stages) {
      try {
        return Engine::memory_plan(c, ec, tp, stages);
      } catch (const loom::error& e) {
        throw loom::error("flag " + flag + " " + std::to_string(n) + " cannot split this model: " + e.what());
      }
    };
    plan("--tp", tp, 1);
    const rank_memory m = plan("--pp", pp, pp);
    std::printf("%s: memory per rank at %s: weights %zu + KV pool %zu + workspace %zu = %zu bytes (%s)\n", program,
                ranks().c_str(), m.weights, m.kv, m.workspace, m.total(), mib(m.total()).c_str());
    if (max_memory_per_rank == 0) return m;
    const int fits = Engine::smallest_tp(c, ec, max_memory_per_rank, pp);
    const std::string smallest = fits ? "the smallest tp that fits is " + std::to_string(fits)
                                      : "no tp up to n_heads=" + std::to_string(c.n_heads) + " fits";
    std::printf("%s: --max-memory-per-rank %zu bytes (%s): %s\n", program, max_memory_per_rank, mib(max_memory_per_rank).c_str(),
                smallest.c_str());
    std::fflush(stdout);
    LOOM_CHECK(m.total() <= max_memory_per_rank, "the model does not fit --max-memory-per-rank ", max_memory_per_rank,
               " bytes at ", ranks(), ": each rank needs ", m.total(), " bytes (weights ", m.weights, " + KV pool ", m.kv,
               " + workspace ", m.workspace, "); ", smallest);
    return m;
  }
};

/// Runs fn(comm, peer_failed) on `tp` thread ranks of this process (rank 0 on the calling
/// thread). An exception on any rank ends every rank (thread_comm aborts the others'
/// collectives) and comes back from here as a loom::error naming the rank; `peer_failed`
/// turns true then, for a rank that waits outside any collective (a server waiting for a
/// signal) to notice.
template <class F>
void run_tensor_ranks(int tp, F&& fn) {
  std::atomic<bool> failed{false};
  loom::comm::run_ranks(tp, [&](loom::comm::thread_comm& comm) {
    try {
      fn(comm, static_cast<const std::atomic<bool>&>(failed));
    } catch (const std::exception& e) {
      failed = true;
      throw loom::error("rank " + std::to_string(comm.rank()) + " of " + std::to_string(tp) + ": " + e.what());
    }
  });
}

/// Runs fn(comm, peer_failed) on the ranks of `model` (use_mpi_world() first; fn builds its
/// (1, tp, pp) mesh over comm, a loom::comm::any_comm): the MPI world when started by mpirun
/// with more than one process, else model.tp x model.pp thread ranks (run_tensor_ranks). The
/// backend is erased so that fn, and the engine (and server) it makes, is compiled once for
/// both. A process whose fn throws prints "<program>: error: rank r of N: <what>" and ends the
/// job (MPI_Abort: the others do not hang in a collective or in MPI_Finalize).
template <class F>
void run_tensor_group(const char* program, const model_args& model, F&& fn) {
#ifdef LOOM_HAS_MPI
  if (examples::mpi_launch_size() > 1) {
    examples::mpi_session mpi;
    std::atomic<bool> failed{false};  // a peer's failure aborts this process too
    try {
      loom::comm::mpi_comm world = loom::comm::mpi_comm::world();
      loom::comm::any_comm comm(std::ref(world));
      try {
        fn(comm, static_cast<const std::atomic<bool>&>(failed));
      } catch (const std::exception& e) {
        throw loom::error("rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + ": " + e.what());
      }
    } catch (const std::exception& e) {
      loom::comm::fail(program, e.what());
      throw;
    }
    return;
  }
#else
  (void)program;
#endif
  run_tensor_ranks(model.tp * model.pp, [&](loom::comm::thread_comm& ranks, const std::atomic<bool>& failed) {
    loom::comm::any_comm comm(std::ref(ranks));
    fn(comm, failed);
  });
}

}  // namespace llama
