// Bearer-token authentication for the Admin service: the token comes from --admin_token_file and
// every call must carry `authorization: Bearer <token>`.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_

#include <array>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/string_ref.h"

namespace collabserve::service {

// Immutable after creation; Check() is thread-safe. The token is kept only as its SHA-256, and
// the comparison takes the same time whatever the presented token is (digests of equal length,
// compared with CRYPTO_memcmp), so timing reveals neither prefix nor length.
class AdminAuth {
 public:
  // The token is the file's content with surrounding whitespace removed. NOT_FOUND if the file
  // cannot be read; INVALID_ARGUMENT if the token is empty or contains whitespace or control bytes.
  static absl::StatusOr<std::unique_ptr<AdminAuth>> FromTokenFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<AdminAuth>> FromToken(const std::string& token);

  // OK if `metadata` (a call's client metadata) holds `authorization: Bearer <token>` with the
  // right token. UNAUTHENTICATED otherwise, saying whether the header was missing, malformed or
  // wrong (never what the token is).
  absl::Status Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

 private:
  explicit AdminAuth(const std::array<unsigned char, 32>& digest) : digest_(digest) {}
  const std::array<unsigned char, 32> digest_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_AUTH_H_
