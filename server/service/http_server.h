// An HTTP/1.1 server for request/response APIs (the Open Inference Protocol's REST form,
// kserve_http.h): one thread per connection up to a bound, persistent connections and pipelined
// requests, Content-Length and chunked request bodies, `Expect: 100-continue`, HEAD, gzip and
// deflate request bodies (Content-Encoding; inflated within the body limit) and gzip responses
// that the handler marks compressible (HttpResponse), and TLS (and mutual TLS) on the same files
// as the gRPC ports, followed on disk as they are.
//
// Why not civetweb (Debian's libcivetweb): it starts its threads with a fixed, small stack, which
// pthread_create refuses in a process whose libraries (LibTorch) need more static TLS than fits
// (metrics/http_exposer.h). These threads have the default stack.
#ifndef COLLABSERVE_SERVER_SERVICE_HTTP_SERVER_H_
#define COLLABSERVE_SERVER_SERVICE_HTTP_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/service/tls.h"

namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace collabserve::service {

struct HttpRequest {
  std::string method;  // as sent ("GET", "POST"); HEAD comes as HEAD
  std::string path;    // the target before '?', still percent-encoded
  std::string query;   // after '?', without it
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, values trimmed
  std::string body;    // de-chunked
  // True once the client has closed its side of the connection (POLLRDHUP: a client that
  // half-closes after its request counts as gone, as nginx counts it): a handler that waits on
  // long work polls it to cancel that work. Set by the server.
  std::function<bool()> client_gone = [] { return false; };
  // The first header of that (lower-case) name, or null.
  const std::string* Header(std::string_view name) const;
};

struct HttpResponse {
  int code = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones
  // Gzipped (1 KiB or more) for a client whose Accept-Encoding takes gzip. Off by default: some
  // clients ask for gzip and then read the raw body (tritonclient.http.aio outside infer).
  bool compressible = false;
};

// Called on the connection's thread, one request at a time per connection, concurrently across
// connections; may block (the connection waits). An exception becomes a 500.
using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;  // 0 picks a free one (HttpServer::port())
  // Connections open at once; one more is answered 503 and closed.
  int max_connections = 256;
  // A request body larger than this is answered 413 (before it is read) and the connection closed.
  int64_t max_body_bytes = 16 << 20;
  // The deadline of each phase of a connection (the class comment): waiting for a request, and
  // reading its head, each this long; its body and the response this long plus their size at
  // 64 KiB/s. Past it the connection is closed (a request cut off is answered 408 if it can be).
  absl::Duration idle_timeout = absl::Seconds(60);
  // TLS as the gRPC ports (tls.h): the files are checked at Start and read again every
  // reload_interval; a changed pair serves the connections accepted after it, and a pair that no
  // longer loads leaves the last good one serving (logged).
  TlsFiles tls;
};

// The options' values that Start refuses, INVALID_ARGUMENT naming the flag (--http_port 0-65535,
// --http_max_connections 1-65536, --http_idle_timeout_s 0.001-86400); the TLS files are not read.
absl::Status CheckHttpServerOptions(const HttpServerOptions& options);

// Percent-decodes one segment of a request's path (HttpRequest::path keeps the escapes) into
// `out`; false for a malformed escape.
bool PercentDecodeSegment(std::string_view in, std::string* out);

// "HTTP/1.1 <code> <reason>": the reason phrase of the codes this server and its handlers use.
const char* HttpReason(int code);

// Thread-safe. Each connection phase has a deadline, kept by a watchdog: a TLS handshake 10 s (at
// most idle_timeout), the wait for a request and the read of its head idle_timeout, its body and
// the response idle_timeout plus their size at 64 KiB/s; a connection past it is cut. The
// handler's own time has none. An error answered before the request was read whole (413, 431,
// 400...) is followed by a lingering close, so that the client reads it rather than a reset.
// The destructor stops accepting and closes every connection except those whose handler runs:
// each of those finishes, and its response gets a second to be sent (Connection: close). Then it
// joins every thread.
class HttpServer {
 public:
  // Listens on host:port. UNAVAILABLE if the address cannot be bound, INVALID_ARGUMENT for bad
  // options (naming the option), the TLS files' errors (CheckCertificateFiles).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           HttpHandler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The drain's first step: keep-alive connections waiting for their next request are closed,
  // and every response from now on closes its connection, so that keep-alive clients reconnect
  // (through the Service, to another pod) while the server finishes what is in flight; a new
  // connection still gets its one answer. Idempotent.
  void BeginDrain();

  int port() const;
  bool tls() const;
  // Connections open now.
  int connections() const;

  // What the server has done, read at each scrape (it may outlive the server; its counts then
  // stay as they were):
  //   collabserve_http_responses_total{code}       responses, by status code, counted as their
  //                                                write begins (errors answered before a
  //                                                request was read whole too)
  //   collabserve_http_connections                 connections open
  //   collabserve_http_connections_refused_total   connections refused at --http_max_connections
  //                                                (or a thread that could not start)
  //   collabserve_http_connections_cut_total       connections cut past a phase's deadline (slow
  //                                                clients, kept by the watchdog)
  //   collabserve_http_tls_handshake_failures_total
  std::shared_ptr<prometheus::Collectable> NewCollectable() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_HTTP_SERVER_H_
