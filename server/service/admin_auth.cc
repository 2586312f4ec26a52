#include "server/service/admin_auth.h"

#include <sys/stat.h>

#include <glog/logging.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/util/files.h"

namespace collabserve::service {
namespace {

std::array<unsigned char, 32> Sha256(absl::string_view s) {
  std::array<unsigned char, 32> d{};
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d.data());
  return d;
}

absl::Status ValidateToken(absl::string_view token) {
  if (token.empty()) return absl::InvalidArgumentError("the admin token is empty");
  for (unsigned char c : token) {
    if (c <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError("the admin token contains whitespace or control bytes");
    }
  }
  return absl::OkStatus();
}

// The file's stamp (following symbolic links), all zero when it cannot be read.
std::array<int64_t, 4> Stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_dev), static_cast<int64_t>(st.st_ino),
          static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// The token file's token, or NOT_FOUND / INVALID_ARGUMENT naming the flag and the file.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  absl::StatusOr<std::string> text = util::ReadFile(path, 1 << 16);
  if (!text.ok()) {
    return absl::NotFoundError(
        absl::StrCat("--admin_token_file ", path, ": ", text.status().message()));
  }
  std::string token(absl::StripAsciiWhitespace(*text));
  if (absl::Status valid = ValidateToken(token); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--admin_token_file ", path, ": ", valid.message()));
  }
  return token;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AdminAuth>> AdminAuth::FromTokenFile(const std::string& path) {
  const FileStamp stamp = Stamp(path);  // before the read: a change after it is seen next time
  absl::StatusOr<std::string> token = ReadToken(path);
  if (!token.ok()) return token.status();
  return std::unique_ptr<AdminAuth>(new AdminAuth(Sha256(*token), path, stamp));
}

absl::StatusOr<std::unique_ptr<AdminAuth>> AdminAuth::FromToken(const std::string& token) {
  if (absl::Status valid = ValidateToken(token); !valid.ok()) return valid;
  return std::unique_ptr<AdminAuth>(new AdminAuth(Sha256(token), "", FileStamp{}));
}

AdminAuth::Digest AdminAuth::Current() const {
  absl::MutexLock l(&mu_);
  if (path_.empty()) return digest_;
  const FileStamp stamp = Stamp(path_);
  if (stamp == stamp_) return digest_;
  stamp_ = stamp;  // a bad file is logged once, not at every call
  absl::StatusOr<std::string> token = ReadToken(path_);
  if (!token.ok()) {
    LOG(ERROR) << "admin: " << token.status().message() << "; the previous token stays in force";
    return digest_;
  }
  digest_ = Sha256(*token);
  LOG(INFO) << "admin: the token in " << path_ << " changed; the new one is in force";
  return digest_;
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
  const Digest presented = Sha256(value);
  const Digest expected = Current();
  if (CRYPTO_memcmp(presented.data(), expected.data(), expected.size()) != 0) {
    return absl::UnauthenticatedError("wrong admin token");
  }
  return absl::OkStatus();
}

}  // namespace collabserve::service
