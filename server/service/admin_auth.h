// Bearer-token authentication for the Admin service: the token comes from --admin_token_file and
// every call must carry `authorization: Bearer <token>`.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/base/thread_annotations.h"
#include "grpcpp/support/string_ref.h"

namespace collabserve::service {

// Check() is thread-safe. The token is kept only as its SHA-256, and the comparison takes the same
// time whatever the presented token is (digests of equal length, compared with CRYPTO_memcmp), so
// timing reveals neither prefix nor length.
class AdminAuth {
 public:
  // The token is the file's content with surrounding whitespace removed. NOT_FOUND if the file
  // cannot be read; INVALID_ARGUMENT if the token is empty or contains whitespace or control bytes.
  // The file is followed: once it changes (another file, size or modification time; a Kubernetes
  // Secret volume swaps in a new file when the Secret changes), the next Check() reads it again,
  // and the new token replaces the old one. A changed file that cannot be read or holds no valid
  // token leaves the old token in force, logged once per change.
  static absl::StatusOr<std::unique_ptr<AdminAuth>> FromTokenFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<AdminAuth>> FromToken(const std::string& token);

  // OK if `metadata` (a call's client metadata) holds `authorization: Bearer <token>` with the
  // right token. UNAUTHENTICATED otherwise, saying whether the header was missing, malformed or
  // wrong (never what the token is).
  absl::Status Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

 private:
  using Digest = std::array<unsigned char, 32>;
  // What tells a changed file: device, inode, size and modification time (ns).
  using FileStamp = std::array<int64_t, 4>;

  AdminAuth(const Digest& digest, std::string path, const FileStamp& stamp)
      : path_(std::move(path)), digest_(digest), stamp_(stamp) {}
  // The digest to check against: the file's current token when it changed since it was read.
  Digest Current() const ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;  // empty: a fixed token
  mutable absl::Mutex mu_;
  mutable Digest digest_ ABSL_GUARDED_BY(mu_);
  mutable FileStamp stamp_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_
