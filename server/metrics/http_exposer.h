// A minimal HTTP/1.x server for Prometheus scrapes: GET /metrics returns a text body; another path
// goes to the optional handler (the server's /livez and /readyz probes), else 404. One thread, one
// connection at a time (a scrape is a few kilobytes every few seconds).
//
// Why not prometheus::Exposer: its civetweb starts threads with a fixed, small stack size, and
// pthread_create refuses that (EINVAL) in a process whose libraries (LibTorch) need more static TLS
// than fits, so the exposer cannot start inside collabserve.
#ifndef COLLABSERVE_SERVER_METRICS_HTTP_EXPOSER_H_
#define COLLABSERVE_SERVER_METRICS_HTTP_EXPOSER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace collabserve::metrics {

// Thread-safe to destroy from any thread but its own; the destructor stops and joins the thread.
class HttpExposer {
 public:
  using BodyFn = std::function<std::string()>;
  struct Response {
    int code = 200;  // 200, 404 or 503
    std::string body;
  };
  // The answer for a GET of `path` (without its query), or nullopt for 404.
  using Handler = std::function<std::optional<Response>(const std::string& path)>;

  // Listens on `host:port` (port 0 picks one). UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& host, int port,
                                                            BodyFn body, Handler other = nullptr);
  ~HttpExposer();
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }

 private:
  HttpExposer(int listen_fd, int wake_read, int wake_write, int port, BodyFn body, Handler other);
  void Loop();
  void Serve(int fd);

  const int listen_fd_;
  const int wake_read_;   // becomes readable when the destructor wants the loop to stop
  const int wake_write_;
  const int port_;
  const BodyFn body_;
  const Handler other_;
  std::thread thread_;
};

}  // namespace collabserve::metrics

#endif  // COLLABSERVE_SERVER_METRICS_HTTP_EXPOSER_H_
