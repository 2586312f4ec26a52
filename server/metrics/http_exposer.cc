#include "server/metrics/http_exposer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/util/listen.h"
#include "server/util/status_macros.h"

namespace collabserve::metrics {
namespace {

void WriteAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    off += static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(const std::string& host, int port,
                                                                BodyFn body, Handler other) {
  ASSIGN_OR_RETURN(const util::ListeningSocket listening, util::ListenTcp(host, port, "metrics", 64));
  const int fd = listening.fd;
  const int bound_port = listening.port;
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("metrics pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<HttpExposer>(
      new HttpExposer(fd, wake[0], wake[1], bound_port, std::move(body), std::move(other)));
}

HttpExposer::HttpExposer(int listen_fd, int wake_read, int wake_write, int port, BodyFn body,
                         Handler other)
    : listen_fd_(listen_fd),
      wake_read_(wake_read),
      wake_write_(wake_write),
      port_(port),
      body_(std::move(body)),
      other_(std::move(other)),
      thread_([this] { Loop(); }) {}

HttpExposer::~HttpExposer() {
  const char c = 'x';
  (void)!::write(wake_write_, &c, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
}

void HttpExposer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        Serve(fd);
        ::close(fd);
      }
    }
  }
}

void HttpExposer::Serve(int fd) {
  // Read the request head (bounded in size and time).
  std::string head;
  char buf[4096];
  while (head.find("\r\n\r\n") == std::string::npos && head.find("\n\n") == std::string::npos &&
         head.size() < 16384) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) return;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    head.append(buf, static_cast<size_t>(n));
  }
  const std::string line = head.substr(0, head.find_first_of("\r\n"));
  std::string status = "200 OK", body, type = "text/plain; version=0.0.4; charset=utf-8";
  if (!absl::StartsWith(line, "GET ")) {
    status = "405 Method Not Allowed";
    body = "only GET /metrics\n";
  } else {
    std::string path = line.substr(4, line.find(' ', 4) - 4);
    path = path.substr(0, path.find('?'));
    std::optional<Response> answer;
    if (path == "/metrics") {
      body = body_();
    } else if (other_ && (answer = other_(path)).has_value()) {
      type = "text/plain; charset=utf-8";
      status = answer->code == 200   ? "200 OK"
               : answer->code == 404 ? "404 Not Found"
                                     : "503 Service Unavailable";
      body = std::move(answer->body);
    } else {
      status = "404 Not Found";
      body = "see /metrics\n";
    }
  }
  WriteAll(fd, absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                            "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                            body));
}

}  // namespace collabserve::metrics
