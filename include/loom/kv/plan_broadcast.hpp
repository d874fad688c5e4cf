#pragma once
// plan_broadcast: one scheduler decision per step for every rank of a model-parallel group.
//
// Why: under tensor parallelism each rank holds a slice of the weights and of the KV pool
// (its key/value heads of every block), and all ranks must run the identical step: the same
// tokens at the same positions, their keys and values written to the same block ids. The
// scheduler, the allocator's prefix cache and the sampler have state that every past
// decision changes; running a replica of them on each rank and trusting that they never
// diverge would let one difference (a request or a cancellation seen by one rank only, a
// sampled token that differs in one bit of a logit) split the ranks silently. So rank 0
// alone schedules and samples, and sends each step's plan; the other ranks keep no sequence
// state at all. A plan carries everything a model step reads:
//   - the chunks (start, length, whether the last row is sampled, the LoRA adapter),
//   - token ids, positions and batch indices per token (the decode rows' token ids are the
//     tokens rank 0 sampled in the previous step, so no separate "sampled tokens" message),
//   - qo_indptr and the paged-KV block tables as CSR (indptr, block ids, last page lengths),
//   - the copy-on-write block copies to make before the step.
// The scheduler's sequence pointers are not sent: a received plan's chunks have seq ==
// nullptr, and a model never reads them (scheduler.hpp, scheduled_chunk).
//
// On the wire: a header of two int64 (command: step, stop or idle; the body's bytes), then the
// body: each array as its length (uint64) and its elements, host byte order (every rank of a
// group runs the same build on the same kind of host). Two broadcasts per step, from root.
// The receiver checks every length against the bytes that remain and the arrays against
// each other before a model reads them.

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>
#include <loom/kv/scheduler.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace loom::kv {

namespace detail {

class plan_writer {
 public:
  explicit plan_writer(std::vector<std::uint8_t>& out) : out_(&out) { out.clear(); }
  template <class T>
  void scalar(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto at = out_->size();
    out_->resize(at + sizeof(T));
    std::memcpy(out_->data() + at, &v, sizeof(T));
  }
  template <class T>
  void array(const std::vector<T>& v) {
    scalar(static_cast<std::uint64_t>(v.size()));
    const auto at = out_->size();
    out_->resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out_->data() + at, v.data(), v.size() * sizeof(T));
  }

 private:
  std::vector<std::uint8_t>* out_;
};

class plan_reader {
 public:
  explicit plan_reader(std::span<const std::uint8_t> in) : in_(in) {}
  template <class T>
  T scalar(const char* field) {
    LOOM_CHECK(sizeof(T) <= in_.size() - at_, "kv::decode_plan: ", field, " needs ", sizeof(T), " bytes, ",
               in_.size() - at_, " remain of ", in_.size());
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  template <class T>
  void array(std::vector<T>& v, const char* field) {
    const auto n = scalar<std::uint64_t>(field);
    LOOM_CHECK(n <= (in_.size() - at_) / sizeof(T), "kv::decode_plan: ", field, " has ", n, " elements of ", sizeof(T),
               " bytes, ", in_.size() - at_, " bytes remain");
    v.resize(static_cast<std::size_t>(n));
    if (n) std::memcpy(v.data(), in_.data() + at_, static_cast<std::size_t>(n) * sizeof(T));
    at_ += static_cast<std::size_t>(n) * sizeof(T);
  }
  std::size_t remaining() const noexcept { return in_.size() - at_; }

 private:
  std::span<const std::uint8_t> in_;
  std::size_t at_ = 0;
};

}  // namespace detail

/// The plan's model-facing contents as bytes (see the file comment), into `out` (reused).
inline void encode_plan(const step_plan& p, std::vector<std::uint8_t>& out) {
  detail::plan_writer w(out);
  w.scalar(static_cast<std::uint64_t>(p.chunks.size()));
  for (const scheduled_chunk& c : p.chunks) {
    w.scalar(c.start);
    w.scalar(c.len);
    w.scalar(static_cast<std::int32_t>(c.samples));
    w.scalar(c.adapter);
  }
  w.array(p.copies);
  w.array(p.token_ids);
  w.array(p.positions);
  w.array(p.batch_indices);
  w.array(p.qo_indptr);
  w.array(p.csr.indptr);
  w.array(p.csr.indices);
  w.array(p.csr.last_page_len);
  w.scalar(p.csr.block_size);
  w.scalar(p.num_decode);
}

/// Bytes from encode_plan into `p` (its vectors reused; chunks without sequences). A length
/// past the bytes, or arrays that disagree with each other, are a loom::error naming them.
inline void decode_plan(std::span<const std::uint8_t> in, step_plan& p) {
  detail::plan_reader r(in);
  const auto chunks = r.scalar<std::uint64_t>("chunks");
  constexpr std::size_t chunk_bytes = sizeof(std::int64_t) + 3 * sizeof(std::int32_t);  // start, len, samples, adapter
  LOOM_CHECK(chunks <= r.remaining() / chunk_bytes, "kv::decode_plan: chunks=", chunks, " do not fit the ", r.remaining(),
             " bytes that remain");
  p.chunks.resize(static_cast<std::size_t>(chunks));
  for (scheduled_chunk& c : p.chunks) {
    c.seq = nullptr;
    c.start = r.scalar<std::int64_t>("chunk start");
    c.len = r.scalar<std::int32_t>("chunk len");
    c.samples = r.scalar<std::int32_t>("chunk samples") != 0;
    c.adapter = r.scalar<std::int32_t>("chunk adapter");
  }
  r.array(p.copies, "copies");
  r.array(p.token_ids, "token_ids");
  r.array(p.positions, "positions");
  r.array(p.batch_indices, "batch_indices");
  r.array(p.qo_indptr, "qo_indptr");
  r.array(p.csr.indptr, "csr.indptr");
  r.array(p.csr.indices, "csr.indices");
  r.array(p.csr.last_page_len, "csr.last_page_len");
  p.csr.block_size = r.scalar<std::int32_t>("csr.block_size");
  p.num_decode = r.scalar<std::int32_t>("num_decode");
  p.preempted.clear();
  LOOM_CHECK(r.remaining() == 0, "kv::decode_plan: ", r.remaining(), " bytes left after the plan");
  const std::size_t b = p.chunks.size(), n = p.token_ids.size();
  LOOM_CHECK(p.positions.size() == n && p.batch_indices.size() == n, "kv::decode_plan: ", n, " token_ids but ",
             p.positions.size(), " positions and ", p.batch_indices.size(), " batch_indices");
  LOOM_CHECK(p.qo_indptr.size() == b + 1 && p.qo_indptr.front() == 0 && static_cast<std::size_t>(p.qo_indptr.back()) == n,
             "kv::decode_plan: qo_indptr of ", p.qo_indptr.size(), " entries for ", b, " chunks and ", n, " tokens");
  LOOM_CHECK(p.csr.indptr.size() == b + 1 && p.csr.last_page_len.size() == b && p.csr.indptr.front() == 0 &&
                 static_cast<std::size_t>(p.csr.indptr.back()) == p.csr.indices.size(),
             "kv::decode_plan: a CSR of ", p.csr.indptr.size(), " indptr, ", p.csr.last_page_len.size(),
             " last_page_len and ", p.csr.indices.size(), " indices for ", b, " chunks");
  for (std::size_t i = 0; i < b; ++i)
    LOOM_CHECK(p.qo_indptr[i] <= p.qo_indptr[i + 1] && p.qo_indptr[i + 1] - p.qo_indptr[i] == p.chunks[i].len &&
                   p.csr.indptr[i] <= p.csr.indptr[i + 1],
               "kv::decode_plan: chunk ", i, " has len=", p.chunks[i].len, " but qo_indptr [", p.qo_indptr[i], ", ",
               p.qo_indptr[i + 1], ") and csr.indptr [", p.csr.indptr[i], ", ", p.csr.indptr[i + 1], ")");
}

/// What a plan message asks of the receiving ranks. `idle`: no step yet, keep waiting; a
/// leader with nothing to run sends it now and then so that its followers' wait for the next
/// plan (bounded by the communicator's timeout) does not expire while a server is idle.
enum class plan_command : std::int64_t { step = 0, stop = 1, idle = 2 };

namespace detail {
/// Root: the message header (command, body bytes) every plan message starts with.
template <comm::communicator C>
void broadcast_header(C& group, plan_command cmd, std::size_t body_bytes, int root) {
  std::array<std::int64_t, 2> header{static_cast<std::int64_t>(cmd), static_cast<std::int64_t>(body_bytes)};
  group.broadcast(std::span<std::int64_t>(header), root);
}
}  // namespace detail

/// Root: sends `p` to every rank of `group` (`wire`: reused scratch).
template <comm::communicator C>
void broadcast_plan(C& group, const step_plan& p, std::vector<std::uint8_t>& wire, int root = 0) {
  encode_plan(p, wire);
  detail::broadcast_header(group, plan_command::step, wire.size(), root);
  group.broadcast(std::span<std::uint8_t>(wire), root);
}

/// Root: tells every other rank of `group` that no plan follows (receive_plan returns false).
template <comm::communicator C>
void broadcast_stop(C& group, int root = 0) {
  detail::broadcast_header(group, plan_command::stop, 0, root);
}

/// Root: tells every other rank of `group` that it is alive and has no plan yet.
template <comm::communicator C>
void broadcast_idle(C& group, int root = 0) {
  detail::broadcast_header(group, plan_command::idle, 0, root);
}

/// Every rank but root: the next plan into `p` (idle messages are waited past); false when
/// root sent stop instead.
template <comm::communicator C>
bool receive_plan(C& group, step_plan& p, std::vector<std::uint8_t>& wire, int root = 0) {
  std::array<std::int64_t, 2> header{};
  do group.broadcast(std::span<std::int64_t>(header), root);
  while (header[0] == static_cast<std::int64_t>(plan_command::idle));
  if (header[0] == static_cast<std::int64_t>(plan_command::stop)) return false;
  LOOM_CHECK(header[0] == static_cast<std::int64_t>(plan_command::step) && header[1] >= 0,
             "kv::receive_plan: a header with command=", header[0], " and bytes=", header[1]);
  wire.resize(static_cast<std::size_t>(header[1]));
  group.broadcast(std::span<std::uint8_t>(wire), root);
  decode_plan(wire, p);
  return true;
}

}  // namespace loom::kv
