#pragma once
// http_guard: cpp-httplib's server with the deadlines and limits a shared endpoint needs.
//
// Why: httplib 0.11 reads a request line and its headers a byte at a time with a timeout per
// read only, so a client that sends one byte a second holds a worker thread as long as it
// likes, and a fixed pool of workers is held by as many slow clients; it has no bound on the
// total size of the headers either. Its per-connection loop is a virtual function, so
// http::server replaces it with one over its own socket stream, which
//  - waits at most `idle_timeout` for the first byte of each request on a connection,
//  - gives the request line, the headers and the body `read_timeout` in all (a deadline, not
//    a timeout per read) and refuses more than `max_header_bytes` before the body,
// and runs on a pool that, when every worker is taken, evicts the connection that has waited
// longest for a request or for its bytes: slow clients then delay a new client by one
// eviction, not by a timeout. A handler reaches its connection with http::server::current()
// to mark the end of reading (begin_work) and to ask whether the client is still there.
// POSIX sockets (Linux, macOS).

#include <httplib.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace loom::serve::http {

// The cpp-httplib versions this file builds against: [min, end). It overrides internals of
// httplib::Server (its per-connection loop, its task queue) and httplib::Stream, which match
// these signatures only there: Stream::get_local_ip_and_port appears in 0.11.4, TaskQueue::enqueue
// returns bool from 0.15.0 (and Server::process_request changes in 0.18.0). find_httplib.cmake
// reads these two lines to check the version at configure time.
inline constexpr char httplib_min_version[] = "0.11.4";
inline constexpr char httplib_end_version[] = "0.15.0";

namespace detail {
// "0.11.4" -> 1104: major * 10000 + minor * 100 + patch
constexpr int version_number(const char* s) {
  int part[3] = {0, 0, 0};
  for (int i = 0; *s && i < 3; ++s) {
    if (*s == '.')
      ++i;
    else
      part[i] = part[i] * 10 + (*s - '0');
  }
  return part[0] * 10000 + part[1] * 100 + part[2];
}
// A compiler names the template argument where the assertion fails: the version found.
template <int FoundMajor, int FoundMinor, int FoundPatch>
struct httplib_version_check {
  static constexpr int found = FoundMajor * 10000 + FoundMinor * 100 + FoundPatch;
  static_assert(found >= version_number(httplib_min_version) && found < version_number(httplib_end_version),
                "loom/serve/http_guard.hpp needs cpp-httplib >= 0.11.4 and < 0.15.0 (httplib_min_version, httplib_end_version); "
                "the CPPHTTPLIB_VERSION found is this template's arguments <major, minor, patch>");
  static constexpr bool ok = true;
};
static_assert(httplib_version_check<version_number(CPPHTTPLIB_VERSION) / 10000, version_number(CPPHTTPLIB_VERSION) / 100 % 100,
                                    version_number(CPPHTTPLIB_VERSION) % 100>::ok);
}  // namespace detail

using clock = std::chrono::steady_clock;

struct limits {
  std::int32_t threads = 128;                        ///< connections served at once
  std::chrono::milliseconds idle_timeout{5000};      ///< wait for the first byte of a request
  std::chrono::milliseconds read_timeout{10000};     ///< request line + headers + body, in all
  std::chrono::milliseconds write_timeout{10000};    ///< one write to a client that does not read
  std::size_t max_header_bytes = 64 * 1024;          ///< request line and headers together
  std::int32_t max_requests_per_connection = 100;    ///< keep-alive requests before closing
};

/// One accepted connection, as its handler sees it.
class connection {
 public:
  enum class phase { idle, reading, working };
  explicit connection(int fd) : fd_(fd) { set_phase(phase::idle); }

  /// The handler has its request and now works on it: no read deadline, never evicted.
  void begin_work() { set_phase(phase::working); }
  /// Close the connection after this response (a refused body was left unread).
  void close_after() noexcept { close_after_ = true; }
  /// True once the client has closed or reset the connection (or it was evicted).
  bool client_gone() const {
    if (evicted_) return true;
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

 private:
  friend class server;
  friend class stream;
  void set_phase(phase p) {
    since_ = clock::now().time_since_epoch().count();
    phase_ = p;
  }
  int fd_;
  std::atomic<phase> phase_{phase::idle};
  std::atomic<clock::rep> since_{0};
  std::atomic<bool> evicted_{false};
  bool close_after_ = false;
};

/// httplib's Stream over a connection's socket, with the request deadline and header budget.
class stream final : public httplib::Stream {
 public:
  stream(connection& c, const limits& l) : c_(c), lim_(l), buf_(4096) {}

  /// Waits for the first byte of the next request (it may already be buffered).
  bool wait_request() const { return pos_ < end_ || wait(POLLIN, clock::now() + lim_.idle_timeout); }
  /// A request starts: its line, headers and body must arrive before the deadline.
  void begin_request() {
    deadline_ = clock::now() + lim_.read_timeout;
    header_bytes_ = 0;
    in_headers_ = true;
  }
  void end_headers() noexcept { in_headers_ = false; }
  /// False when the last request's line or headers never arrived whole (cut, too big, late).
  bool headers_read() const noexcept { return !in_headers_; }

  bool is_readable() const override { return pos_ < end_ || wait(POLLIN, read_deadline()); }
  bool is_writable() const override {
    return wait(POLLOUT, clock::now() + lim_.write_timeout) && !c_.client_gone();
  }
  ssize_t read(char* p, std::size_t n) override {
    if (pos_ == end_) {
      if (c_.evicted_ || !wait(POLLIN, read_deadline())) return -1;
      ssize_t got;
      do got = ::recv(c_.fd_, buf_.data(), buf_.size(), 0);
      while (got < 0 && errno == EINTR);
      if (got <= 0) return got;
      pos_ = 0;
      end_ = static_cast<std::size_t>(got);
    }
    const std::size_t k = std::min(n, end_ - pos_);
    if (in_headers_ && (header_bytes_ += k) > lim_.max_header_bytes) return -1;
    std::memcpy(p, buf_.data() + pos_, k);
    pos_ += k;
    return static_cast<ssize_t>(k);
  }
  ssize_t write(const char* p, std::size_t n) override {
    if (c_.evicted_ || !wait(POLLOUT, clock::now() + lim_.write_timeout)) return -1;
    ssize_t put;
    do put = ::send(c_.fd_, p, n, MSG_NOSIGNAL);
    while (put < 0 && errno == EINTR);
    return put;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return c_.fd_; }

 private:
  clock::time_point read_deadline() const {
    // While the handler works (a streamed response), reads are not expected; keep them short.
    return c_.phase_ == connection::phase::working ? clock::now() + lim_.write_timeout : deadline_;
  }
  // Polls for `events` until `until`; false on timeout.
  bool wait(short events, clock::time_point until) const {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now()).count();
      if (left <= 0) return false;
      pollfd p{c_.fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return false;
      if (c_.evicted_) return false;
    }
  }
  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    ip.clear();
    port = 0;
    if ((peer ? ::getpeername(c_.fd_, reinterpret_cast<sockaddr*>(&a), &len)
              : ::getsockname(c_.fd_, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
      return;
    char text[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
      ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
      port = ntohs(v6->sin6_port);
    }
    ip = text;
  }

  connection& c_;
  const limits& lim_;
  std::vector<char> buf_;
  std::size_t pos_ = 0, end_ = 0;
  clock::time_point deadline_ = clock::time_point::max();
  std::size_t header_bytes_ = 0;
  bool in_headers_ = false;
};

class server : public httplib::Server {
 public:
  explicit server(limits l = {}) : lim_(l) {
    new_task_queue = [this] {
      auto* p = new pool(*this, static_cast<std::size_t>(std::max(1, lim_.threads)));
      pool_ = p;
      return p;
    };
  }
  const limits& config() const noexcept { return lim_; }

  /// The connection the calling handler serves; nullptr off the server's worker threads.
  static connection* current() noexcept { return current_; }
  /// Connections closed to make room for new ones so far.
  std::int64_t evictions() const noexcept { return evictions_.load(); }
  /// Closes every open connection (after stop(): workers need not wait for idle clients).
  void close_all() {
    std::lock_guard g(mu_);
    for (connection* c : live_) evict(*c);
  }

 private:
  // Threads taking accepted connections. Every connection waiting for a thread is owed one:
  // the connection that has waited longest for request bytes is closed to free it.
  class pool final : public httplib::TaskQueue {
   public:
    // A thread counts as idle from its creation, not from its first wait: connections accepted
    // before the new threads are scheduled are owed those threads, and must not be evicted.
    pool(server& s, std::size_t n) : s_(s), idle_(n) {
      for (std::size_t i = 0; i < n; ++i) threads_.emplace_back([this] { work(); });
    }
    void enqueue(std::function<void()> fn) override {
      bool full;
      {
        std::lock_guard g(mu_);
        jobs_.push_back(std::move(fn));
        full = jobs_.size() > idle_;
      }
      cv_.notify_one();
      if (full) s_.make_room();
    }
    /// Connections waiting for a thread beyond the threads about to take them.
    std::ptrdiff_t backlog() {
      std::lock_guard g(mu_);
      return static_cast<std::ptrdiff_t>(jobs_.size()) - static_cast<std::ptrdiff_t>(idle_);
    }
    void shutdown() override {
      s_.pool_ = nullptr;
      {
        std::lock_guard g(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      for (auto& t : threads_) t.join();
    }

   private:
    void work() {
      std::unique_lock g(mu_);
      for (;;) {
        cv_.wait(g, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping
        auto fn = std::move(jobs_.front());
        jobs_.pop_front();
        --idle_;
        g.unlock();
        fn();
        g.lock();
        ++idle_;
      }
    }
    server& s_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> jobs_;
    std::size_t idle_;  // threads not running a job
    bool stop_ = false;
    std::vector<std::thread> threads_;  // last: started once the rest is made
  };

  bool process_and_close_socket(socket_t sock) override {
    connection c(sock);
    {
      std::lock_guard g(mu_);
      live_.push_back(&c);
    }
    stream s(c, lim_);
    current_ = &c;
    make_room();  // connections accepted in a burst may still wait behind this one
    bool ok = true;
    for (int left = lim_.max_requests_per_connection; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
      c.set_phase(connection::phase::idle);
      if (!s.wait_request() || c.evicted_) break;
      c.set_phase(connection::phase::reading);
      s.begin_request();
      bool closed = false;
      ok = process_request(s, left == 1, closed, [&s](httplib::Request&) { s.end_headers(); });
      // A request whose headers did not arrive got a 400: whatever follows is not a request.
      if (!ok || closed || !s.headers_read() || c.close_after_ || c.evicted_) break;
    }
    current_ = nullptr;
    {
      // The socket is closed only once no evictor can reach it (its number may be reused).
      std::lock_guard g(mu_);
      live_.erase(std::find(live_.begin(), live_.end(), &c));
    }
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // Evicts as many connections as wait for a thread, less those already being evicted,
  // oldest in waiting first; connections at work are never evicted.
  void make_room() {
    pool* p = pool_;
    std::ptrdiff_t need = p ? p->backlog() : 0;
    std::lock_guard g(mu_);
    for (connection* c : live_) need -= c->evicted_ ? 1 : 0;
    for (; need > 0; --need) {
      connection* oldest = nullptr;
      for (connection* c : live_) {
        if (c->phase_ == connection::phase::working || c->evicted_) continue;
        if (!oldest || c->since_ < oldest->since_) oldest = c;
      }
      if (!oldest) break;
      evict(*oldest);
      ++evictions_;
    }
  }
  // Under mu_: the connection's worker wakes from poll or recv and closes it.
  static void evict(connection& c) {
    c.evicted_ = true;
    ::shutdown(c.fd_, SHUT_RDWR);
  }

  limits lim_;
  std::atomic<pool*> pool_{nullptr};  // while listening
  std::mutex mu_;
  std::vector<connection*> live_;
  std::atomic<std::int64_t> evictions_{0};
  inline static thread_local connection* current_ = nullptr;
};

}  // namespace loom::serve::http
