#pragma once
// self_comm: the group of one rank. Every collective is the identity (a copy where input and
// output differ), split returns another self_comm, and point-to-point goes to the rank
// itself, as MPI allows: a send is delivered to the oldest posted receive of its tag, or
// buffered until one is posted. A receive that no send can ever match (nothing buffered,
// and nothing else can run on a one-rank group) throws instead of hanging.
//
// Why: tensor parallelism is the general case of loom's layers (design.md section 6): the
// single-rank model is the tp = 1 instance of the tensor-parallel layers, called with a
// self_comm, so there is one attention, one MLP and one cross-entropy instead of a
// single-rank copy of each that drifts from the parallel one. A default thread_comm is also
// one rank, but it goes through the thread group's barriers; self_comm does no
// synchronisation at all, so the single-rank model pays nothing for its reductions.

#include <loom/comm/collective_api.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

namespace loom::comm {

class self_comm : public collective_api<self_comm> {
 public:
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  void barrier() {}
  /// A new one-rank group (its own mailbox, as a new communicator has).
  self_comm split(int /*color*/, int /*key*/) const { return {}; }

 private:
  friend class collective_api<self_comm>;

  static work copy(const void* in, void* out, std::size_t n, dtype t) {
    if (n && in != out) std::memmove(out, in, n * dtype_size(t));
    return {};
  }
  work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool) { return copy(in, out, n, t); }
  work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op, bool) {
    return copy(in, out, n, t);  // sum, avg, max and min of one contribution are that contribution
  }
  work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op, bool) { return copy(in, out, n, t); }
  work start_broadcast(void*, std::size_t, dtype, int root, bool) {
    LOOM_CHECK(root == 0, "self_comm::broadcast: root=", root, " is not a rank of a one-rank group");
    return {};
  }
  struct message {
    int tag;
    dtype t;
    std::vector<unsigned char> bytes;
  };
  struct pending_recv : work_state {
    void* out;
    std::size_t n;
    dtype t;
    int tag;
    bool done = false;
    pending_recv(void* o, std::size_t count, dtype type, int tg) : out(o), n(count), t(type), tag(tg) {}
    void wait() override {
      LOOM_CHECK(done, "self_comm::recv(tag=", tag, "): no send to this rank matches it, and none can come on a one-rank group");
    }
    bool test() override { return done; }
  };
  struct mailbox {
    std::deque<message> sent;                          // sends no receive has taken yet
    std::deque<std::shared_ptr<pending_recv>> posted;  // receives waiting for a send
  };

  static void check_peer(int peer, const char* what) {
    LOOM_CHECK(peer == 0, "self_comm::", what, ": peer=", peer, " is not a rank of a one-rank group");
  }
  static void deliver(pending_recv& r, const void* in, std::size_t n, dtype t) {
    LOOM_CHECK(n == r.n && t == r.t, "self_comm::recv(tag=", r.tag, "): expects ", r.n, " elements of ", dtype_name(r.t),
               ", the matching send has ", n, " of ", dtype_name(t));
    copy(in, r.out, n, t);
    r.done = true;
  }
  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool) {
    check_peer(peer, "send");
    for (auto it = box_->posted.begin(); it != box_->posted.end(); ++it)
      if ((*it)->tag == tag) {
        const auto r = *it;
        box_->posted.erase(it);
        deliver(*r, in, n, t);
        return {};
      }
    const auto* p = static_cast<const unsigned char*>(in);
    box_->sent.push_back({tag, t, std::vector<unsigned char>(p, p + n * dtype_size(t))});
    return {};  // buffered: the caller's buffer is free at once
  }
  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    check_peer(peer, "recv");
    auto r = std::make_shared<pending_recv>(out, n, t, tag);
    for (auto it = box_->sent.begin(); it != box_->sent.end(); ++it)
      if (it->tag == tag) {
        const message m = std::move(*it);
        box_->sent.erase(it);
        deliver(*r, m.bytes.data(), m.bytes.size() / dtype_size(m.t), m.t);
        return {};
      }
    LOOM_CHECK(async, "self_comm::recv(tag=", tag, "): no send to this rank matches it, and none can come on a one-rank group");
    box_->posted.push_back(r);
    return work(r);
  }

  std::shared_ptr<mailbox> box_ = std::make_shared<mailbox>();
};

static_assert(communicator<self_comm>);

}  // namespace loom::comm
