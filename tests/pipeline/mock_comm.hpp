#pragma once
// A point-to-point-only communicator for the executor tests, with rendezvous sends: a send
// completes only when the receiver took the message (the strictest semantics, under which the
// schedules are proven). Waits time out with loom::error instead of hanging a test.
#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <span>

namespace mock {

struct message {
  int src, dst, tag;
  const void* data;
  std::size_t bytes;
  bool taken = false;
};

struct world {
  explicit world(int n) : size(n) {}
  int size;
  std::mutex mu;
  std::condition_variable cv;
  std::list<std::shared_ptr<message>> posted;
  static constexpr auto timeout = std::chrono::seconds(20);
};

class send_state final : public loom::comm::work_state {
 public:
  send_state(std::shared_ptr<world> w, std::shared_ptr<message> m) : w_(std::move(w)), m_(std::move(m)) {}
  void wait() override {
    std::unique_lock lk(w_->mu);
    LOOM_CHECK(w_->cv.wait_for(lk, world::timeout, [&] { return m_->taken; }), "mock_comm: send to ", m_->dst,
               " tag ", m_->tag, " never received");
  }
  bool test() override {
    std::lock_guard lk(w_->mu);
    return m_->taken;
  }

 private:
  std::shared_ptr<world> w_;
  std::shared_ptr<message> m_;
};

class comm {
 public:
  comm(std::shared_ptr<world> w, int rank) : w_(std::move(w)), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return w_->size; }

  template <class T>
  loom::comm::work send_async(std::span<const T> in, int peer, int tag) {
    auto m = std::make_shared<message>(message{rank_, peer, tag, in.data(), in.size_bytes()});
    {
      std::lock_guard lk(w_->mu);
      w_->posted.push_back(m);
    }
    w_->cv.notify_all();
    return loom::comm::work(std::make_shared<send_state>(w_, m));
  }
  template <class T>
  void send(std::span<const T> in, int peer, int tag) {
    send_async(in, peer, tag).wait();
  }
  template <class T>
  void recv(std::span<T> out, int peer, int tag) {
    std::unique_lock lk(w_->mu);
    std::shared_ptr<message> m;
    const bool got = w_->cv.wait_for(lk, world::timeout, [&] {
      for (auto it = w_->posted.begin(); it != w_->posted.end(); ++it)
        if ((*it)->src == peer && (*it)->dst == rank_ && (*it)->tag == tag) {
          m = *it;
          w_->posted.erase(it);
          return true;
        }
      return false;
    });
    LOOM_CHECK(got, "mock_comm: rank ", rank_, " never received tag ", tag, " from ", peer);
    LOOM_CHECK(m->bytes == out.size_bytes(), "mock_comm: size mismatch");
    std::memcpy(out.data(), m->data, m->bytes);
    m->taken = true;
    lk.unlock();
    w_->cv.notify_all();
  }
  template <class T>
  loom::comm::work recv_async(std::span<T> out, int peer, int tag) {
    recv(out, peer, tag);
    return {};
  }

  // Collectives are not needed by the executor.
  template <class A, class B>
  void all_gather(A, B) { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A, class B>
  void reduce_scatter(A, B, loom::comm::reduce_op) { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A, class B>
  void all_reduce(A, B, loom::comm::reduce_op) { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A>
  void broadcast(A, int) { LOOM_THROW("mock_comm: point-to-point only"); }
  void barrier() { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A, class B>
  loom::comm::work all_gather_async(A, B) { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A, class B>
  loom::comm::work reduce_scatter_async(A, B, loom::comm::reduce_op) { LOOM_THROW("mock_comm: point-to-point only"); }
  template <class A, class B>
  loom::comm::work all_reduce_async(A, B, loom::comm::reduce_op) { LOOM_THROW("mock_comm: point-to-point only"); }
  comm split(int, int) { LOOM_THROW("mock_comm: point-to-point only"); }

 private:
  std::shared_ptr<world> w_;
  int rank_;
};

static_assert(loom::comm::communicator<comm>);

}  // namespace mock
