#pragma once
// mpi_comm: ranks are MPI processes (one host or many, `mpirun --hostfile`).
//
// Why it is written this way:
// - Boost.MPI owns the communicator (duplicate on construction, MPI_Comm_free when the last
//   copy goes), so a loom communicator never shares message matching with the user's
//   MPI_COMM_WORLD traffic. The data path calls MPI directly: Boost.MPI serialises
//   non-builtin types, and has no MPI_Reduce_scatter_block, no MPI_IN_PLACE for every
//   collective and no non-blocking collectives; loom needs all of them with zero copies.
// - The communicator uses MPI_ERRORS_RETURN and every call goes through LOOM_MPI_CHECK, so
//   an MPI failure becomes loom::error instead of aborting the job.
// - Async forms are MPI-3 non-blocking collectives (MPI_Iallgather, MPI_Ireduce_scatter_block,
//   MPI_Iallreduce, MPI_Ibcast, MPI_Isend/Irecv). Open MPI progresses them only inside MPI
//   calls: call work::test() between layers (or run with MPI_THREAD_MULTIPLE and a progress
//   thread) to overlap.
// - half and bfloat16 travel as 16-bit words; their reductions widen to float, reduce with
//   MPI_FLOAT and round once (MPI has no 16-bit float reduction, and a user MPI_Op would round
//   after every pairwise step). avg is MPI_SUM then a division by the group size.
// - Checked mode (checked.hpp): before each collective the ranks all-gather a 24-byte
//   call_desc; a mismatch throws on every rank naming each rank's call. In checked mode an
//   async collective's agreement happens when it is issued (blocking until every rank
//   issued it); the data transfer itself stays asynchronous.
// - Every wait is bounded by the timeout (timeout.hpp, on by default): a blocking MPI call
//   cannot be interrupted, so while the timeout is set every blocking operation (collective,
//   send, recv, barrier, the duplication in the constructor) is issued in its non-blocking
//   form and polled against the deadline. Past it the rank throws loom::error naming the
//   operation, itself, the peer (point-to-point) or the group's world ranks (collectives:
//   MPI cannot tell which member is missing) and the timeout; the communicator is marked
//   broken (its later calls throw), so a peer that died, threw or stopped cannot hang it.
//   With the timeout 0 the blocking MPI calls are used as they are.
// - Point-to-point follows MPI: a blocking send of a large message waits for its receiver,
//   so exchanges should post recv_async first. A recv whose count differs from the message
//   throws.

#include <loom/comm/checked.hpp>
#include <loom/comm/collective_api.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/reduce.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/mpi_error.hpp>

#include <boost/mpi/communicator.hpp>
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace loom::comm {

namespace detail {

inline MPI_Datatype mpi_datatype(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::f16:
    case dtype::bf16:
    case dtype::u16: return MPI_UINT16_T;
    case dtype::i8: return MPI_INT8_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::i16: return MPI_INT16_T;
    case dtype::i32: return MPI_INT32_T;
    case dtype::u32: return MPI_UINT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u64: return MPI_UINT64_T;
  }
  LOOM_THROW("mpi_comm: no MPI datatype for dtype ", static_cast<int>(t));
}

inline MPI_Op mpi_reduce_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg: return MPI_SUM;
    case reduce_op::max: return MPI_MAX;
    case reduce_op::min: return MPI_MIN;
  }
  LOOM_THROW("mpi_comm: unknown reduce_op ", static_cast<int>(op));
}

inline bool widened(dtype t) noexcept { return t == dtype::f16 || t == dtype::bf16; }

inline int mpi_count(std::size_t n, const char* what) {
  LOOM_CHECK(n <= static_cast<std::size_t>(INT_MAX), what, ": count=", n, " exceeds MPI's int count limit ", INT_MAX);
  return static_cast<int>(n);
}

/// The world ranks of `c`'s members: "world ranks 0, 1, 2, 3" (for messages).
inline std::string world_ranks_text(MPI_Comm c) {
  MPI_Group g = MPI_GROUP_NULL, w = MPI_GROUP_NULL;
  int n = 0;
  if (MPI_Comm_group(c, &g) != MPI_SUCCESS || MPI_Comm_group(MPI_COMM_WORLD, &w) != MPI_SUCCESS ||
      MPI_Group_size(g, &n) != MPI_SUCCESS)
    return "world ranks unknown";
  std::vector<int> mine(static_cast<std::size_t>(n)), world(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = i;
  std::string out = "world ranks";
  if (MPI_Group_translate_ranks(g, n, mine.data(), w, world.data()) != MPI_SUCCESS) out += " unknown";
  else
    for (int i = 0; i < n; ++i) out += (i ? ", " : " ") + std::to_string(world[static_cast<std::size_t>(i)]);
  MPI_Group_free(&g);
  MPI_Group_free(&w);
  return out;
}

/// Why a wait of rank `me` in `c` gave up after `limit`: the operation, the peer (point-to-
/// point) or the group (collectives), and how to change the timeout.
inline std::string mpi_timeout_message(MPI_Comm c, int me, const wait_site& site, std::chrono::milliseconds limit) {
  int size = 0;
  MPI_Comm_size(c, &size);
  std::string m = "rank " + std::to_string(me) + " of a group of " + std::to_string(size) + " (" + world_ranks_text(c) +
                  ") timed out after " + std::to_string(limit.count()) + " ms in " + describe(site) + " waiting for ";
  if (site.what == wait_site::kind::collective)
    m += "the other ranks of the group: one of them failed, returned, stopped or waits in another call ";
  else
    m += "rank " + std::to_string(site.peer) + ": it failed, returned, stopped or waits in another call ";
  return m + timeout_hint(limit);
}

/// Polls `req` against the deadline `limit` from now; false when it passed first.
inline bool mpi_poll(MPI_Request& req, MPI_Status& status, std::chrono::milliseconds limit) {
  return poll_until(limit, [&] {
    int flag = 0;
    LOOM_MPI_CHECK(MPI_Test(&req, &flag, &status));
    return flag != 0;
  });
}

/// The communicator shared by copies of an mpi_comm and by its outstanding work.
struct mpi_state {
  boost::mpi::communicator comm;
  std::string broken;  // non-empty once a timeout left the group in an unknown state
  MPI_Comm native() const { return static_cast<MPI_Comm>(comm); }
  void check_usable(const wait_site& site) const {
    if (!broken.empty()) throw error("mpi_comm: " + describe(site) + " on a broken communicator: " + broken);
  }
};

/// Waits for `req`: MPI_Wait when the timeout is 0, else polls until the deadline, then
/// marks the state broken and throws.
inline void mpi_wait(mpi_state& s, MPI_Request& req, MPI_Status& status, const wait_site& site) {
  const auto limit = timeout();
  if (limit.count() == 0) {
    LOOM_MPI_CHECK(MPI_Wait(&req, &status));
    return;
  }
  if (mpi_poll(req, status, limit)) return;
  s.broken = mpi_timeout_message(s.native(), s.comm.rank(), site, limit);
  throw error("mpi_comm: " + s.broken);
}

/// What remains to do once the MPI transfer completed: round widened values back, divide for
/// avg, check a recv's count. Empty vectors for the common case (no allocation).
struct mpi_job {
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  bool reduces = false;
  int group_size = 1;
  void* out = nullptr;
  std::size_t n = 0;  // elements in out
  std::vector<float> wide_in, wide_out;
  bool recv = false;
  int peer = 0, tag = 0;

  void finish(const MPI_Status& status) {
    if (recv) {
      int got = 0;
      LOOM_MPI_CHECK(MPI_Get_count(&status, mpi_datatype(type), &got));
      LOOM_CHECK(static_cast<std::size_t>(got) == n, "mpi_comm: rank ", peer, " sent count=", got, " ",
                 dtype_name(type), " with tag ", tag, " but the recv posted count=", n);
      return;
    }
    if (!reduces) return;
    const bool avg = op == reduce_op::avg;
    visit_dtype(type, [&](auto tag_value) {
      using T = decltype(tag_value);
      T* o = static_cast<T*>(out);
      if (widened(type)) {
        const float div = static_cast<float>(group_size);
        for (std::size_t i = 0; i < n; ++i) o[i] = static_cast<T>(avg ? wide_out[i] / div : wide_out[i]);
      } else if constexpr (!std::is_same_v<T, half> && !std::is_same_v<T, bfloat16>) {
        if (avg)
          for (std::size_t i = 0; i < n; ++i) o[i] = static_cast<T>(o[i] / static_cast<T>(group_size));
      }
    });
  }
};

/// An outstanding MPI operation with its follow-up.
struct mpi_work final : work_state {
  std::shared_ptr<mpi_state> state;
  wait_site what;
  MPI_Request req = MPI_REQUEST_NULL;
  mpi_job job;
  bool finished = false;

  mpi_work() = default;
  mpi_work(const mpi_work&) = delete;
  mpi_work& operator=(const mpi_work&) = delete;
  // A dropped handle still completes its operation (MPI forbids freeing an active collective
  // request, and MPI would otherwise write into buffers the caller may free): wait quietly,
  // bounded by the timeout.
  ~mpi_work() override {
    if (finished || req == MPI_REQUEST_NULL || !state->broken.empty()) return;
    try {
      MPI_Status status{};
      mpi_wait(*state, req, status, what);
    } catch (...) {
    }
  }

  void wait() override {
    if (finished) return;
    MPI_Status status{};
    mpi_wait(*state, req, status, what);
    finished = true;
    job.finish(status);
  }
  bool test() override {
    if (finished) return true;
    int flag = 0;
    MPI_Status status{};
    LOOM_MPI_CHECK(MPI_Test(&req, &flag, &status));
    if (!flag) return false;
    finished = true;
    job.finish(status);
    return true;
  }
};

}  // namespace detail

/// A group of MPI processes. Copies share the underlying communicator; MPI must be
/// initialised (MPI_Init_thread or boost::mpi::environment) before one is made.
class mpi_comm : public collective_api<mpi_comm> {
 public:
  /// A duplicate of MPI_COMM_WORLD.
  static mpi_comm world() { return mpi_comm(MPI_COMM_WORLD); }
  /// A duplicate of `c` (the caller keeps ownership of c). Collective over c, bounded by the
  /// timeout.
  explicit mpi_comm(MPI_Comm c) : s_(std::make_shared<detail::mpi_state>()) {
    int init = 0;
    LOOM_MPI_CHECK(MPI_Initialized(&init));
    LOOM_CHECK(init, "mpi_comm: MPI is not initialised (call MPI_Init_thread or create a boost::mpi::environment first)");
    MPI_Comm dup = MPI_COMM_NULL;
    if (const auto limit = timeout(); limit.count() > 0) {
      MPI_Request req = MPI_REQUEST_NULL;
      MPI_Status status{};
      LOOM_MPI_CHECK(MPI_Comm_idup(c, &dup, &req));
      if (!detail::mpi_poll(req, status, limit)) {
        int me = 0;
        MPI_Comm_rank(c, &me);
        throw error("mpi_comm: " + detail::mpi_timeout_message(c, me, wait_site::collective(call_desc::make(call_kind::dup)), limit));
      }
    } else {
      LOOM_MPI_CHECK(MPI_Comm_dup(c, &dup));
    }
    adopt(dup);
  }
  explicit mpi_comm(const boost::mpi::communicator& c) : mpi_comm(static_cast<MPI_Comm>(c)) {}

  int rank() const { return s_->comm.rank(); }
  int size() const { return s_->comm.size(); }
  MPI_Comm native() const { return s_->native(); }
  const boost::mpi::communicator& boost_comm() const { return s_->comm; }
  /// Non-empty when a timeout broke the communicator.
  const std::string& broken_reason() const { return s_->broken; }

  void barrier() {
    if (agree(call_desc::make(call_kind::barrier))) return;  // the agreement already synchronised
    sync_all(call_kind::barrier);
  }

  /// Ranks with the same color form a new group, ordered by (key, rank). color must be >= 0.
  mpi_comm split(int color, int key) {
    LOOM_CHECK(color >= 0, "split: color=", color, " must be >= 0");
    // MPI_Comm_split has no non-blocking form: first make sure (agreement or a bounded
    // barrier) that every rank arrived, so the split itself cannot wait on a missing one.
    if (!agree(call_desc::make(call_kind::split))) sync_all(call_kind::split);
    MPI_Comm nc = MPI_COMM_NULL;
    LOOM_MPI_CHECK(MPI_Comm_split(native(), color, key, &nc));
    return mpi_comm(nc, adopt_tag{});
  }

  /// Checked mode: all ranks agree on `d` (throws naming every rank's call otherwise; throws
  /// and breaks the communicator after the timeout). Returns whether an agreement took
  /// place (false when checked mode is off). nccl_comm agrees through its bootstrap mpi_comm.
  bool agree(const call_desc& d) {
    s_->check_usable(wait_site::collective(d));
    if (!checked()) return false;  // the unchecked path builds no strings: it is the hot path
    const int p = size();
    std::vector<call_desc> all(static_cast<std::size_t>(p));
    MPI_Request req = MPI_REQUEST_NULL;
    LOOM_MPI_CHECK(MPI_Iallgather(&d, sizeof(call_desc), MPI_BYTE, all.data(), sizeof(call_desc), MPI_BYTE, native(), &req));
    MPI_Status status{};
    detail::mpi_wait(*s_, req, status, wait_site::collective(d));
    const std::string mm = mismatch_message("mpi_comm", all);
    if (!mm.empty()) throw error(mm);
    return true;
  }

 private:
  friend class collective_api<mpi_comm>;
  struct adopt_tag {};
  mpi_comm(MPI_Comm owned, adopt_tag) : s_(std::make_shared<detail::mpi_state>()) { adopt(owned); }
  void adopt(MPI_Comm owned) {
    LOOM_MPI_CHECK(MPI_Comm_set_errhandler(owned, MPI_ERRORS_RETURN));
    s_->comm = boost::mpi::communicator(owned, boost::mpi::comm_take_ownership);
  }

  /// Whether blocking operations take the non-blocking form and poll (the timeout is set).
  static bool bounded() { return timeout().count() > 0; }

  /// A barrier, bounded by the timeout when one is set.
  void sync_all(call_kind k) {
    if (!bounded()) {
      LOOM_MPI_CHECK(MPI_Barrier(native()));
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    LOOM_MPI_CHECK(MPI_Ibarrier(native(), &req));
    MPI_Status status{};
    detail::mpi_wait(*s_, req, status, wait_site::collective(call_desc::make(k)));
  }

  // Completes an operation: a blocking one that was issued non-blocking (req set) is waited
  // for here, against the timeout; an async one becomes `work`.
  work done(detail::mpi_job& job, MPI_Request req, bool async, const wait_site& site, MPI_Status status = {}) {
    if (!async) {
      if (req != MPI_REQUEST_NULL) detail::mpi_wait(*s_, req, status, site);
      job.finish(status);
      return {};
    }
    auto w = std::make_shared<detail::mpi_work>();
    w->state = s_;
    w->what = site;
    w->req = req;
    w->job = std::move(job);
    return work(std::move(w));
  }

  // Sets up a reduction job: widened types reduce a float copy of the input (wide_in) into
  // wide_out, or in place in wide_out when `in_place` (all_reduce).
  detail::mpi_job reduction(dtype t, reduce_op op, void* out, std::size_t n_out, const void* in, std::size_t n_in,
                            bool in_place) {
    detail::mpi_job job;
    job.type = t;
    job.op = op;
    job.reduces = true;
    job.group_size = size();
    job.out = out;
    job.n = n_out;
    if (detail::widened(t)) {
      std::vector<float>& wide = in_place ? job.wide_out : job.wide_in;
      wide.resize(n_in);
      if (!in_place) job.wide_out.resize(n_out);
      visit_dtype(t, [&](auto tag) {
        using T = decltype(tag);
        const T* src = static_cast<const T*>(in);
        for (std::size_t i = 0; i < n_in; ++i) wide[i] = static_cast<float>(src[i]);
      });
    }
    return job;
  }

  work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) {
    const auto d = call_desc::make(call_kind::all_gather, n, t);
    agree(d);
    const int c = detail::mpi_count(n, "all_gather");
    const void* src = in == static_cast<const std::byte*>(out) + n * dtype_size(t) * static_cast<std::size_t>(rank())
                          ? MPI_IN_PLACE : in;
    const MPI_Datatype mt = detail::mpi_datatype(t);
    MPI_Request req = MPI_REQUEST_NULL;
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Iallgather(src, c, mt, out, c, mt, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Allgather(src, c, mt, out, c, mt, native()));
    detail::mpi_job job;
    return done(job, req, async, wait_site::collective(d));
  }

  work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    const auto d = call_desc::make(call_kind::reduce_scatter, n, t, op);
    agree(d);
    const int c = detail::mpi_count(n, "reduce_scatter");
    detail::mpi_count(n * static_cast<std::size_t>(size()), "reduce_scatter input");
    auto job = reduction(t, op, out, n, in, n * static_cast<std::size_t>(size()), false);
    const bool w = detail::widened(t);
    const void* src = w ? job.wide_in.data() : in;
    void* dst = w ? job.wide_out.data() : out;
    const MPI_Datatype mt = w ? MPI_FLOAT : detail::mpi_datatype(t);
    MPI_Request req = MPI_REQUEST_NULL;
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Ireduce_scatter_block(src, dst, c, mt, detail::mpi_reduce_op(op), native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Reduce_scatter_block(src, dst, c, mt, detail::mpi_reduce_op(op), native()));
    return done(job, req, async, wait_site::collective(d));
  }

  work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    const auto d = call_desc::make(call_kind::all_reduce, n, t, op);
    agree(d);
    const int c = detail::mpi_count(n, "all_reduce");
    auto job = reduction(t, op, out, n, in, n, true);
    const bool w = detail::widened(t);
    const void* src = (w || in == out) ? MPI_IN_PLACE : in;
    void* dst = w ? job.wide_out.data() : out;
    const MPI_Datatype mt = w ? MPI_FLOAT : detail::mpi_datatype(t);
    MPI_Request req = MPI_REQUEST_NULL;
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Iallreduce(src, dst, c, mt, detail::mpi_reduce_op(op), native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Allreduce(src, dst, c, mt, detail::mpi_reduce_op(op), native()));
    return done(job, req, async, wait_site::collective(d));
  }

  work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    const auto d = call_desc::make(call_kind::broadcast, n, t, reduce_op::sum, root);
    agree(d);
    const int c = detail::mpi_count(n, "broadcast");
    MPI_Request req = MPI_REQUEST_NULL;
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Ibcast(buf, c, detail::mpi_datatype(t), root, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Bcast(buf, c, detail::mpi_datatype(t), root, native()));
    detail::mpi_job job;
    return done(job, req, async, wait_site::collective(d));
  }

  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) {
    const auto site = wait_site::p2p(wait_site::kind::send, n, t, peer, tag);
    s_->check_usable(site);
    const int c = detail::mpi_count(n, "send");
    MPI_Request req = MPI_REQUEST_NULL;
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Isend(in, c, detail::mpi_datatype(t), peer, tag, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Send(in, c, detail::mpi_datatype(t), peer, tag, native()));
    detail::mpi_job job;
    return done(job, req, async, site);
  }

  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    const auto site = wait_site::p2p(wait_site::kind::recv, n, t, peer, tag);
    s_->check_usable(site);
    const int c = detail::mpi_count(n, "recv");
    detail::mpi_job job;
    job.type = t;
    job.recv = true;
    job.n = n;
    job.peer = peer;
    job.tag = tag;
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Status status{};
    if (async || bounded())
      LOOM_MPI_CHECK(MPI_Irecv(out, c, detail::mpi_datatype(t), peer, tag, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Recv(out, c, detail::mpi_datatype(t), peer, tag, native(), &status));
    return done(job, req, async, site, status);
  }

  std::shared_ptr<detail::mpi_state> s_;
};

static_assert(communicator<mpi_comm>);

}  // namespace loom::comm
