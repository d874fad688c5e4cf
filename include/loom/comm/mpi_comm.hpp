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
//   call_desc; a mismatch throws on every rank naming each rank's call. With a timeout, the
//   agreement is polled and gives up after the timeout: the rank throws, the communicator is
//   marked broken (its later calls throw), and a peer that died or threw cannot hang it.
//   In checked mode an async collective's agreement happens when it is issued (blocking
//   until every rank issued it); the data transfer itself stays asynchronous.
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

/// The communicator shared by copies of an mpi_comm and by its outstanding work.
struct mpi_state {
  boost::mpi::communicator comm;
  std::string broken;  // non-empty once a timeout left the group in an unknown state
  MPI_Comm native() const { return static_cast<MPI_Comm>(comm); }
  void check_usable(const std::string& what) const {
    if (!broken.empty()) throw error("mpi_comm: " + what + " on a broken communicator: " + broken);
  }
};

/// Polls `req` until it completes or the checked-mode timeout passes (then marks the state
/// broken and throws). Without checked mode or timeout: MPI_Wait.
inline void mpi_wait(mpi_state& s, MPI_Request& req, MPI_Status& status, const std::string& what) {
  const auto limit = checked() ? timeout() : std::chrono::milliseconds(0);
  if (limit.count() == 0) {
    LOOM_MPI_CHECK(MPI_Wait(&req, &status));
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int flag = 0;;) {
    LOOM_MPI_CHECK(MPI_Test(&req, &flag, &status));
    if (flag) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      s.broken = "rank " + std::to_string(s.comm.rank()) + " timed out after " + std::to_string(limit.count()) + " ms in " +
                 what + " waiting for the other ranks of the group (size " + std::to_string(s.comm.size()) + ")";
      throw error("mpi_comm: " + s.broken);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
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
  std::string what;
  MPI_Request req = MPI_REQUEST_NULL;
  mpi_job job;
  bool finished = false;

  mpi_work() = default;
  mpi_work(const mpi_work&) = delete;
  mpi_work& operator=(const mpi_work&) = delete;
  // A dropped handle still completes its operation (MPI forbids freeing an active collective
  // request, and MPI would otherwise write into buffers the caller may free): wait quietly,
  // bounded by the checked-mode timeout.
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
  /// A duplicate of `c` (the caller keeps ownership of c).
  explicit mpi_comm(MPI_Comm c) : s_(std::make_shared<detail::mpi_state>()) {
    int init = 0;
    LOOM_MPI_CHECK(MPI_Initialized(&init));
    LOOM_CHECK(init, "mpi_comm: MPI is not initialised (call MPI_Init_thread or create a boost::mpi::environment first)");
    MPI_Comm dup = MPI_COMM_NULL;
    LOOM_MPI_CHECK(MPI_Comm_dup(c, &dup));
    adopt(dup);
  }
  explicit mpi_comm(const boost::mpi::communicator& c) : mpi_comm(static_cast<MPI_Comm>(c)) {}

  int rank() const { return s_->comm.rank(); }
  int size() const { return s_->comm.size(); }
  MPI_Comm native() const { return s_->native(); }
  const boost::mpi::communicator& boost_comm() const { return s_->comm; }
  /// Non-empty when a checked-mode timeout broke the communicator.
  const std::string& broken_reason() const { return s_->broken; }

  void barrier() {
    const bool agreed = agree(call_desc::make(call_kind::barrier));
    if (!agreed) LOOM_MPI_CHECK(MPI_Barrier(native()));  // the agreement already synchronised
  }

  /// Ranks with the same color form a new group, ordered by (key, rank). color must be >= 0.
  mpi_comm split(int color, int key) {
    LOOM_CHECK(color >= 0, "split: color=", color, " must be >= 0");
    agree(call_desc::make(call_kind::split));
    MPI_Comm nc = MPI_COMM_NULL;
    LOOM_MPI_CHECK(MPI_Comm_split(native(), color, key, &nc));
    return mpi_comm(nc, adopt_tag{});
  }

  /// Checked mode: all ranks agree on `d` (throws naming every rank's call otherwise; throws
  /// and breaks the communicator after the timeout). Returns whether an agreement took
  /// place (false when checked mode is off). nccl_comm agrees through its bootstrap mpi_comm.
  bool agree(const call_desc& d) {
    if (!s_->broken.empty()) s_->check_usable(describe(d));
    if (!checked()) return false;  // the unchecked path builds no strings: it is the hot path
    const std::string what = describe(d);
    const int p = size();
    std::vector<call_desc> all(static_cast<std::size_t>(p));
    MPI_Request req = MPI_REQUEST_NULL;
    LOOM_MPI_CHECK(MPI_Iallgather(&d, sizeof(call_desc), MPI_BYTE, all.data(), sizeof(call_desc), MPI_BYTE, native(), &req));
    MPI_Status status{};
    detail::mpi_wait(*s_, req, status, what);
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

  work done(detail::mpi_job& job, MPI_Request req, bool async, const call_desc& d) {
    if (!async) {
      MPI_Status status{};
      job.finish(status);
      return {};
    }
    auto w = std::make_shared<detail::mpi_work>();
    w->state = s_;
    w->what = describe(d);
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
    if (async)
      LOOM_MPI_CHECK(MPI_Iallgather(src, c, mt, out, c, mt, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Allgather(src, c, mt, out, c, mt, native()));
    detail::mpi_job job;
    return done(job, req, async, d);
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
    if (async)
      LOOM_MPI_CHECK(MPI_Ireduce_scatter_block(src, dst, c, mt, detail::mpi_reduce_op(op), native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Reduce_scatter_block(src, dst, c, mt, detail::mpi_reduce_op(op), native()));
    return done(job, req, async, d);
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
    if (async)
      LOOM_MPI_CHECK(MPI_Iallreduce(src, dst, c, mt, detail::mpi_reduce_op(op), native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Allreduce(src, dst, c, mt, detail::mpi_reduce_op(op), native()));
    return done(job, req, async, d);
  }

  work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    const auto d = call_desc::make(call_kind::broadcast, n, t, reduce_op::sum, root);
    agree(d);
    const int c = detail::mpi_count(n, "broadcast");
    MPI_Request req = MPI_REQUEST_NULL;
    if (async)
      LOOM_MPI_CHECK(MPI_Ibcast(buf, c, detail::mpi_datatype(t), root, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Bcast(buf, c, detail::mpi_datatype(t), root, native()));
    detail::mpi_job job;
    return done(job, req, async, d);
  }

  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) {
    s_->check_usable("send");
    const int c = detail::mpi_count(n, "send");
    MPI_Request req = MPI_REQUEST_NULL;
    if (async)
      LOOM_MPI_CHECK(MPI_Isend(in, c, detail::mpi_datatype(t), peer, tag, native(), &req));
    else
      LOOM_MPI_CHECK(MPI_Send(in, c, detail::mpi_datatype(t), peer, tag, native()));
    detail::mpi_job job;
    return done(job, req, async, call_desc{});
  }

  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    s_->check_usable("recv");
    const int c = detail::mpi_count(n, "recv");
    detail::mpi_job job;
    job.type = t;
    job.recv = true;
    job.n = n;
    job.peer = peer;
    job.tag = tag;
    MPI_Request req = MPI_REQUEST_NULL;
    if (async) {
      LOOM_MPI_CHECK(MPI_Irecv(out, c, detail::mpi_datatype(t), peer, tag, native(), &req));
      return done(job, req, true, call_desc{});
    }
    MPI_Status status{};
    LOOM_MPI_CHECK(MPI_Recv(out, c, detail::mpi_datatype(t), peer, tag, native(), &status));
    job.finish(status);
    return {};
  }

  std::shared_ptr<detail::mpi_state> s_;
};

static_assert(communicator<mpi_comm>);

}  // namespace loom::comm
