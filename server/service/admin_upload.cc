#include "server/service/admin_upload.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/repository/model_repository.h"
#include "server/util/files.h"

namespace collabserve::service {
namespace {

constexpr const char* kKnownFiles[] = {"config.json",         "vocab.txt",
                                       "tokenizer_config.json", "special_tokens_map.json",
                                       "model.safetensors",   "pytorch_model.bin",
                                       UploadSession::kCalibrationFile};

// A full disk or quota is RESOURCE_EXHAUSTED (as for a compression job's output), anything else
// INTERNAL.
absl::Status Errno(const std::string& what, const std::string& path) {
  const int err = errno;
  std::string message = absl::StrCat(what, " ", path, ": ", strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
    return absl::ResourceExhaustedError(std::move(message));
  }
  return absl::InternalError(std::move(message));
}

}  // namespace

bool UploadSession::IsKnownFile(const std::string& name) {
  for (const char* k : kKnownFiles) {
    if (name == k) return true;
  }
  return false;
}

absl::Status UploadSession::ValidateHeader(const v1::UploadHeader& header,
                                           int64_t max_upload_bytes) {
  if (absl::Status s = repository::ModelRepository::ValidateModelName(header.model_name());
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model_name: ", s.message()));
  }
  if (header.has_version() && header.version() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("version must be positive, got ", header.version()));
  }
  std::set<std::string> names;
  int64_t total = 0;
  int weights = 0;
  for (const v1::UploadFile& f : header.files()) {
    const std::string& name = f.name();
    if (name.find('/') != std::string::npos || name.find('\\') != std::string::npos ||
        name.find("..") != std::string::npos || name.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file name '", absl::CHexEscape(name), "': path separators and '..' are not allowed"));
    }
    if (!IsKnownFile(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown file '", absl::CHexEscape(name),
          "': an upload holds only config.json, vocab.txt, tokenizer_config.json, "
          "special_tokens_map.json, model.safetensors or pytorch_model.bin, and calibration.txt"));
    }
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("file '", name, "' is listed twice"));
    }
    if (f.size() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("file '", name, "': negative size"));
    }
    if (f.size() > max_upload_bytes - total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the upload is larger than --max_upload_bytes (", max_upload_bytes, " bytes)"));
    }
    total += f.size();
    if (f.sha256().size() != 64 ||
        !std::all_of(f.sha256().begin(), f.sha256().end(),
                     [](char c) { return absl::ascii_isxdigit(c); })) {
      return absl::InvalidArgumentError(
          absl::StrCat("file '", name, "': sha256 must be 64 hexadecimal digits"));
    }
    if (name == "model.safetensors" || name == "pytorch_model.bin") ++weights;
    if (name == kCalibrationFile) {
      if (header.compression().spec_case() == v1::CompressionSpec::SPEC_NOT_SET) {
        return absl::InvalidArgumentError(
            "calibration.txt is only read to compress: the upload has no compression request");
      }
      if (f.size() > kMaxCalibrationBytes) {
        return absl::InvalidArgumentError(absl::StrCat("file 'calibration.txt' is ", f.size(),
                                                       " bytes; at most ", kMaxCalibrationBytes));
      }
    }
  }
  for (const char* required : {"config.json", "vocab.txt"}) {
    if (names.count(required) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("the upload has no ", required));
    }
  }
  if (weights != 1) {
    return absl::InvalidArgumentError(
        "the upload needs exactly one weights file: model.safetensors or pytorch_model.bin");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<UploadSession>> UploadSession::Create(
    const v1::UploadHeader& header, const std::string& dir, int64_t max_upload_bytes) {
  if (absl::Status s = ValidateHeader(header, max_upload_bytes); !s.ok()) return s;
  if (mkdir(dir.c_str(), 0755) != 0) return Errno("cannot create", dir);
  std::unique_ptr<UploadSession> session(new UploadSession(dir));
  for (const v1::UploadFile& f : header.files()) {
    File& file = session->files_[f.name()];
    const std::string path = util::JoinPath(dir, f.name());
    file.fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (file.fd < 0) return Errno("cannot create", path);
    file.size = f.size();
    file.sha256 = absl::AsciiStrToLower(f.sha256());
    file.digest = EVP_MD_CTX_new();
    if (file.digest == nullptr || EVP_DigestInit_ex(file.digest, EVP_sha256(), nullptr) != 1) {
      return absl::InternalError("cannot initialise SHA-256");
    }
    session->bytes_total_ += f.size();
  }
  return session;
}

UploadSession::~UploadSession() {
  for (auto& [name, f] : files_) {
    if (f.fd >= 0) close(f.fd);
    if (f.digest != nullptr) EVP_MD_CTX_free(f.digest);
  }
}

absl::Status UploadSession::Append(const v1::UploadChunk& chunk) {
  auto it = files_.find(chunk.file_name());
  if (it == files_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk for '", absl::CHexEscape(chunk.file_name()),
                     "', which the header does not list"));
  }
  File& f = it->second;
  if (chunk.offset() != f.received) {
    return absl::InvalidArgumentError(absl::StrCat("chunk for '", it->first, "' at offset ",
                                                   chunk.offset(), ", expected ", f.received,
                                                   " (chunks must come in order)"));
  }
  const std::string& data = chunk.data();
  if (static_cast<int64_t>(data.size()) > f.size - f.received) {
    return absl::InvalidArgumentError(absl::StrCat("file '", it->first, "' is larger than the ",
                                                   f.size, " bytes its header declared"));
  }
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(f.fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", util::JoinPath(dir_, it->first));
    }
    done += static_cast<size_t>(n);
  }
  EVP_DigestUpdate(f.digest, data.data(), data.size());
  f.received += static_cast<int64_t>(data.size());
  bytes_received_ += static_cast<int64_t>(data.size());
  return absl::OkStatus();
}

absl::Status UploadSession::Finish() {
  for (auto& [name, f] : files_) {
    if (f.received != f.size) {
      return absl::InvalidArgumentError(absl::StrCat("file '", name, "' is incomplete: ",
                                                     f.received, " of ", f.size, " bytes"));
    }
  }
  for (auto& [name, f] : files_) {
    if (f.fd < 0) continue;  // verified by an earlier call
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(f.digest, md, &len);
    const std::string got =
        absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(md), len));
    if (got != f.sha256) {
      return absl::InvalidArgumentError(absl::StrCat("checksum mismatch for '", name,
                                                     "': the header says sha256 ", f.sha256,
                                                     ", the bytes received hash to ", got));
    }
    if (fsync(f.fd) != 0) return Errno("cannot flush", util::JoinPath(dir_, name));
    close(f.fd);
    f.fd = -1;
  }
  return absl::OkStatus();
}

}  // namespace collabserve::service
