#include "server/service/http_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <zlib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>
#include <system_error>
#include <list>
#include <map>
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
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/metrics/process_metrics.h"
#include "server/util/files.h"
#include "server/util/listen.h"
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
  // A session resumed with a client certificate checked needs a context id (else OpenSSL ends the
  // resuming handshake with "session id context uninitialized"); one server, one id.
  static const unsigned char kSessionContext[] = "collabserve-http";
  SSL_CTX_set_session_id_context(ctx.get(), kSessionContext, sizeof(kSessionContext) - 1);
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

// One connection's byte stream, plain or TLS. The socket's timeouts bound each call, the
// server's watchdog (a deadline per phase) the whole of a phase.
class Stream {
 public:
  Stream(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  ~Stream() {
    if (ssl_ != nullptr) {
      // No close_notify after a fatal error (OpenSSL forbids it); else a quiet one.
      if (!fatal_) {
        ERR_clear_error();
        SSL_shutdown(ssl_);
      }
      SSL_free(ssl_);
      ERR_clear_error();
    }
  }
  // > 0 bytes read; 0 the peer closed; < 0 an error or the timeout.
  ssize_t Read(char* buf, size_t n) {
    if (ssl_ != nullptr) {
      if (fatal_) return -1;
      ERR_clear_error();
      const int r = SSL_read(ssl_, buf, static_cast<int>(std::min<size_t>(n, 1 << 30)));
      if (r > 0) return r;
      const int e = SSL_get_error(ssl_, r);
      if (e == SSL_ERROR_ZERO_RETURN) return 0;
      fatal_ = fatal_ || e == SSL_ERROR_SYSCALL || e == SSL_ERROR_SSL;
      return -1;
    }
    for (;;) {
      const ssize_t r = ::recv(fd_, buf, n, 0);
      if (r < 0 && errno == EINTR) continue;
      return r;
    }
  }
  bool WriteAll(absl::string_view data) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n;
      if (ssl_ != nullptr) {
        if (fatal_) return false;
        ERR_clear_error();
        n = SSL_write(ssl_, data.data() + off,
                      static_cast<int>(std::min<size_t>(data.size() - off, 1 << 30)));
        if (n <= 0) {
          const int e = SSL_get_error(ssl_, static_cast<int>(n));
          fatal_ = fatal_ || e == SSL_ERROR_SYSCALL || e == SSL_ERROR_SSL;
        }
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
  bool fatal_ = false;
};

// Why a request could not be read: the answer to send (0: none, just close).
struct ReadFailure {
  int code = 0;
  std::string message;
};

// Content-Encoding of a request body (RFC 9110 8.4.1): gzip, or deflate (the zlib format).
enum class Inflated { kOk, kMalformed, kTooLarge };

Inflated Inflate(const std::string& in, bool gzip, int64_t max, std::string* out) {
  out->clear();
  if (in.empty()) return Inflated::kOk;  // no body to decode
  if (in.size() > UINT_MAX) return Inflated::kTooLarge;
  z_stream zs{};
  if (inflateInit2(&zs, gzip ? 16 + MAX_WBITS : MAX_WBITS) != Z_OK) return Inflated::kMalformed;
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  char chunk[65536];
  int rc = Z_OK;
  for (;;) {
    zs.next_out = reinterpret_cast<Bytef*>(chunk);
    zs.avail_out = sizeof(chunk);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) break;
    out->append(chunk, sizeof(chunk) - zs.avail_out);
    if (static_cast<int64_t>(out->size()) > max) {
      inflateEnd(&zs);
      return Inflated::kTooLarge;  // a small body that inflates past the limit: refused early
    }
    if (rc == Z_STREAM_END) {
      // RFC 1952: a gzip body may hold several members, one after another.
      if (!gzip || zs.avail_in == 0 || inflateReset(&zs) != Z_OK) break;
      continue;
    }
    if (zs.avail_in == 0 && zs.avail_out != 0) break;  // truncated
  }
  const bool whole = rc == Z_STREAM_END && zs.avail_in == 0;
  inflateEnd(&zs);
  return whole ? Inflated::kOk : Inflated::kMalformed;
}

// A response body in gzip (level 1: the network on which this pays is slow, the CPU is shared
// with inference).
std::string Gzip(const std::string& in) {
  if (in.size() > UINT_MAX) return "";  // not worth a chunked loop: sent as it is
  z_stream zs{};
  if (deflateInit2(&zs, 1, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) return "";
  std::string out(deflateBound(&zs, in.size()), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return rc == Z_STREAM_END ? out : "";
}

// Whether an Accept-Encoding value takes gzip ("gzip", "x-gzip" or "*", without q=0).
// A coding named explicitly wins over "*" (RFC 9110 12.5.3).
bool AcceptsGzip(const std::string* value) {
  if (value == nullptr) return false;
  std::optional<bool> named, star;
  for (absl::string_view item : absl::StrSplit(*value, ',')) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, ';');
    const absl::string_view name = absl::StripAsciiWhitespace(parts[0]);
    bool zero = false;
    for (size_t i = 1; i < parts.size(); ++i) {
      const absl::string_view p = absl::StripAsciiWhitespace(parts[i]);
      double q = 1;
      if (absl::StartsWithIgnoreCase(p, "q=") && absl::SimpleAtod(p.substr(2), &q)) zero = q <= 0;
    }
    if (absl::EqualsIgnoreCase(name, "gzip") || absl::EqualsIgnoreCase(name, "x-gzip")) {
      named = named.value_or(false) || !zero;
    } else if (name == "*") {
      star = !zero;
    }
  }
  return named.has_value() ? *named : star.value_or(false);
}

// What the reader tells the connection as it goes, for the watchdog's deadlines.
struct ReadProgress {
  std::function<void()> waiting;                 // no byte of the next request yet
  std::function<void()> reading;                 // its first byte came
  std::function<void(uint64_t bytes)> body;      // its head is read; up to `bytes` of body follow
};

// RFC 9110 token characters (a header name).
bool IsTokenChar(char c) {
  return absl::ascii_isalnum(c) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

// The comma-separated elements of a header value, trimmed and lower-cased.
std::vector<std::string> HeaderList(const std::string* value) {
  std::vector<std::string> out;
  if (value == nullptr) return out;
  for (absl::string_view part : absl::StrSplit(*value, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) out.push_back(absl::AsciiStrToLower(part));
  }
  return out;
}

class RequestReader {
 public:
  RequestReader(Stream* stream, int64_t max_body, ReadProgress progress)
      : stream_(stream), max_body_(max_body), progress_(std::move(progress)) {}

  // The next request, or the failure. `idle` is set when the connection closed or timed out
  // cleanly between requests.
  std::optional<HttpRequest> Next(ReadFailure* failure, bool* version_1_0, bool* idle) {
    *idle = false;
    size_t head_end;
    bool started = false;
    for (;;) {
      // RFC 9112 2.2: empty lines before the request line are ignored.
      size_t skip = 0;
      while (buf_.compare(skip, 2, "\r\n") == 0) skip += 2;
      buf_.erase(0, skip);
      if (!started && !buf_.empty()) {
        started = true;
        progress_.reading();
      }
      head_end = buf_.find("\r\n\r\n");
      if (head_end != std::string::npos && head_end <= kMaxHeadBytes) {
        head_end += 4;
        break;
      }
      if (buf_.size() > kMaxHeadBytes) {
        *failure = {431, absl::StrCat("request head over ", kMaxHeadBytes, " bytes")};
        return std::nullopt;
      }
      if (!started) progress_.waiting();
      if (!Fill()) {
        // Nothing of a new request read: a clean end. A request cut off: 408.
        *idle = !started;
        if (started) *failure = {408, "request head not complete in time"};
        return std::nullopt;
      }
    }
    std::string head = buf_.substr(0, head_end - 4);
    buf_.erase(0, head_end);
    std::vector<std::string> lines = absl::StrSplit(head, "\r\n");
    HttpRequest req;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].find_first_of(std::string("\r\n\0", 3)) != std::string::npos) {
        *failure = {400, i == 0 ? std::string("bare CR, LF or NUL in the request line")
                                : absl::StrCat("bare CR, LF or NUL in header line ", i)};
        return std::nullopt;
      }
    }
    std::vector<std::string> parts = absl::StrSplit(lines[0], ' ');
    // RFC 9112 3.2.2: a server accepts the absolute form (what a client sends to a proxy) and
    // uses its path.
    if (parts.size() == 3) {
      for (const char* scheme : {"http://", "https://"}) {
        if (absl::StartsWithIgnoreCase(parts[1], scheme)) {
          const size_t slash = parts[1].find('/', std::strlen(scheme));
          parts[1] = slash == std::string::npos ? "/" : parts[1].substr(slash);
        }
      }
    }
    if (parts.size() != 3 || parts[0].empty() ||
        !std::all_of(parts[0].begin(), parts[0].end(), IsTokenChar) || parts[1].empty() ||
        (parts[1][0] != '/' && parts[1] != "*")) {
      *failure = {400, "malformed request line"};
      return std::nullopt;
    }
    if (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") {
      *failure = {505, absl::StrCat("HTTP version '", parts[2], "' (only HTTP/1.1 and HTTP/1.0)")};
      return std::nullopt;
    }
    *version_1_0 = parts[2] == "HTTP/1.0";
    req.method = parts[0];
    const size_t q = parts[1].find('?');
    req.path = parts[1].substr(0, q);
    if (q != std::string::npos) req.query = parts[1].substr(q + 1);
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == std::string::npos || colon == 0 ||
          !std::all_of(lines[i].begin(), lines[i].begin() + colon, IsTokenChar)) {
        *failure = {400, absl::StrCat("malformed header line ", i)};
        return std::nullopt;
      }
      req.headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, colon)),
                               std::string(absl::StripAsciiWhitespace(
                                   absl::string_view(lines[i]).substr(colon + 1))));
    }
    const std::string* te = nullptr;
    const std::string* cl = nullptr;
    for (const auto& [name, value] : req.headers) {
      if (name == "transfer-encoding") {
        if (te != nullptr) {
          *failure = {400, "more than one Transfer-Encoding header"};
          return std::nullopt;
        }
        te = &value;
      } else if (name == "content-length") {
        if (cl != nullptr && value != *cl) {
          *failure = {400, "conflicting Content-Length headers"};
          return std::nullopt;
        }
        cl = &value;
      }
    }
    const std::string* expect = req.Header("expect");
    auto continue_if_asked = [&]() -> bool {
      if (expect != nullptr && absl::EqualsIgnoreCase(*expect, "100-continue") && !*version_1_0) {
        return stream_->WriteAll("HTTP/1.1 100 Continue\r\n\r\n");
      }
      return true;
    };
    if (te != nullptr) {
      if (cl != nullptr) {
        *failure = {400, "both Transfer-Encoding and Content-Length"};
        return std::nullopt;
      }
      if (*version_1_0) {
        *failure = {400, "Transfer-Encoding in an HTTP/1.0 request"};
        return std::nullopt;
      }
      if (!absl::EqualsIgnoreCase(*te, "chunked")) {
        *failure = {501, absl::StrCat("Transfer-Encoding '", *te, "' (only chunked)")};
        return std::nullopt;
      }
      progress_.body(static_cast<uint64_t>(max_body_));
      if (!continue_if_asked() || !ReadChunked(&req.body, failure)) return std::nullopt;
      if (!Decode(&req, failure)) return std::nullopt;
      return req;
    }
    if (cl != nullptr) {
      uint64_t length = 0;
      if (cl->empty() || cl->size() > 19 ||
          !std::all_of(cl->begin(), cl->end(), absl::ascii_isdigit) ||
          !absl::SimpleAtoi(*cl, &length)) {
        *failure = {400, absl::StrCat("malformed Content-Length '", *cl, "'")};
        return std::nullopt;
      }
      if (length > static_cast<uint64_t>(max_body_)) {
        *failure = {413, absl::StrCat("request body of ", length, " bytes is over the ", max_body_,
                                      "-byte limit")};
        return std::nullopt;
      }
      progress_.body(length);
      if (!continue_if_asked() || !ReadExactly(length, &req.body, failure)) return std::nullopt;
    }
    if (!Decode(&req, failure)) return std::nullopt;
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

  // The body without its Content-Encoding (gzip or deflate), within the same limit; the header is
  // dropped once it is applied.
  bool Decode(HttpRequest* req, ReadFailure* failure) {
    // Every Content-Encoding line, as one list (RFC 9110 5.3), then the header goes.
    std::string joined;
    bool any = false;
    for (auto it = req->headers.begin(); it != req->headers.end();) {
      if (it->first != "content-encoding") {
        ++it;
        continue;
      }
      absl::StrAppend(&joined, any ? ", " : "", it->second);
      any = true;
      it = req->headers.erase(it);
    }
    if (!any) return true;
    const std::vector<std::string> codings = HeaderList(&joined);
    const std::string coding = codings.size() == 1 ? codings[0] : "";
    if (coding == "identity") return true;
    if (coding != "gzip" && coding != "x-gzip" && coding != "deflate") {
      *failure = {415, absl::StrCat("Content-Encoding '", joined,
                                    "' (gzip, deflate or identity, one of them)")};
      return false;
    }
    std::string plain;
    switch (Inflate(req->body, coding != "deflate", max_body_, &plain)) {
      case Inflated::kOk:
        break;
      case Inflated::kTooLarge:
        *failure = {413, absl::StrCat("request body inflates past the ", max_body_, "-byte limit")};
        return false;
      case Inflated::kMalformed:
        *failure = {400, absl::StrCat("request body is not valid ", coding)};
        return false;
    }
    req->body = std::move(plain);
    return true;
  }

  bool ReadExactly(uint64_t n, std::string* out, ReadFailure* failure) {
    while (buf_.size() < n) {
      if (!Fill()) {
        *failure = {408, "request body not complete in time"};
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
        *failure = {408, "chunked body not complete in time"};
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
      for (char c : size_text) {
        size = size * 16 + (absl::ascii_isdigit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
      }
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
  const ReadProgress progress_;
  std::string buf_;
};

std::string FormatResponse(const HttpResponse& r, bool head_only, const char* connection) {
  std::string out = absl::StrCat("HTTP/1.1 ", r.code, " ", HttpReason(r.code), "\r\n");
  if (!r.content_type.empty()) absl::StrAppend(&out, "Content-Type: ", r.content_type, "\r\n");
  for (const auto& [name, value] : r.headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  absl::StrAppend(&out, "Content-Length: ", r.body.size(), "\r\n");
  if (connection != nullptr) absl::StrAppend(&out, "Connection: ", connection, "\r\n");
  out += "\r\n";
  if (!head_only) out += r.body;
  return out;
}

HttpResponse ErrorResponse(int code, const std::string& message) {
  HttpResponse r;
  r.code = code;
  // The JSON error form of the Open Inference Protocol, escaped by hand (no JSON library here);
  // bytes past ASCII (echoed request bytes need not be UTF-8) as \u00XX, so the body stays JSON.
  std::string escaped;
  for (unsigned char c : message) {
    if (c == '"' || c == '\\') {
      escaped += '\\';
      escaped += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      escaped += absl::StrCat("\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      escaped += static_cast<char>(c);
    }
  }
  r.body = absl::StrCat("{\"error\":\"", escaped, "\"}");
  return r;
}

// Closes a connection whose request may not have been read whole (an error answered early): the
// write side first, then what the client still sends is read and dropped for up to `linger` (and
// half a second of quiet), so that the close does not reset the connection and destroy the
// answer before the client has read it.
void LingeringClose(int fd, absl::Duration linger) {
  ::shutdown(fd, SHUT_WR);
  const absl::Time until = absl::Now() + linger;
  char buf[65536];
  for (;;) {
    const int64_t ms = std::min<int64_t>(absl::ToInt64Milliseconds(until - absl::Now()), 500);
    if (ms <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(ms)) <= 0) break;
    if (::recv(fd, buf, sizeof(buf), MSG_DONTWAIT) <= 0) break;
  }
}

// Logs at most one line per minute, with how many were not logged.
class RateLimitedLog {
 public:
  void Warn(const std::string& what) {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_ < absl::Minutes(1)) {
      ++suppressed_;
      return;
    }
    LOG(WARNING) << what
                 << (suppressed_ > 0 ? absl::StrCat(" (and ", suppressed_, " more in the last minute)")
                                     : std::string());
    last_ = now;
    suppressed_ = 0;
  }

 private:
  absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return &v;
  }
  return nullptr;
}

bool PercentDecodeSegment(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    int value = 0;
    if (i + 2 >= in.size() || !absl::ascii_isxdigit(in[i + 1]) || !absl::ascii_isxdigit(in[i + 2])) {
      return false;
    }
    for (int k = 1; k <= 2; ++k) {
      const char c = in[i + k];
      value = value * 16 + (absl::ascii_isdigit(c) ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    out->push_back(static_cast<char>(value));
    i += 2;
  }
  return true;
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
    case 422: return "Unprocessable Content";
    case 424: return "Failed Dependency";
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

namespace {

// The server's counts, shared with the collectable that exports them.
struct HttpCounters {
  absl::Mutex mu;
  std::map<int, int64_t> responses ABSL_GUARDED_BY(mu);  // by code
  std::atomic<int64_t> open{0};
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> cut{0};
  std::atomic<int64_t> handshake_failures{0};

  void Responded(int code) {
    absl::MutexLock lock(&mu);
    ++responses[code];
  }
};

class HttpCollectable : public prometheus::Collectable {
 public:
  explicit HttpCollectable(std::shared_ptr<HttpCounters> counters) : counters_(std::move(counters)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    prometheus::MetricFamily& responses = out.emplace_back();
    responses.name = "collabserve_http_responses_total";
    responses.help =
        "Responses of the REST endpoint (--http_port) by HTTP status code, including errors "
        "answered before a request was read whole (400, 408, 413, 431).";
    responses.type = prometheus::MetricType::Counter;
    {
      absl::MutexLock lock(&counters_->mu);
      for (const auto& [code, n] : counters_->responses) {
        prometheus::ClientMetric m;
        m.label.push_back({"code", std::to_string(code)});
        m.counter.value = static_cast<double>(n);
        responses.metric.push_back(std::move(m));
      }
    }
    auto add = [&out](const char* name, const char* help, prometheus::MetricType type, double v) {
      out.push_back(metrics::OneValueFamily(name, help, type, v));
    };
    add("collabserve_http_connections", "Connections open to the REST endpoint.",
        prometheus::MetricType::Gauge, static_cast<double>(counters_->open.load()));
    add("collabserve_http_connections_refused_total",
        "Connections to the REST endpoint refused: --http_max_connections open already, or a "
        "connection thread that could not start.",
        prometheus::MetricType::Counter, static_cast<double>(counters_->refused.load()));
    add("collabserve_http_connections_cut_total",
        "Connections to the REST endpoint cut by the watchdog: a TLS handshake, a request or a "
        "response that took longer than its phase allows (--http_idle_timeout_s, 64 KiB/s).",
        prometheus::MetricType::Counter, static_cast<double>(counters_->cut.load()));
    add("collabserve_http_tls_handshake_failures_total",
        "TLS handshakes on the REST endpoint that failed (no or a refused client certificate, "
        "plain HTTP on the TLS port, a bad certificate pair).",
        prometheus::MetricType::Counter, static_cast<double>(counters_->handshake_failures.load()));
    return out;
  }

 private:
  const std::shared_ptr<HttpCounters> counters_;
};

// The slowest a client may send a request body or take a response before the watchdog cuts it,
// and the longest a TLS handshake may take.
constexpr double kMinBytesPerSecond = 64 * 1024;
constexpr absl::Duration kMaxHandshake = absl::Seconds(10);
// How long an early error's close reads and drops the rest of the request.
constexpr absl::Duration kLinger = absl::Seconds(2);
// Responses this large are gzipped for a client that accepts it.
constexpr size_t kGzipFrom = 1024;
// How long a response being written when the server stops may still take.
constexpr absl::Duration kStopWrite = absl::Seconds(1);

absl::Duration TransferTime(uint64_t bytes) {
  return absl::Seconds(static_cast<double>(bytes) / kMinBytesPerSecond);
}

}  // namespace

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
    loop_ = std::thread([this] { Loop(); });
  }

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      draining_ = true;
      CloseWaiting();
    }
    Wake();
    loop_.join();  // returns once every connection has ended
    ::close(wake_read_);
    ::close(wake_write_);
  }

  void BeginDrain() {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    CloseWaiting();
  }

  int port() const { return port_; }
  bool tls() const { return ssl_ != nullptr; }
  int connections() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(connections_.size());
  }
  std::shared_ptr<HttpCounters> counters() const { return counters_; }

 private:
  // kLingering: an error answered early, the rest of the request read and dropped (not a cut).
  enum class Phase { kHandshake, kWaiting, kReading, kHandling, kWriting, kLingering };
  struct Connection {
    int fd = -1;           // -1 once closed (guarded by mu_)
    Phase phase = Phase::kWaiting;
    absl::Time deadline;   // the watchdog shuts the socket down past it, except while handling
    bool done = false;     // the thread is about to return
    bool served = false;   // a response was sent (the next wait is a keep-alive one)
    bool cut = false;      // the watchdog (or the stop) shut it down
    std::thread thread;
  };

  void Wake() {
    const char c = 'x';
    (void)!::write(wake_write_, &c, 1);
  }

  // Draining: connections that wait for a request are shut down (their threads then end).
  // Stopping: every connection but those whose handler runs, and a response being written gets a
  // second (nothing is served any more: the stop must not wait on slow clients).
  void CloseWaiting() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (Connection& c : connections_) Settle(&c);
  }
  void Settle(Connection* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (c->fd < 0) return;
    if (stopping_ && c->phase == Phase::kWriting) {
      c->deadline = std::min(c->deadline, absl::Now() + kStopWrite);
    } else if ((stopping_ && c->phase != Phase::kHandling && c->phase != Phase::kLingering) ||
               (draining_ && c->phase == Phase::kWaiting && c->served)) {
      ::shutdown(c->fd, SHUT_RDWR);
    }
  }

  // The connection enters `phase`, which may last `allowed` (infinite: no deadline).
  void Enter(Connection* c, Phase phase, absl::Duration allowed) {
    absl::MutexLock lock(&mu_);
    c->phase = phase;
    c->deadline = absl::Now() + allowed;
    Settle(c);  // a drain or stop that began while the connection was in another phase
  }

  // Accepts, cuts connections past their deadline and joins finished threads, until stopped and
  // every connection has ended.
  void Loop() {
    bool listening = true;
    for (;;) {
      pollfd fds[2] = {{wake_read_, POLLIN, 0}, {listening ? listen_fd_ : -1, POLLIN, 0}};
      if (::poll(fds, 2, 250) < 0 && errno != EINTR) {
        PLOG(ERROR) << "HTTP: poll";
        absl::SleepFor(absl::Milliseconds(250));
      }
      if (fds[0].revents & POLLIN) {
        char buf[64];
        (void)!::read(wake_read_, buf, sizeof(buf));
      }
      bool stopping;
      {
        absl::MutexLock lock(&mu_);
        stopping = stopping_;
        const absl::Time now = absl::Now();
        for (Connection& c : connections_) {
          if (c.fd >= 0 && c.phase != Phase::kHandling && now > c.deadline) {
            // A read cut short still lets the thread answer 408 (under the writing deadline).
            const bool writing = c.phase == Phase::kWriting || c.phase == Phase::kLingering;
            ::shutdown(c.fd, writing ? SHUT_RDWR : SHUT_RD);
            c.deadline = absl::InfiniteFuture();
            // Not a quiet keep-alive connection, nor the end of a lingering close.
            if (c.phase != Phase::kWaiting && c.phase != Phase::kLingering) {
              c.cut = true;
              counters_->cut.fetch_add(1);
            }
          }
        }
      }
      if (stopping && listening) {
        ::close(listen_fd_);
        listening = false;
      }
      Reap();
      if (!listening) {
        absl::MutexLock lock(&mu_);
        if (connections_.empty()) return;
        continue;
      }
      if (fds[1].revents & POLLIN) Accept();
    }
  }

  void Accept() {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        refusals_.Warn(absl::StrCat("HTTP: cannot accept a connection: ", std::strerror(errno)));
        absl::SleepFor(absl::Milliseconds(50));
      }
      return;
    }
    timeval tv{};
    const int64_t us = absl::ToInt64Microseconds(options_.idle_timeout);
    tv.tv_sec = us / 1000000;
    tv.tv_usec = us % 1000000;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    bool full;
    {
      absl::MutexLock lock(&mu_);
      full = static_cast<int>(connections_.size()) >= options_.max_connections;
    }
    if (full) {
      Refuse(fd, absl::StrCat("too many connections (--http_max_connections=",
                              options_.max_connections, ")"));
      return;
    }
    std::string not_started;
    {
      absl::MutexLock lock(&mu_);
      connections_.emplace_back();
      counters_->open.fetch_add(1);
      auto it = std::prev(connections_.end());
      it->fd = fd;
      it->phase = ssl_ != nullptr ? Phase::kHandshake : Phase::kWaiting;
      it->deadline =
          absl::Now() + (ssl_ != nullptr ? std::min(options_.idle_timeout, kMaxHandshake)
                                         : options_.idle_timeout);
      try {
        it->thread = std::thread([this, it] { Serve(&*it); });
      } catch (const std::system_error& e) {
        connections_.erase(it);
        counters_->open.fetch_sub(1);
        not_started = e.what();
      }
    }
    // Not under the lock: Refuse may take a moment.
    if (!not_started.empty()) Refuse(fd, "cannot start a connection thread: " + not_started);
  }

  // Answers 503 with `why` (plain text connections; a TLS one is closed without a handshake) and
  // closes, without waiting on the client.
  void Refuse(int fd, const std::string& why) {
    counters_->refused.fetch_add(1);
    refusals_.Warn(absl::StrCat("HTTP: refused a connection: ", why));
    if (ssl_ == nullptr) {
      counters_->Responded(503);
      const std::string bytes = FormatResponse(ErrorResponse(503, why), false, "close");
      (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(fd, SHUT_WR);
      char buf[16384];
      while (::recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
      }
    }
    ::close(fd);
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
    const int fd = c->fd;  // closed only by Finish, on this thread
    SSL* ssl = nullptr;
    if (ssl_ != nullptr) {
      SslCtxPtr ctx = ssl_->Current();
      ERR_clear_error();
      ssl = SSL_new(ctx.get());
      if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1 || SSL_accept(ssl) != 1) {
        bool cut;
        {
          absl::MutexLock lock(&mu_);
          cut = c->cut;
        }
        if (!cut) counters_->handshake_failures.fetch_add(1);  // else a slow one, counted as cut
        handshakes_.Warn(absl::StrCat("HTTP: TLS handshake ", cut ? "too slow" : "failed", ": ",
                                      OpenSslError()));
        if (ssl != nullptr) SSL_free(ssl);
        ERR_clear_error();
        Finish(c);
        return;
      }
    }
    bool linger = false;
    {
      Stream stream(fd, ssl);
      const absl::Duration idle = options_.idle_timeout;
      RequestReader reader(
          &stream, options_.max_body_bytes,
          ReadProgress{[this, c, idle] { Enter(c, Phase::kWaiting, idle); },
                       [this, c, idle] { Enter(c, Phase::kReading, idle); },
                       [this, c, idle](uint64_t bytes) {
                         Enter(c, Phase::kReading, idle + TransferTime(bytes));
                       }});
      for (;;) {
        ReadFailure failure;
        bool version_1_0 = false, idle_end = false;
        std::optional<HttpRequest> req = reader.Next(&failure, &version_1_0, &idle_end);
        if (!req) {
          if (failure.code != 0) {
            Enter(c, Phase::kWriting, idle);
            // Counted before it is written: a client that has read it finds it counted.
            counters_->Responded(failure.code);
            if (stream.WriteAll(
                    FormatResponse(ErrorResponse(failure.code, failure.message), false, "close"))) {
              linger = true;
            }
          }
          break;
        }
        Enter(c, Phase::kHandling, absl::InfiniteDuration());
        const std::vector<std::string> tokens = HeaderList(req->Header("connection"));
        auto has = [&tokens](const char* t) {
          return std::find(tokens.begin(), tokens.end(), t) != tokens.end();
        };
        bool keep_alive = version_1_0 ? has("keep-alive") : !has("close");
        req->client_gone = [fd] {
          pollfd p{fd, POLLRDHUP, 0};
          return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
        };
        HttpResponse response;
        try {
          response = handler_(*req);
        } catch (const std::exception& e) {
          LOG(ERROR) << "HTTP: " << req->method << " " << req->path << ": " << e.what();
          response = ErrorResponse(500, absl::StrCat("internal error: ", e.what()));
        }
        {
          absl::MutexLock lock(&mu_);
          if (draining_) keep_alive = false;
        }
        if (response.compressible && response.body.size() >= kGzipFrom) {
          response.headers.emplace_back("Vary", "Accept-Encoding");
          if (AcceptsGzip(req->Header("accept-encoding"))) {
            if (std::string zipped = Gzip(response.body); !zipped.empty()) {
              response.body = std::move(zipped);
              response.headers.emplace_back("Content-Encoding", "gzip");
            }
          }
        }
        const std::string bytes = FormatResponse(
            response, req->method == "HEAD",
            !keep_alive ? "close" : version_1_0 ? "keep-alive" : nullptr);
        Enter(c, Phase::kWriting, idle + TransferTime(bytes.size()));
        counters_->Responded(response.code);  // before the write, as above
        if (!stream.WriteAll(bytes)) break;
        {
          absl::MutexLock lock(&mu_);
          c->served = true;
        }
        if (!keep_alive) break;
      }
    }
    if (linger) {
      Enter(c, Phase::kLingering, kLinger + absl::Seconds(1));
      LingeringClose(fd, kLinger);
    }
    Finish(c);
  }

  void Finish(Connection* c) {
    counters_->open.fetch_sub(1);
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
  const std::shared_ptr<HttpCounters> counters_ = std::make_shared<HttpCounters>();
  RateLimitedLog refusals_;
  RateLimitedLog handshakes_;
  std::thread loop_;
  mutable absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
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
  ASSIGN_OR_RETURN(const util::ListeningSocket listening,
                   util::ListenTcp(options.host, options.port, "HTTP"));
  const int fd = listening.fd;
  const int bound_port = listening.port;
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
void HttpServer::BeginDrain() { impl_->BeginDrain(); }
int HttpServer::port() const { return impl_->port(); }
bool HttpServer::tls() const { return impl_->tls(); }
int HttpServer::connections() const { return impl_->connections(); }
std::shared_ptr<prometheus::Collectable> HttpServer::NewCollectable() const {
  return std::make_shared<HttpCollectable>(impl_->counters());
}

}  // namespace collabserve::service
