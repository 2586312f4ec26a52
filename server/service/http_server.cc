#include "server/service/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <list>
#include <optional>
#include <thread>
#include <utility>

#include <glog/logging.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::service {
namespace {

constexpr size_t kMaxHeadBytes = 16 << 10;

std::string OpenSslError() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

using SslCtxPtr = std::shared_ptr<SSL_CTX>;

// An SSL_CTX on the files as they are now.
absl::StatusOr<SslCtxPtr> NewSslContext(const TlsFiles& files) {
  ERR_clear_error();
  SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()), SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert ", files.cert_file, ": ", OpenSslError()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", files.key_file, ": ", OpenSslError()));
  }
  if (!files.client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx.get(), files.client_ca_file.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", files.client_ca_file, ": ", OpenSslError()));
    }
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.client_ca_file.c_str())) {
      SSL_CTX_set_client_CA_list(ctx.get(), names);
    }
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  static const unsigned char kAlpn[] = "\x08http/1.1";
  SSL_CTX_set_alpn_select_cb(
      ctx.get(),
      [](SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in,
         unsigned int inlen, void*) {
        unsigned char* selected = nullptr;
        if (SSL_select_next_proto(&selected, outlen, kAlpn, sizeof(kAlpn) - 1, in, inlen) !=
            OPENSSL_NPN_NEGOTIATED) {
          return SSL_TLSEXT_ERR_NOACK;  // no ALPN answer; the client may still speak HTTP/1.1
        }
        *out = selected;
        return SSL_TLSEXT_ERR_OK;
      },
      nullptr);
  return ctx;
}

// The SSL_CTX of the files, built again when their bytes change (checked at most once per
// reload_interval, when a connection is accepted).
class SslContextFollower {
 public:
  explicit SslContextFollower(TlsFiles files) : files_(std::move(files)) {}

  absl::Status Init() {
    absl::MutexLock lock(&mu_);
    contents_ = ReadAll();
    ASSIGN_OR_RETURN(ctx_, NewSslContext(files_));
    checked_ = absl::Now();
    return absl::OkStatus();
  }

  SslCtxPtr Current() {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - checked_ < files_.reload_interval) return ctx_;
    checked_ = now;
    std::string contents = ReadAll();
    if (contents == contents_) return ctx_;
    absl::StatusOr<SslCtxPtr> ctx = NewSslContext(files_);
    if (!ctx.ok()) {
      // gRPC's provider keeps the last pair too; the next check tries again.
      LOG(WARNING) << "HTTP: the TLS files changed and do not load; serving the last pair: "
                   << ctx.status();
      return ctx_;
    }
    LOG(INFO) << "HTTP: TLS files changed on disk; new connections get the new certificate";
    contents_ = std::move(contents);
    ctx_ = *std::move(ctx);
    return ctx_;
  }

 private:
  std::string ReadAll() const {
    std::string all;
    for (const std::string* f : {&files_.cert_file, &files_.key_file, &files_.client_ca_file}) {
      if (f->empty()) continue;
      absl::StatusOr<std::string> bytes = util::ReadFile(*f);
      all += bytes.ok() ? *bytes : std::string("\0missing", 8);
      all += '\0';
    }
    return all;
  }

  const TlsFiles files_;
  absl::Mutex mu_;
  std::string contents_ ABSL_GUARDED_BY(mu_);
  SslCtxPtr ctx_ ABSL_GUARDED_BY(mu_);
  absl::Time checked_ ABSL_GUARDED_BY(mu_);
};

// One connection's byte stream, plain or TLS. The socket's timeouts bound every call.
class Stream {
 public:
  Stream(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  ~Stream() {
    if (ssl_ != nullptr) {
      SSL_shutdown(ssl_);
      SSL_free(ssl_);
    }
  }
  // > 0 bytes read; 0 the peer closed; < 0 an error or the timeout.
  ssize_t Read(char* buf, size_t n) {
    if (ssl_ != nullptr) {
      const int r = SSL_read(ssl_, buf, static_cast<int>(std::min<size_t>(n, 1 << 30)));
      if (r > 0) return r;
      return SSL_get_error(ssl_, r) == SSL_ERROR_ZERO_RETURN ? 0 : -1;
    }
    for (;;) {
      const ssize_t r = ::recv(fd_, buf, n, 0);
      if (r < 0 && errno == EINTR) continue;
      return r;
    }
  }
  bool WriteAll(std::string_view data) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n;
      if (ssl_ != nullptr) {
        n = SSL_write(ssl_, data.data() + off,
                      static_cast<int>(std::min<size_t>(data.size() - off, 1 << 30)));
      } else {
        n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
      }
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

 private:
  const int fd_;
  SSL* const ssl_;
};

// Why a request could not be read: the answer to send (0: none, just close).
struct ReadFailure {
  int code = 0;
  std::string message;
};

class RequestReader {
 public:
  RequestReader(Stream* stream, int64_t max_body) : stream_(stream), max_body_(max_body) {}

  // The next request, or the failure. `idle` is set when the connection closed or timed out
  // cleanly between requests.
  std::optional<HttpRequest> Next(ReadFailure* failure, bool* version_1_0, bool* idle) {
    *idle = false;
    size_t head_end;
    for (;;) {
      head_end = buf_.find("\r\n\r\n");
      if (head_end != std::string::npos && head_end <= kMaxHeadBytes) {
        head_end += 4;
        break;
      }
      if (buf_.size() > kMaxHeadBytes) {
        *failure = {431, absl::StrCat("request head over ", kMaxHeadBytes, " bytes")};
        return std::nullopt;
      }
      if (!Fill()) {
        // Nothing of a new request read: a clean end. A request cut off: 408.
        const bool empty = absl::StripLeadingAsciiWhitespace(buf_).empty();
        *idle = empty;
        if (!empty) *failure = {408, "request head not complete before the connection went idle"};
        return std::nullopt;
      }
    }
    std::string head = buf_.substr(0, head_end - 4);
    buf_.erase(0, head_end);
    // RFC 9112 2.2: empty lines before the request line are ignored.
    while (absl::StartsWith(head, "\r\n")) head.erase(0, 2);
    std::vector<std::string> lines = absl::StrSplit(head, "\r\n");
    HttpRequest req;
    std::vector<std::string> parts = absl::StrSplit(lines[0], ' ');
    if (parts.size() != 3 || parts[0].empty() || parts[1].empty()) {
      *failure = {400, "malformed request line"};
      return std::nullopt;
    }
    if (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") {
      *failure = {505, absl::StrCat("HTTP version ", parts[2], " (only HTTP/1.1 and HTTP/1.0)")};
      return std::nullopt;
    }
    *version_1_0 = parts[2] == "HTTP/1.0";
    req.method = parts[0];
    const size_t q = parts[1].find('?');
    req.path = parts[1].substr(0, q);
    if (q != std::string::npos) req.query = parts[1].substr(q + 1);
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == std::string::npos || colon == 0 || lines[i][0] == ' ' || lines[i][0] == '\t' ||
          lines[i][colon - 1] == ' ') {
        *failure = {400, absl::StrCat("malformed header line ", i)};
        return std::nullopt;
      }
      req.headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, colon)),
                               std::string(absl::StripAsciiWhitespace(
                                   absl::string_view(lines[i]).substr(colon + 1))));
    }
    const std::string* te = req.Header("transfer-encoding");
    const std::string* cl = req.Header("content-length");
    const std::string* expect = req.Header("expect");
    auto continue_if_asked = [&]() -> bool {
      if (expect != nullptr && absl::EqualsIgnoreCase(*expect, "100-continue")) {
        return stream_->WriteAll("HTTP/1.1 100 Continue\r\n\r\n");
      }
      return true;
    };
    if (te != nullptr) {
      if (cl != nullptr) {
        *failure = {400, "both Transfer-Encoding and Content-Length"};
        return std::nullopt;
      }
      if (!absl::EqualsIgnoreCase(*te, "chunked")) {
        *failure = {501, absl::StrCat("Transfer-Encoding '", *te, "' (only chunked)")};
        return std::nullopt;
      }
      if (!continue_if_asked() || !ReadChunked(&req.body, failure)) return std::nullopt;
      return req;
    }
    if (cl != nullptr) {
      for (const auto& [name, value] : req.headers) {
        if (name == "content-length" && value != *cl) {
          *failure = {400, "conflicting Content-Length headers"};
          return std::nullopt;
        }
      }
      uint64_t length = 0;
      if (cl->empty() || !std::all_of(cl->begin(), cl->end(), absl::ascii_isdigit) ||
          !absl::SimpleAtoi(*cl, &length)) {
        *failure = {400, absl::StrCat("malformed Content-Length '", *cl, "'")};
        return std::nullopt;
      }
      if (length > static_cast<uint64_t>(max_body_)) {
        *failure = {413, absl::StrCat("request body of ", length, " bytes is over the ", max_body_,
                                      "-byte limit")};
        return std::nullopt;
      }
      if (!continue_if_asked() || !ReadExactly(length, &req.body, failure)) return std::nullopt;
    }
    return req;
  }

 private:
  bool Fill() {
    char chunk[16384];
    const ssize_t n = stream_->Read(chunk, sizeof(chunk));
    if (n <= 0) return false;
    buf_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  bool ReadExactly(uint64_t n, std::string* out, ReadFailure* failure) {
    while (buf_.size() < n) {
      if (!Fill()) {
        *failure = {408, "request body not complete before the connection went idle"};
        return false;
      }
    }
    out->assign(buf_, 0, n);
    buf_.erase(0, n);
    return true;
  }

  bool ReadLine(std::string* line, ReadFailure* failure) {
    size_t end;
    while ((end = buf_.find("\r\n")) == std::string::npos) {
      if (buf_.size() > kMaxHeadBytes) {
        *failure = {400, "chunk header or trailer line too long"};
        return false;
      }
      if (!Fill()) {
        *failure = {408, "chunked body not complete before the connection went idle"};
        return false;
      }
    }
    line->assign(buf_, 0, end);
    buf_.erase(0, end + 2);
    return true;
  }

  bool ReadChunked(std::string* body, ReadFailure* failure) {
    for (;;) {
      std::string line;
      if (!ReadLine(&line, failure)) return false;
      absl::string_view size_text = absl::string_view(line).substr(0, line.find(';'));
      size_text = absl::StripAsciiWhitespace(size_text);
      uint64_t size = 0;
      if (size_text.empty() || size_text.size() > 15 ||
          !std::all_of(size_text.begin(), size_text.end(), absl::ascii_isxdigit)) {
        *failure = {400, absl::StrCat("malformed chunk size '", line, "'")};
        return false;
      }
      for (char c : size_text) size = size * 16 + (absl::ascii_isdigit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
      if (size == 0) break;
      if (body->size() + size > static_cast<uint64_t>(max_body_)) {
        *failure = {413, absl::StrCat("chunked request body is over the ", max_body_, "-byte limit")};
        return false;
      }
      std::string data;
      if (!ReadExactly(size + 2, &data, failure)) return false;
      if (data.compare(size, 2, "\r\n") != 0) {
        *failure = {400, "chunk not followed by CRLF"};
        return false;
      }
      body->append(data, 0, size);
    }
    // Trailer fields (ignored) up to the empty line.
    for (;;) {
      std::string line;
      if (!ReadLine(&line, failure)) return false;
      if (line.empty()) return true;
    }
  }

  Stream* const stream_;
  const int64_t max_body_;
  std::string buf_;
};

std::string FormatResponse(const HttpResponse& r, bool head_only, bool keep_alive) {
  std::string out = absl::StrCat("HTTP/1.1 ", r.code, " ", HttpReason(r.code), "\r\n");
  if (!r.content_type.empty()) absl::StrAppend(&out, "Content-Type: ", r.content_type, "\r\n");
  for (const auto& [name, value] : r.headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  absl::StrAppend(&out, "Content-Length: ", r.body.size(), "\r\n",
                  keep_alive ? "" : "Connection: close\r\n", "\r\n");
  if (!head_only) out += r.body;
  return out;
}

HttpResponse ErrorResponse(int code, const std::string& message) {
  HttpResponse r;
  r.code = code;
  // The JSON error form of the Open Inference Protocol, escaped by hand (no JSON library here).
  std::string escaped;
  for (unsigned char c : message) {
    if (c == '"' || c == '\\') {
      escaped += '\\';
      escaped += static_cast<char>(c);
    } else if (c < 0x20) {
      escaped += absl::StrCat("\\u00", c < 16 ? "0" : "", absl::Hex(c));
    } else {
      escaped += static_cast<char>(c);
    }
  }
  r.body = absl::StrCat("{\"error\":\"", escaped, "\"}");
  return r;
}

}  // namespace

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return &v;
  }
  return nullptr;
}

const char* HttpReason(int code) {
  switch (code) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpHandler handler, int listen_fd, int wake_read,
       int wake_write, int port, std::unique_ptr<SslContextFollower> ssl)
      : options_(std::move(options)),
        handler_(std::move(handler)),
        listen_fd_(listen_fd),
        wake_read_(wake_read),
        wake_write_(wake_write),
        port_(port),
        ssl_(std::move(ssl)) {
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  ~Impl() {
    const char c = 'x';
    (void)!::write(wake_write_, &c, 1);
    if (acceptor_.joinable()) acceptor_.join();
    ::close(listen_fd_);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      // A connection waiting for its next request wakes now; one in its handler finishes it.
      for (Connection& c : connections_) {
        if (!c.busy && c.fd >= 0) ::shutdown(c.fd, SHUT_RD);
      }
    }
    std::list<Connection> all;
    {
      absl::MutexLock lock(&mu_);
      all.splice(all.end(), connections_);
    }
    for (Connection& c : all) c.thread.join();
    ::close(wake_read_);
    ::close(wake_write_);
  }

  int port() const { return port_; }
  bool tls() const { return ssl_ != nullptr; }
  int connections() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(connections_.size());
  }

 private:
  struct Connection {
    int fd = -1;
    bool busy = false;  // in the handler or writing its response (guarded by mu_)
    bool done = false;  // the thread is about to return (guarded by mu_)
    std::thread thread;
  };

  void AcceptLoop() {
    for (;;) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
      if (::poll(fds, 2, 1000) < 0) {
        if (errno == EINTR) continue;
        PLOG(ERROR) << "HTTP: poll";
        return;
      }
      if (fds[1].revents != 0) return;
      Reap();
      if ((fds[0].revents & POLLIN) == 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) absl::SleepFor(absl::Milliseconds(50));
        continue;
      }
      timeval tv{};
      const int64_t us = absl::ToInt64Microseconds(options_.idle_timeout);
      tv.tv_sec = us / 1000000;
      tv.tv_usec = us % 1000000;
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      absl::MutexLock lock(&mu_);
      if (static_cast<int>(connections_.size()) >= options_.max_connections) {
        // Plain text: no handshake is made for a connection that is refused anyway.
        if (ssl_ == nullptr) {
          Stream s(fd, nullptr);
          s.WriteAll(FormatResponse(
              ErrorResponse(503, absl::StrCat("too many connections (--http_max_connections=",
                                              options_.max_connections, ")")),
              false, false));
        }
        ::close(fd);
        continue;
      }
      connections_.emplace_back();
      auto it = std::prev(connections_.end());
      it->fd = fd;
      it->thread = std::thread([this, it] { Serve(&*it); });
    }
  }

  // Joins the threads that have finished.
  void Reap() {
    std::list<Connection> finished;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        auto next = std::next(it);
        if (it->done) finished.splice(finished.end(), connections_, it);
        it = next;
      }
    }
    for (Connection& c : finished) c.thread.join();
  }

  void Serve(Connection* c) {
    // OpenSSL writes with write(2): a peer gone away would raise SIGPIPE, whose default action ends
    // the process. Blocked on this thread, it stays pending here and the write fails with EPIPE.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    SSL* ssl = nullptr;
    if (ssl_ != nullptr) {
      SslCtxPtr ctx = ssl_->Current();
      ssl = SSL_new(ctx.get());
      if (ssl == nullptr || SSL_set_fd(ssl, c->fd) != 1 || SSL_accept(ssl) != 1) {
        VLOG(1) << "HTTP: TLS handshake failed: " << OpenSslError();
        if (ssl != nullptr) SSL_free(ssl);
        ERR_clear_error();
        Finish(c);
        return;
      }
    }
    {
      Stream stream(c->fd, ssl);
      RequestReader reader(&stream, options_.max_body_bytes);
      for (;;) {
        ReadFailure failure;
        bool version_1_0 = false, idle = false;
        std::optional<HttpRequest> req = reader.Next(&failure, &version_1_0, &idle);
        if (!req) {
          if (failure.code != 0) {
            stream.WriteAll(FormatResponse(ErrorResponse(failure.code, failure.message), false, false));
          }
          break;
        }
        {
          absl::MutexLock lock(&mu_);
          if (stopping_) break;
          c->busy = true;
        }
        const std::string* connection = req->Header("connection");
        bool keep_alive = version_1_0 ? connection != nullptr &&
                                            absl::EqualsIgnoreCase(*connection, "keep-alive")
                                      : connection == nullptr ||
                                            !absl::EqualsIgnoreCase(*connection, "close");
        HttpResponse response;
        try {
          response = handler_(*req);
        } catch (const std::exception& e) {
          LOG(ERROR) << "HTTP: " << req->method << " " << req->path << ": " << e.what();
          response = ErrorResponse(500, absl::StrCat("internal error: ", e.what()));
        }
        {
          absl::MutexLock lock(&mu_);
          c->busy = false;
          if (stopping_) keep_alive = false;
        }
        if (!stream.WriteAll(FormatResponse(response, req->method == "HEAD", keep_alive)) ||
            !keep_alive) {
          break;
        }
      }
    }
    Finish(c);
  }

  void Finish(Connection* c) {
    absl::MutexLock lock(&mu_);
    ::close(c->fd);
    c->fd = -1;
    c->done = true;
  }

  const HttpServerOptions options_;
  const HttpHandler handler_;
  const int listen_fd_;
  const int wake_read_;
  const int wake_write_;
  const int port_;
  const std::unique_ptr<SslContextFollower> ssl_;
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

absl::Status CheckHttpServerOptions(const HttpServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_port=", options.port, " must be 0 (pick) to 65535, or -1 for none"));
  }
  if (options.max_connections < 1 || options.max_connections > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--http_max_connections=", options.max_connections, " must be 1 to 65536"));
  }
  if (!(options.idle_timeout >= absl::Milliseconds(1) && options.idle_timeout <= absl::Hours(24))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_idle_timeout_s=", absl::ToDoubleSeconds(options.idle_timeout),
                     " must be 0.001 to 86400"));
  }
  if (options.max_body_bytes < 1) {
    return absl::InvalidArgumentError("the HTTP body limit (--max_message_bytes) must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options,
                                                              HttpHandler handler) {
  RETURN_IF_ERROR(CheckHttpServerOptions(options));
  std::unique_ptr<SslContextFollower> ssl;
  if (options.tls.enabled()) {
    RETURN_IF_ERROR(CheckCertificateFiles(options.tls).status());
    ssl = std::make_unique<SslContextFollower>(options.tls);
    RETURN_IF_ERROR(ssl->Init());
  }
  const std::string where = absl::StrCat(options.host, ":", options.port);
  const std::string& host = options.host;
  const std::string name = host.size() > 2 && host.front() == '[' && host.back() == ']'
                               ? host.substr(1, host.size() - 2)
                               : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(options.port);
  if (int rc = ::getaddrinfo(name.empty() ? nullptr : name.c_str(), port_str.c_str(), &hints, &res);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP address ", where, ": ", ::gai_strerror(rc)));
  }
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::freeaddrinfo(res);
    return absl::UnavailableError(absl::StrCat("HTTP socket: ", std::strerror(errno)));
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (res->ai_family == AF_INET6) {
    int zero = 0;  // "::" takes IPv4 too, as gRPC's listener does
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  }
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
    const int err = errno;
    ::freeaddrinfo(res);
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", where, ": ", std::strerror(err)));
  }
  ::freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("HTTP pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::make_unique<Impl>(
      std::move(options), std::move(handler), fd, wake[0], wake[1], bound_port, std::move(ssl))));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;
int HttpServer::port() const { return impl_->port(); }
bool HttpServer::tls() const { return impl_->tls(); }
int HttpServer::connections() const { return impl_->connections(); }

}  // namespace collabserve::service
