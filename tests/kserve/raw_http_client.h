// A raw-socket HTTP/1.1 client for the REST endpoint's tests (kserve_http_test, tei_http_test):
// plain or TLS, it writes exactly the bytes it is given and reads whole responses, so that every
// byte on the wire is the test's.
#ifndef COLLABSERVE_TESTS_KSERVE_RAW_HTTP_CLIENT_H_
#define COLLABSERVE_TESTS_KSERVE_RAW_HTTP_CLIENT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace collabserve::service {

struct Reply {
  int code = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  std::string Header(const std::string& name) const {
    for (const auto& [n, v] : headers) {
      if (n == name) return v;
    }
    return "";
  }
  nlohmann::json Json() const { return nlohmann::json::parse(body, nullptr, false); }
};

// One client connection, plain or TLS, that writes what it is given and reads whole responses.
class Client {
 public:
  // Connects to 127.0.0.1:port; with `ssl_ctx`, makes a TLS handshake (false from ok() if refused).
  explicit Client(int port, SSL_CTX* ssl_ctx = nullptr, SSL_SESSION* session = nullptr) {
    ::signal(SIGPIPE, SIG_IGN);  // SSL_write to a connection the server closed
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{10, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (ok_ && ssl_ctx != nullptr) {
      ssl_ = SSL_new(ssl_ctx);
      SSL_set_fd(ssl_, fd_);
      SSL_set_tlsext_host_name(ssl_, "localhost");
      if (session != nullptr) SSL_set_session(ssl_, session);
      ok_ = SSL_connect(ssl_) == 1;
      // TLS 1.3: a refused client certificate shows at the first read.
    }
  }
  ~Client() {
    if (ssl_ != nullptr) {
      SSL_shutdown(ssl_);  // a session ended without close_notify is not resumed
      SSL_free(ssl_);
    }
    ::close(fd_);
  }
  bool ok() const { return ok_; }
  SSL* ssl() const { return ssl_; }

  bool Send(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ssl_ != nullptr
                            ? SSL_write(ssl_, bytes.data() + off, static_cast<int>(bytes.size() - off))
                            : ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  // The next whole response, or nullopt when the connection ends first.
  std::optional<Reply> Read() {
    size_t head_end;
    while ((head_end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return std::nullopt;
    }
    Reply r;
    const std::string head = buf_.substr(0, head_end);
    buf_.erase(0, head_end + 4);
    std::vector<std::string> lines = absl::StrSplit(head, "\r\n");
    if (lines.empty() || !absl::StartsWith(lines[0], "HTTP/1.1 ") ||
        !absl::SimpleAtoi(lines[0].substr(9, 3), &r.code)) {
      ADD_FAILURE() << "bad status line: " << lines[0];
      return std::nullopt;
    }
    size_t length = 0;
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
      std::string value(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
      if (name == "content-length") {
        EXPECT_TRUE(absl::SimpleAtoi(value, &length));
      }
      r.headers.emplace_back(std::move(name), std::move(value));
    }
    if (r.code != 100 && !head_only_) {
      while (buf_.size() < length) {
        if (!Fill()) return std::nullopt;
      }
      r.body = buf_.substr(0, length);
      buf_.erase(0, length);
    }
    return r;
  }

  // True once the server has closed the connection (and nothing more is buffered): an end of
  // stream or a reset, not the client's own 10 s timeout.
  bool Closed() { return buf_.empty() && !Fill() && !timed_out_; }
  void HeadOnly(bool head_only) { head_only_ = head_only; }

 private:
  bool Fill() {
    char chunk[65536];
    errno = 0;
    const ssize_t n = ssl_ != nullptr ? SSL_read(ssl_, chunk, sizeof(chunk))
                                      : ::recv(fd_, chunk, sizeof(chunk), 0);
    timed_out_ = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    if (n <= 0) return false;
    buf_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  SSL* ssl_ = nullptr;
  bool ok_ = false;
  bool head_only_ = false;
  bool timed_out_ = false;
  std::string buf_;
};

inline std::string Request(const std::string& method, const std::string& path,
                           const std::string& body = "", const std::string& extra_headers = "") {
  std::string r = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: localhost\r\n", extra_headers);
  if (!body.empty() || method == "POST") absl::StrAppend(&r, "Content-Length: ", body.size(), "\r\n");
  return absl::StrCat(r, "\r\n", body);
}

// One request on a new connection.
inline Reply Call(int port, const std::string& method, const std::string& path,
                  const std::string& body = "", const std::string& extra_headers = "") {
  Client c(port);
  EXPECT_TRUE(c.ok());
  EXPECT_TRUE(c.Send(Request(method, path, body, extra_headers)));
  std::optional<Reply> r = c.Read();
  EXPECT_TRUE(r.has_value()) << method << " " << path << ": no response";
  return r.value_or(Reply{});
}

}  // namespace collabserve::service

#endif  // COLLABSERVE_TESTS_KSERVE_RAW_HTTP_CLIENT_H_
