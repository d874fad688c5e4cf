#pragma once
// A raw loopback HTTP client for the server tests: what httplib's client will not send
// (a body cut short, headers a byte at a time, a declared length with no body) and reading
// with a bound on time. Connects to 127.0.0.1 only.

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <string_view>

namespace serve_test {

using clock = std::chrono::steady_clock;

class raw_client {
 public:
  explicit raw_client(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~raw_client() { close(); }
  raw_client(const raw_client&) = delete;
  raw_client& operator=(const raw_client&) = delete;

  bool connected() const noexcept { return connected_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Sends all of s; false once the server has closed the connection.
  bool send(std::string_view s) {
    while (!s.empty()) {
      const ssize_t n = ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      s.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }
  /// Reads one response: headers, then a Content-Length body or up to the close; at most `t`.
  std::string response(std::chrono::milliseconds t) {
    const auto until = clock::now() + t;
    std::string in;
    for (;;) {
      const auto head = in.find("\r\n\r\n");
      if (head != std::string::npos) {
        const auto cl = lower(in.substr(0, head)).find("content-length: ");
        if (cl != std::string::npos && in.size() >= head + 4 + std::stoul(in.substr(cl + 16))) break;
      }
      if (!read_some(in, until)) break;
    }
    return in;
  }
  /// True when the server closes the connection within `t` (reading and dropping what comes).
  bool closed_within(std::chrono::milliseconds t) {
    const auto until = clock::now() + t;
    std::string sink;
    while (clock::now() < until) {
      sink.clear();
      if (!read_some(sink, until)) return clock::now() < until;
    }
    return false;
  }
  /// Reads what arrives within `t` (false: closed or nothing came).
  bool read_some(std::string& out, clock::time_point until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) return false;
    out.append(buf, static_cast<std::size_t>(n));
    return true;
  }

  static std::string lower(std::string s) {
    for (auto& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    return s;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

/// The status code of a raw response ("HTTP/1.1 413 ..."), 0 when there is none.
inline int status_of(const std::string& r) {
  if (r.rfind("HTTP/1.", 0) != 0 || r.size() < 12) return 0;
  return std::stoi(r.substr(9, 3));
}
inline std::string body_of(const std::string& r) {
  const auto head = r.find("\r\n\r\n");
  return head == std::string::npos ? std::string() : r.substr(head + 4);
}
/// A POST with the given extra header lines (each ending in \r\n) and body.
inline std::string post(const std::string& path, const std::string& body, const std::string& headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n" + headers + "\r\n" + body;
}

}  // namespace serve_test
