// Fuzzes UploadSession::ValidateHeader, the check of Admin.UploadModel's first message (model name,
// version, file names, sizes, SHA-256s) that runs before anything is written. Input: one byte that
// picks --max_upload_bytes, then a serialized v1::UploadHeader (inputs that protobuf cannot parse
// are skipped: protobuf's own parser is not ours to fuzz). An accepted header must keep every promise
// the header contract makes, checked here independently of the implementation; a refused one must
// be INVALID_ARGUMENT with a message.
//
// Not covered yet: the compression request and min_agreement (ParseCompressionSpec and
// JobManager::Create in admin_jobs.cc, which needs LibTorch; see README.md).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>

#include "collabserve/v1/admin.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/service/admin_upload.h"

namespace {

using collabserve::service::UploadSession;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "admin_upload_fuzzer: accepted a header with %s: '%s'\n", what,
               detail.c_str());
  std::abort();
}

bool IsHex(const std::string& s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return false;
  }
  return true;
}

// The header contract (admin_upload.h), restated.
void CheckAccepted(const collabserve::v1::UploadHeader& h, int64_t max_upload_bytes) {
  const std::string& model = h.model_name();
  if (model.empty() || model.size() > 255 || model[0] == '.') Fail("a bad model name", model);
  for (char c : model) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) Fail("a bad character in the model name", model);
  }
  if (h.has_version() && h.version() <= 0) Fail("a non-positive version", std::to_string(h.version()));
  static const std::set<std::string> kKnown = {"config.json",       "vocab.txt",
                                               "tokenizer_config.json", "special_tokens_map.json",
                                               "model.safetensors", "pytorch_model.bin",
                                               "calibration.txt"};
  std::set<std::string> names;
  int64_t total = 0;
  int weights = 0;
  for (const auto& f : h.files()) {
    const std::string& name = f.name();
    if (kKnown.count(name) == 0) Fail("an unknown file", name);
    if (name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
      Fail("a path in a file name", name);
    }
    if (!names.insert(name).second) Fail("a file listed twice", name);
    if (f.size() < 0) Fail("a negative size", name);
    if (f.size() > max_upload_bytes - total) Fail("more bytes than the limit", name);
    total += f.size();
    if (f.sha256().size() != 64 || !IsHex(f.sha256())) Fail("a bad sha256", f.sha256());
    if (!UploadSession::IsKnownFile(name)) Fail("a name IsKnownFile refuses", name);
    if (name == "model.safetensors" || name == "pytorch_model.bin") ++weights;
    if (name == "calibration.txt") {
      if (h.compression().spec_case() == collabserve::v1::CompressionSpec::SPEC_NOT_SET) {
        Fail("calibration.txt without a compression request", name);
      }
      if (f.size() > (int64_t{16} << 20)) Fail("a calibration.txt above 16 MiB", std::to_string(f.size()));
    }
  }
  if (names.count("config.json") == 0) Fail("no config.json", model);
  if (names.count("vocab.txt") == 0) Fail("no vocab.txt", model);
  if (weights != 1) Fail("not exactly one weights file", std::to_string(weights));
  if (total > max_upload_bytes) Fail("a total above the limit", std::to_string(total));
}

}  // namespace

// protobuf logs every string field with invalid UTF-8 it refuses to parse; that is expected here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static constexpr int64_t kLimits[] = {0, 1, 1 << 20, int64_t{1} << 30,
                                        std::numeric_limits<int64_t>::max(), -1,
                                        std::numeric_limits<int64_t>::min(), 4096};
  const int64_t max_upload_bytes = kLimits[data[0] % (sizeof(kLimits) / sizeof(kLimits[0]))];
  collabserve::v1::UploadHeader header;
  if (!header.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  const absl::Status s = UploadSession::ValidateHeader(header, max_upload_bytes);
  if (s.ok()) {
    CheckAccepted(header, max_upload_bytes);
  } else if (s.code() != absl::StatusCode::kInvalidArgument || s.message().empty()) {
    std::fprintf(stderr, "admin_upload_fuzzer: refused with %s\n", s.ToString().c_str());
    std::abort();
  }
  return 0;
}
