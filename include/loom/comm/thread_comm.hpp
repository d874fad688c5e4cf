#pragma once
// thread_comm: ranks are threads of one process; run_ranks(n, fn) starts them.
//
// Why it is written this way:
// - Shared memory, no copies through a middle buffer. A collective is a rendezvous: each
//   rank posts its buffer pointers into its slot of the group, waits until all ranks posted
//   (barrier 1), then reads its peers' buffers directly, and waits until all ranks finished
//   reading (barrier 2) before returning, so no buffer is released while a peer reads it.
//   all_reduce is a reduce-scatter into each rank's own output block followed by an
//   all-gather of the blocks (a third barrier between them), which works in place and moves
//   each byte once per rank: the bandwidth is memcpy's.
// - Ranks may outnumber cores (CI: 8 ranks on 2 cores), so every wait blocks on a condition
//   variable; nothing spins.
// - No hangs. All groups split from one run_ranks world share one mutex/condition variable
//   and a world state. A rank whose function throws marks the world aborted: every rank
//   waiting in (or later entering) a collective, a barrier or a recv throws loom::error
//   naming the failed rank. A rank that returns while others wait for it in a collective
//   makes them throw too. The descriptors posted in barrier 1 are always compared (shared
//   memory makes it free), so mismatched collectives throw on every rank. The timeout
//   (timeout.hpp, on by default) bounds every wait, so a rank that is stopped or stuck
//   elsewhere makes the others throw naming the ranks that did not arrive, and aborts the
//   world. run_ranks rethrows the first failure.
// - Async forms run on a per-communicator worker thread (started on first use) in issue
//   order, so `work` genuinely overlaps with the caller's compute. A blocking collective
//   first waits for this communicator's queued async work, keeping the per-rank order that
//   matches collectives across ranks.
// - send is buffered (it copies into the receiver's posted buffer, or into a message queued
//   for it) and completes at once, so exchange patterns where both ranks send first cannot
//   deadlock; recv matches messages by (source, tag) in send order, as MPI does.
//
//   // [ranks = 4] sum a gradient across thread ranks
//   loom::comm::run_ranks(4, [](loom::comm::thread_comm& c) {
//     std::vector<float> g(1024, float(c.rank()));
//     c.all_reduce(std::span(g), loom::comm::reduce_op::sum);   // g[i] == 0+1+2+3
//   });

#include <loom/comm/checked.hpp>
#include <loom/comm/collective_api.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/reduce.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace loom::comm {

namespace detail {

/// State shared by every group of one run_ranks world (one lock, one condition variable).
struct thread_world {
  explicit thread_world(int n) : exited(static_cast<std::size_t>(n), 0), waiting_in(static_cast<std::size_t>(n)) {}
  std::mutex m;
  std::condition_variable cv;
  bool aborted = false;
  std::string reason;
  int culprit = -1;  // world rank whose failure aborted the world (-1: none or unknown)
  std::vector<char> exited;  // by world rank: returned from its run_ranks function
  // by world rank: what it waits in now (null: in none of thread_comm's waits), so a rank
  // that gives up can say what the ranks it waited for were doing
  std::vector<const std::string*> waiting_in;

  void abort_locked(const std::string& why, int world_rank = -1) {
    if (!aborted) {
      aborted = true;
      reason = why;
      culprit = world_rank;
    }
    cv.notify_all();
  }
};

/// A point-to-point message that arrived before its recv was posted (a copy of the data).
struct thread_message {
  int src = 0, tag = 0;
  dtype type = dtype::u8;
  std::size_t count = 0;
  std::vector<std::byte> data;
};

struct thread_group;

/// A recv that waits for its message; completed by the sender. Also the recv's work_state.
struct thread_posted_recv final : work_state {
  std::shared_ptr<thread_group> group;
  int me = 0, src = 0, tag = 0;
  dtype type = dtype::u8;
  std::size_t count = 0;
  void* out = nullptr;
  bool done = false;
  std::string failure;
  void wait() override;
  bool test() override;
};

/// One group of ranks (a world, or a group made by split).
struct thread_group {
  thread_group(std::shared_ptr<thread_world> w, std::vector<int> m)
      : world(std::move(w)), members(std::move(m)), calls(members.size()), ins(members.size()), outs(members.size()),
        present(members.size(), 0), colors(members.size()), keys(members.size()), split_result(members.size()),
        unexpected(members.size()), posted(members.size()) {}
  int size() const noexcept { return static_cast<int>(members.size()); }

  std::shared_ptr<thread_world> world;
  std::vector<int> members;  // world rank of each group rank
  // rendezvous (guarded by world->m)
  std::uint64_t generation = 0;
  int arrived = 0;
  std::vector<call_desc> calls;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  std::vector<char> present;
  std::vector<int> colors, keys;
  std::string mismatch;  // result of the last completed rendezvous
  std::vector<std::shared_ptr<thread_group>> split_result;
  // point-to-point, per destination group rank (guarded by world->m)
  std::vector<std::deque<thread_message>> unexpected;
  std::vector<std::deque<std::shared_ptr<thread_posted_recv>>> posted;
};

/// The ranks a timed-out wait waited for ([peer], or the ranks not yet in the rendezvous)
/// and what each of them is doing: "[1, 2] (rank 1 is in no wait of thread_comm: busy,
/// stopped or stuck elsewhere; rank 2 waits in recv(...) from rank 1 with tag 7)".
inline std::string thread_missing(const thread_group& g, int peer) {
  std::ostringstream list, doing;
  bool first = true;
  for (int i = 0; i < g.size(); ++i) {
    if (peer >= 0 ? i != peer : g.present[static_cast<std::size_t>(i)] != 0) continue;
    const std::string* in = g.world->waiting_in[static_cast<std::size_t>(g.members[static_cast<std::size_t>(i)])];
    list << (first ? "" : ", ") << i;
    doing << (first ? "" : "; ") << "rank " << i;
    if (in)
      doing << " waits in " << *in;
    else
      doing << " is in no wait of thread_comm: busy, stopped or stuck elsewhere";
    first = false;
  }
  return "[" + list.str() + "] (" + doing.str() + ")";
}

/// Throws if the world was aborted; otherwise, when a rank this wait depends on (`peer`, or
/// every member when peer < 0) has returned from its function, aborts the world and throws.
/// Caller holds the lock.
inline void thread_check_alive(thread_group& g, int me, const std::string& what, int peer = -1) {
  thread_world& w = *g.world;
  if (w.aborted) throw error("thread_comm: " + what + " on rank " + std::to_string(me) + " failed: " + w.reason);
  for (int i = 0; i < g.size(); ++i)
    if ((peer < 0 || i == peer) && w.exited[static_cast<std::size_t>(g.members[static_cast<std::size_t>(i)])]) {
      w.abort_locked("rank " + std::to_string(i) + " of the group returned from its function while rank " +
                     std::to_string(me) + " waits in " + what);
      throw error("thread_comm: " + what + " on rank " + std::to_string(me) + " failed: " + w.reason);
    }
}

/// Waits on the world's condition variable until `done()`. When `interruptible`, throws
/// loom::error if the world is aborted, a member exits, or the timeout passes (which aborts
/// the world). Caller holds lk.
template <class Done>
void thread_wait(std::unique_lock<std::mutex>& lk, thread_group& g, int me, bool interruptible, const std::string& what,
                 Done done, int peer = -1) {
  thread_world& w = *g.world;
  const auto limit = timeout();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  struct mark {  // what this rank waits in, for the others' messages; restored however it leaves
    const std::string*& slot;
    const std::string* old;
    ~mark() { slot = old; }
  } waiting{w.waiting_in[static_cast<std::size_t>(g.members[static_cast<std::size_t>(me)])],
            w.waiting_in[static_cast<std::size_t>(g.members[static_cast<std::size_t>(me)])]};
  if (interruptible) waiting.slot = &what;
  while (!done()) {
    if (interruptible) {
      thread_check_alive(g, me, what, peer);
      if (limit.count() > 0 && std::chrono::steady_clock::now() >= deadline) {
        w.abort_locked("rank " + std::to_string(me) + " timed out after " + std::to_string(limit.count()) + " ms in " +
                           what + " waiting for rank(s) " + thread_missing(g, peer) + " " + timeout_hint(limit));
        throw error("thread_comm: " + w.reason);
      }
      if (limit.count() > 0)
        w.cv.wait_until(lk, deadline);
      else
        w.cv.wait(lk);
    } else {
      w.cv.wait(lk);
    }
  }
}

/// Barrier 1 of a collective: posts this rank's call and buffers, waits for all ranks
/// (interruptibly), and returns the mismatch message computed by the last rank to arrive
/// (empty when all called the same). `on_complete` runs once, under the lock, by that rank.
template <class OnComplete>
std::string thread_rendezvous(thread_group& g, int me, const call_desc& d, const void* in, void* out,
                              OnComplete on_complete) {
  thread_world& w = *g.world;
  std::unique_lock lk(w.m);
  const std::string what = describe(d);
  thread_check_alive(g, me, what);
  const auto i = static_cast<std::size_t>(me);
  g.calls[i] = d;
  g.ins[i] = in;
  g.outs[i] = out;
  g.present[i] = 1;
  const std::uint64_t gen = g.generation;
  if (++g.arrived == g.size()) {
    g.mismatch = mismatch_message("thread_comm", g.calls);
    if (g.mismatch.empty()) on_complete();
    g.arrived = 0;
    std::fill(g.present.begin(), g.present.end(), 0);
    ++g.generation;
    w.cv.notify_all();
  } else {
    thread_wait(lk, g, me, true, what, [&] { return g.generation != gen; });
  }
  return g.mismatch;
}

/// Barrier 2 (and the middle barrier of all_reduce): every rank is already inside the
/// collective and will arrive, so it waits without interruption.
inline void thread_sync(thread_group& g, int me) {
  thread_world& w = *g.world;
  std::unique_lock lk(w.m);
  const std::uint64_t gen = g.generation;
  if (++g.arrived == g.size()) {
    g.arrived = 0;
    ++g.generation;
    w.cv.notify_all();
  } else {
    thread_wait(lk, g, me, false, {}, [&] { return g.generation != gen; });
  }
}

inline void thread_posted_recv::wait() {
  thread_world& w = *group->world;
  std::unique_lock lk(w.m);
  const std::string what = describe(wait_site::p2p(wait_site::kind::recv, count, type, src, tag));
  try {
    thread_wait(lk, *group, me, true, what, [&] { return done; }, src);
  } catch (...) {
    auto& q = group->posted[static_cast<std::size_t>(me)];
    q.erase(std::remove_if(q.begin(), q.end(), [&](const auto& p) { return p.get() == this; }), q.end());
    throw;
  }
  if (!failure.empty()) throw error(failure);
}

inline bool thread_posted_recv::test() {
  thread_world& w = *group->world;
  std::unique_lock lk(w.m);
  if (done) {
    if (!failure.empty()) throw error(failure);
    return true;
  }
  if (w.aborted)
    throw error("thread_comm: " + describe(wait_site::p2p(wait_site::kind::recv, count, type, src, tag)) + " on rank " +
                std::to_string(me) + " failed: " + w.reason);
  return false;
}

inline std::string thread_p2p_mismatch(int src, int dst, int tag, std::size_t sent, dtype st, std::size_t want, dtype wt) {
  std::ostringstream os;
  os << "thread_comm: rank " << src << " sent count=" << sent << " " << dtype_name(st) << " with tag " << tag
     << " but rank " << dst << " posted recv count=" << want << " " << dtype_name(wt);
  return os.str();
}

/// A task of the async worker; its work_state.
struct thread_task final : work_state {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr failure;
  void finish(std::exception_ptr e) {
    std::lock_guard lk(m);
    failure = std::move(e);
    done = true;
    cv.notify_all();
  }
  void wait_quietly() {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return done; });
  }
  void wait() override {
    wait_quietly();
    if (failure) std::rethrow_exception(failure);
  }
  bool test() override {
    std::lock_guard lk(m);
    if (done && failure) std::rethrow_exception(failure);
    return done;
  }
};

/// Per-communicator worker thread running async collectives in issue order.
class thread_worker {
 public:
  thread_worker() : thread_([this] { run(); }) {}
  ~thread_worker() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  thread_worker(const thread_worker&) = delete;
  thread_worker& operator=(const thread_worker&) = delete;

  std::shared_ptr<thread_task> submit(std::function<void()> fn) {
    auto t = std::make_shared<thread_task>();
    {
      std::lock_guard lk(m_);
      queue_.emplace_back(t, std::move(fn));
      last_ = t;
    }
    cv_.notify_all();
    return t;
  }
  /// Whether something submitted has not finished yet.
  bool busy() {
    std::shared_ptr<thread_task> last;
    {
      std::lock_guard lk(m_);
      last = last_;
    }
    if (!last) return false;
    std::lock_guard lk(last->m);
    return !last->done;
  }
  /// Waits until everything submitted so far has finished (errors stay with their work).
  void drain() {
    std::shared_ptr<thread_task> last;
    {
      std::lock_guard lk(m_);
      last = last_;
    }
    if (last) last->wait_quietly();
  }

 private:
  void run() {
    for (;;) {
      std::pair<std::shared_ptr<thread_task>, std::function<void()>> job;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr e;
      try {
        job.second();
      } catch (...) {
        e = std::current_exception();
      }
      job.first->finish(std::move(e));
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<thread_task>, std::function<void()>>> queue_;
  std::shared_ptr<thread_task> last_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace detail

/// A group of thread ranks. Move-only; made by run_ranks or split. A default-constructed
/// thread_comm is a group of one rank.
class thread_comm : public collective_api<thread_comm> {
 public:
  thread_comm() : thread_comm(std::make_shared<detail::thread_group>(std::make_shared<detail::thread_world>(1), std::vector<int>{0}), 0) {}
  thread_comm(std::shared_ptr<detail::thread_group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  thread_comm(thread_comm&&) noexcept = default;
  thread_comm& operator=(thread_comm&& o) noexcept {
    if (this != &o) {
      wait_all();
      worker_.reset();
      g_ = std::move(o.g_);
      rank_ = o.rank_;
      worker_ = std::move(o.worker_);
    }
    return *this;
  }
  ~thread_comm() {
    // Leaving a scope by an exception with async collectives still queued: the peers may
    // wait for this rank elsewhere, so draining could hang. Fail the world first (pending
    // collectives then throw) and drain after.
    if (worker_ && std::uncaught_exceptions() > 0 && worker_->busy()) {
      std::lock_guard lk(g_->world->m);
      g_->world->abort_locked("rank " + std::to_string(rank_) +
                              " left a scope by an exception with async collectives still pending", world_rank());
    }
    wait_all();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return g_->size(); }
  /// This rank's index in the run_ranks world.
  int world_rank() const noexcept { return g_->members[static_cast<std::size_t>(rank_)]; }

  void barrier() {
    wait_all();
    const std::string mm = detail::thread_rendezvous(*g_, rank_, call_desc::make(call_kind::barrier), nullptr, nullptr, [] {});
    if (!mm.empty()) throw error(mm);
  }

  /// Ranks with the same color form a new group, ordered by (key, rank). color must be >= 0.
  thread_comm split(int color, int key) {
    LOOM_CHECK(color >= 0, "split: color=", color, " must be >= 0");
    wait_all();
    detail::thread_group& g = *g_;
    {
      std::lock_guard lk(g.world->m);
      g.colors[static_cast<std::size_t>(rank_)] = color;
      g.keys[static_cast<std::size_t>(rank_)] = key;
    }
    std::shared_ptr<detail::thread_group> mine;
    const std::string mm = detail::thread_rendezvous(g, rank_, call_desc::make(call_kind::split), nullptr, nullptr, [&g] {
      std::vector<int> order(g.members.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        const auto ua = static_cast<std::size_t>(a), ub = static_cast<std::size_t>(b);
        return std::pair(g.colors[ua], g.keys[ua]) < std::pair(g.colors[ub], g.keys[ub]);
      });
      for (std::size_t b = 0; b < order.size();) {
        std::size_t e = b;
        std::vector<int> members;
        while (e < order.size() && g.colors[static_cast<std::size_t>(order[e])] == g.colors[static_cast<std::size_t>(order[b])])
          members.push_back(g.members[static_cast<std::size_t>(order[e++])]);
        auto ng = std::make_shared<detail::thread_group>(g.world, std::move(members));
        for (std::size_t j = b; j < e; ++j) g.split_result[static_cast<std::size_t>(order[j])] = ng;
        b = e;
      }
    });
    if (!mm.empty()) throw error(mm);
    {
      std::lock_guard lk(g.world->m);
      mine = std::move(g.split_result[static_cast<std::size_t>(rank_)]);
    }
    const auto& m = mine->members;
    const int new_rank = static_cast<int>(std::find(m.begin(), m.end(), world_rank()) - m.begin());
    return thread_comm(std::move(mine), new_rank);
  }

  /// Waits for this communicator's outstanding async collectives (their errors stay with their work).
  void wait_all() {
    if (worker_) worker_->drain();
  }

 private:
  friend class collective_api<thread_comm>;

  template <class Body>
  work start(bool async, Body body) {
    if (!async) {
      wait_all();
      body();
      return {};
    }
    if (!worker_) worker_ = std::make_unique<detail::thread_worker>();
    return work(worker_->submit(std::move(body)));
  }

  // Runs a collective: rendezvous, the data movement `move(group, me)`, final barrier.
  template <class Move>
  static void collective(detail::thread_group& g, int me, const call_desc& d, const void* in, void* out, Move move) {
    const std::string mm = detail::thread_rendezvous(g, me, d, in, out, [] {});
    if (!mm.empty()) throw error(mm);
    move();
    detail::thread_sync(g, me);
  }

  work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) {
    return start(async, [g = g_, me = rank_, in, out, n, t] {
      collective(*g, me, call_desc::make(call_kind::all_gather, n, t), in, out, [&] {
        const std::size_t bytes = n * dtype_size(t);
        for (int s = 0; s < g->size(); ++s) {
          const void* src = g->ins[static_cast<std::size_t>(s)];
          void* dst = static_cast<std::byte*>(out) + static_cast<std::size_t>(s) * bytes;
          if (src != dst && bytes) std::memcpy(dst, src, bytes);
        }
      });
    });
  }
  work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return start(async, [g = g_, me = rank_, in, out, n, t, op] {
      collective(*g, me, call_desc::make(call_kind::reduce_scatter, n, t, op), in, out, [&] {
        if (n) reduce_into(t, op, g->ins, static_cast<std::size_t>(me) * n, out, n);
      });
    });
  }
  work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    return start(async, [g = g_, me = rank_, in, out, n, t, op] {
      const auto block = [&](int r) { return n * static_cast<std::size_t>(r) / static_cast<std::size_t>(g->size()); };
      const std::size_t es = dtype_size(t);
      collective(*g, me, call_desc::make(call_kind::all_reduce, n, t, op), in, out, [&] {
        // Each rank reduces its own block of all inputs into its output, then copies the
        // other blocks from their owners' outputs. In place works: block `me` of this
        // rank's buffer is touched by this rank only until the middle barrier.
        const std::size_t lo = block(me), hi = block(me + 1);
        if (hi > lo) reduce_into(t, op, g->ins, lo, static_cast<std::byte*>(out) + lo * es, hi - lo);
        detail::thread_sync(*g, me);
        for (int s = 0; s < g->size(); ++s) {
          const std::size_t a = block(s), b = block(s + 1);
          if (s != me && b > a)
            std::memcpy(static_cast<std::byte*>(out) + a * es, static_cast<const std::byte*>(g->outs[static_cast<std::size_t>(s)]) + a * es,
                        (b - a) * es);
        }
      });
    });
  }
  work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    return start(async, [g = g_, me = rank_, buf, n, t, root] {
      collective(*g, me, call_desc::make(call_kind::broadcast, n, t, reduce_op::sum, root), buf, buf, [&] {
        if (me != root && n) std::memcpy(buf, g->outs[static_cast<std::size_t>(root)], n * dtype_size(t));
      });
    });
  }

  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool /*async*/) {
    // Buffered: complete when this returns, so the async form is the blocking one.
    detail::thread_group& g = *g_;
    std::unique_lock lk(g.world->m);
    if (g.world->aborted)
      throw error("thread_comm: " + describe(wait_site::p2p(wait_site::kind::send, n, t, peer, tag)) + " on rank " +
                  std::to_string(rank_) + " failed: " + g.world->reason);
    auto& posted = g.posted[static_cast<std::size_t>(peer)];
    const auto it = std::find_if(posted.begin(), posted.end(), [&](const auto& p) { return p->src == rank_ && p->tag == tag; });
    if (it != posted.end()) {
      auto p = *it;
      posted.erase(it);
      p->done = true;
      if (p->count != n || p->type != t) {
        p->failure = detail::thread_p2p_mismatch(rank_, peer, tag, n, t, p->count, p->type);
        g.world->cv.notify_all();
        throw error(p->failure);
      }
      if (n) std::memcpy(p->out, in, n * dtype_size(t));
      g.world->cv.notify_all();
      return {};
    }
    detail::thread_message msg{rank_, tag, t, n, std::vector<std::byte>(n * dtype_size(t))};
    if (n) std::memcpy(msg.data.data(), in, n * dtype_size(t));
    g.unexpected[static_cast<std::size_t>(peer)].push_back(std::move(msg));
    return {};
  }

  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    detail::thread_group& g = *g_;
    std::shared_ptr<detail::thread_posted_recv> p;
    {
      std::unique_lock lk(g.world->m);
      if (g.world->aborted)
        throw error("thread_comm: " + describe(wait_site::p2p(wait_site::kind::recv, n, t, peer, tag)) + " on rank " +
                    std::to_string(rank_) + " failed: " + g.world->reason);
      auto& box = g.unexpected[static_cast<std::size_t>(rank_)];
      const auto it = std::find_if(box.begin(), box.end(), [&](const auto& m) { return m.src == peer && m.tag == tag; });
      if (it != box.end()) {
        detail::thread_message msg = std::move(*it);
        box.erase(it);
        LOOM_CHECK(msg.count == n && msg.type == t, detail::thread_p2p_mismatch(peer, rank_, tag, msg.count, msg.type, n, t));
        if (n) std::memcpy(out, msg.data.data(), n * dtype_size(t));
        return {};
      }
      p = std::make_shared<detail::thread_posted_recv>();
      p->group = g_;
      p->me = rank_;
      p->src = peer;
      p->tag = tag;
      p->type = t;
      p->count = n;
      p->out = out;
      g.posted[static_cast<std::size_t>(rank_)].push_back(p);
    }
    work w(std::move(p));
    if (!async) w.wait();
    return w;
  }

  std::shared_ptr<detail::thread_group> g_;
  int rank_ = 0;
  std::unique_ptr<detail::thread_worker> worker_;
};

static_assert(communicator<thread_comm>);

/// Runs fn(thread_comm&) on n threads, one per rank, and returns when all are done. If a
/// rank throws, the others' pending and future collectives throw loom::error instead of
/// waiting, and run_ranks rethrows the first failure.
template <class F>
  requires std::invocable<F&, thread_comm&>
void run_ranks(int n, F&& fn) {
  LOOM_CHECK(n >= 1, "run_ranks: number of ranks n=", n, " must be >= 1");
  auto world = std::make_shared<detail::thread_world>(n);
  std::vector<int> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  auto group = std::make_shared<detail::thread_group>(world, all);
  std::exception_ptr first;
  int first_rank = -1;
  auto body = [&](int r) {
    {
      thread_comm comm(group, r);
      try {
        fn(comm);
        comm.wait_all();
      } catch (...) {
        // Fail the world before `comm` drains its queued async work: the peers must stop
        // waiting for this rank first.
        std::string what = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        std::lock_guard lk(world->m);
        // The first failure wins, unless it was a consequence of this rank's own earlier
        // abort (a comm destroyed while this exception propagated).
        if (!first || (world->culprit == r && first_rank != r)) {
          first = std::current_exception();
          first_rank = r;
        }
        world->abort_locked("rank " + std::to_string(r) + " failed: " + what, r);
      }
    }
    std::lock_guard lk(world->m);
    world->exited[static_cast<std::size_t>(r)] = 1;
    world->cv.notify_all();
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 1; r < n; ++r) threads.emplace_back(body, r);
  body(0);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace loom::comm
