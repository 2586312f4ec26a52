// One checkpoint upload being received: the header's promises (names, sizes, SHA-256) checked
// before anything is written, then chunks appended in order to files in a staging directory, and
// at the end every size and digest verified.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_UPLOAD_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_UPLOAD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collabserve/v1/admin.pb.h"

typedef struct evp_md_ctx_st EVP_MD_CTX;

namespace collabserve::service {

// Not thread-safe: one reactor feeds it, one message at a time. The destructor closes the files
// (it does not remove them: the staging directory belongs to the job).
class UploadSession {
 public:
  // The files an upload may contain (a Hugging Face BERT directory, and calibration text for a
  // compression request).
  static bool IsKnownFile(const std::string& name);
  static constexpr const char* kCalibrationFile = "calibration.txt";
  static constexpr int64_t kMaxCalibrationBytes = int64_t{16} << 20;

  // Checks the header alone: a valid model name, at least config.json, vocab.txt and exactly one
  // of model.safetensors / pytorch_model.bin, no path separators or "..", no unknown or duplicate
  // names, sizes >= 0 adding up to at most `max_upload_bytes`, 64-hex-digit SHA-256s;
  // calibration.txt only with a compression request and at most kMaxCalibrationBytes (its text is
  // checked by the job: UTF-8, no NUL byte, enough texts).
  // INVALID_ARGUMENT naming the file and the problem.
  static absl::Status ValidateHeader(const v1::UploadHeader& header, int64_t max_upload_bytes);

  // ValidateHeader, then creates `dir` (its parent must exist) and one empty file per entry.
  static absl::StatusOr<std::unique_ptr<UploadSession>> Create(const v1::UploadHeader& header,
                                                               const std::string& dir,
                                                               int64_t max_upload_bytes);
  ~UploadSession();
  UploadSession(const UploadSession&) = delete;
  UploadSession& operator=(const UploadSession&) = delete;

  // Appends a chunk. INVALID_ARGUMENT for a file not in the header, an offset other than the bytes
  // of that file received so far, or more bytes than its declared size; the file's I/O error
  // otherwise.
  absl::Status Append(const v1::UploadChunk& chunk);

  // Every file complete and its SHA-256 as declared; flushes the files to disk. INVALID_ARGUMENT
  // naming the first file that is short or whose checksum differs.
  absl::Status Finish();

  int64_t bytes_received() const { return bytes_received_; }
  int64_t bytes_total() const { return bytes_total_; }
  const std::string& dir() const { return dir_; }

 private:
  struct File {
    int fd = -1;
    int64_t size = 0;
    int64_t received = 0;
    std::string sha256;  // expected, lowercase hex
    EVP_MD_CTX* digest = nullptr;
  };
  explicit UploadSession(std::string dir) : dir_(std::move(dir)) {}

  const std::string dir_;
  std::map<std::string, File> files_;
  int64_t bytes_received_ = 0;
  int64_t bytes_total_ = 0;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_UPLOAD_H_
