#include "server/service/admin_auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/util/files.h"

namespace collabserve::service {
namespace {

std::array<unsigned char, 32> Digest(absl::string_view s) {
  std::array<unsigned char, 32> d{};
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d.data());
  return d;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AdminAuth>> AdminAuth::FromTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = util::ReadFile(path, 1 << 16);
  if (!text.ok()) {
    return absl::NotFoundError(
        absl::StrCat("--admin_token_file ", path, ": ", text.status().message()));
  }
  absl::StatusOr<std::unique_ptr<AdminAuth>> auth = FromToken(std::string(absl::StripAsciiWhitespace(*text)));
  if (!auth.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--admin_token_file ", path, ": ", auth.status().message()));
  }
  return auth;
}

absl::StatusOr<std::unique_ptr<AdminAuth>> AdminAuth::FromToken(const std::string& token) {
  if (token.empty()) return absl::InvalidArgumentError("the admin token is empty");
  for (unsigned char c : token) {
    if (c <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError("the admin token contains whitespace or control bytes");
    }
  }
  return std::unique_ptr<AdminAuth>(new AdminAuth(Digest(token)));
}

absl::Status AdminAuth::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWithIgnoreCase(value, kBearer)) {
    return absl::UnauthenticatedError("the authorization metadata is not 'Bearer <token>'");
  }
  value.remove_prefix(kBearer.size());
  const std::array<unsigned char, 32> presented = Digest(value);
  if (CRYPTO_memcmp(presented.data(), digest_.data(), digest_.size()) != 0) {
    return absl::UnauthenticatedError("wrong admin token");
  }
  return absl::OkStatus();
}

}  // namespace collabserve::service
