#pragma once
// Checked mode: every collective first agrees on what it is, so a mismatch is an error and
// not a hang or a silently wrong result.
//
// Why: the classic distributed bug is two ranks calling different collectives (or the same
// one with different counts). Open MPI then hangs or reads past a buffer; NCCL hangs. In
// checked mode each collective exchanges a small `call_desc` (operation, count, element type,
// reduce op, root) across the group before moving data; when they differ, every rank throws
// loom::error naming what each rank called. The exchange costs one small all-gather per
// collective for MPI/NCCL, so it is on by default only in debug builds and can be switched
// at run time (set_checked, or LOOM_COMM_CHECKED=0|1 in the environment). thread_comm always
// checks: its ranks share memory, the descriptors are free to compare, and an unchecked
// mismatch there would be a buffer overrun.
//
// The timeout (timeout.hpp) is separate: it bounds every wait, checked mode or not.

#include <loom/comm/communicator.hpp>
#include <loom/comm/timeout.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

namespace loom::comm {

namespace detail {
inline bool checked_default() noexcept {
  if (const char* e = std::getenv("LOOM_COMM_CHECKED")) return !(e[0] == '0' || e[0] == 'o' || e[0] == 'f');
#ifdef NDEBUG
  return false;
#else
  return true;
#endif
}
inline std::atomic<bool>& checked_flag() noexcept {
  static std::atomic<bool> flag{checked_default()};
  return flag;
}
}  // namespace detail

/// Whether collectives first agree on (operation, count, element type, op, root). Process-wide.
inline bool checked() noexcept { return detail::checked_flag().load(std::memory_order_relaxed); }
inline void set_checked(bool on) noexcept { detail::checked_flag().store(on, std::memory_order_relaxed); }

/// RAII switch for tests and tools: sets checked mode (and optionally a timeout) for a scope.
class checked_scope {
 public:
  explicit checked_scope(bool on, std::chrono::milliseconds t = timeout()) : old_on_(checked()), old_t_(timeout()) {
    set_checked(on);
    set_timeout(t);
  }
  ~checked_scope() {
    set_checked(old_on_);
    set_timeout(old_t_);
  }
  checked_scope(const checked_scope&) = delete;
  checked_scope& operator=(const checked_scope&) = delete;

 private:
  bool old_on_;
  std::chrono::milliseconds old_t_;
};

enum class call_kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, split, dup };

constexpr std::string_view call_kind_name(call_kind k) noexcept {
  switch (k) {
    case call_kind::all_gather: return "all_gather";
    case call_kind::reduce_scatter: return "reduce_scatter";
    case call_kind::all_reduce: return "all_reduce";
    case call_kind::broadcast: return "broadcast";
    case call_kind::barrier: return "barrier";
    case call_kind::split: return "split";
    case call_kind::dup: return "dup";
  }
  return "unknown";
}

/// What a rank called. Fields that do not apply to the call are zero, so descriptors of the
/// same call compare equal field by field. Trivially copyable: it travels as bytes.
struct call_desc {
  std::uint64_t count = 0;  ///< elements per rank (all_gather: input count; reduce_scatter: output count)
  std::int32_t root = 0;
  call_kind kind = call_kind::barrier;
  dtype type = dtype::u8;
  reduce_op op = reduce_op::sum;

  static call_desc make(call_kind k, std::size_t count = 0, dtype t = dtype::u8, reduce_op op = reduce_op::sum, int root = 0) {
    call_desc d;
    d.kind = k;
    if (k != call_kind::barrier && k != call_kind::split && k != call_kind::dup) {
      d.count = count;
      d.type = t;
    }
    if (k == call_kind::reduce_scatter || k == call_kind::all_reduce) d.op = op;
    if (k == call_kind::broadcast) d.root = root;
    return d;
  }
  friend bool operator==(const call_desc&, const call_desc&) = default;
};
static_assert(std::is_trivially_copyable_v<call_desc>);

/// "all_reduce(count=5, float32, sum)", "broadcast(count=3, int64, root=1)", "barrier()".
inline std::string describe(const call_desc& d) {
  std::ostringstream os;
  os << call_kind_name(d.kind) << '(';
  if (d.kind != call_kind::barrier && d.kind != call_kind::split && d.kind != call_kind::dup) {
    os << "count=" << d.count << ", " << dtype_name(d.type);
    if (d.kind == call_kind::reduce_scatter || d.kind == call_kind::all_reduce) os << ", " << reduce_op_name(d.op);
    if (d.kind == call_kind::broadcast) os << ", root=" << d.root;
  }
  os << ')';
  return os.str();
}

/// Empty when every rank called the same; otherwise a message naming what each rank called.
inline std::string mismatch_message(std::string_view comm_name, std::span<const call_desc> calls) {
  bool same = true;
  for (const auto& c : calls) same = same && c == calls.front();
  if (same) return {};
  std::ostringstream os;
  os << comm_name << ": ranks called different collectives:";
  for (std::size_t r = 0; r < calls.size(); ++r) os << (r ? "," : "") << " rank " << r << " called " << describe(calls[r]);
  return os.str();
}

/// What a waiting rank is doing, for the message when it gives up: a collective (its
/// call_desc) or a send/recv (count and type in `call`) with its peer and tag. Plain data,
/// described only on failure, so the hot path builds no string.
struct wait_site {
  enum class kind : std::uint8_t { collective, send, recv };
  call_desc call{};
  kind what = kind::collective;
  int peer = -1;  // send/recv: the other rank, in the group
  int tag = 0;

  static wait_site collective(const call_desc& d) { return {d, kind::collective, -1, 0}; }
  static wait_site p2p(kind k, std::size_t count, dtype t, int peer, int tag) {
    call_desc d;
    d.count = count;
    d.type = t;
    return {d, k, peer, tag};
  }
};

/// "all_reduce(count=8, float32, sum)", "send(count=8, float32) to rank 1 with tag 3",
/// "recv(count=8, float32) from rank 1 with tag 3".
inline std::string describe(const wait_site& w) {
  if (w.what == wait_site::kind::collective) return describe(w.call);
  const bool send = w.what == wait_site::kind::send;
  std::ostringstream os;
  os << (send ? "send" : "recv") << "(count=" << w.call.count << ", " << dtype_name(w.call.type) << ") "
     << (send ? "to" : "from") << " rank " << w.peer << " with tag " << w.tag;
  return os.str();
}

}  // namespace loom::comm
