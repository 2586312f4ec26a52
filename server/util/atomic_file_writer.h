// Writing a large file atomically without holding it in memory: bytes stream into a temporary file
// beside the target, and one rename publishes it (the streaming form of WriteFileAtomic).
#ifndef COLLABSERVE_SERVER_UTIL_ATOMIC_FILE_WRITER_H_
#define COLLABSERVE_SERVER_UTIL_ATOMIC_FILE_WRITER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace collabserve::util {

// Append() writes to `path`.tmp.<pid>.<random> in the same directory; Commit() fsyncs, closes and
// renames it over `path`. Until Commit() succeeds `path` is untouched, and destroying the writer
// (or any failed call) removes the temporary file: a reader sees the old file, no file, or the
// complete new one, never a half-written one. Not thread-safe.
class AtomicFileWriter {
 public:
  // Creates the temporary file. FAILED_PRECONDITION naming `path` if it cannot be created.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  ~AtomicFileWriter();  // removes the temporary file unless committed
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Writes all of `bytes`. RESOURCE_EXHAUSTED naming `path` (e.g. disk full); the writer is then
  // failed: later calls return FAILED_PRECONDITION.
  absl::Status Append(absl::string_view bytes);
  // fsync, close, rename over `path`. DATA_LOSS if fsync/close fail, FAILED_PRECONDITION if the
  // rename fails or the writer has failed or was committed already.
  absl::Status Commit();

  uint64_t bytes_written() const { return bytes_written_; }
  const std::string& path() const { return path_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd);
  void Abandon();

  const std::string path_;
  const std::string tmp_;
  int fd_;
  bool done_ = false;  // committed or failed: the temporary file is gone
  uint64_t bytes_written_ = 0;
};

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_ATOMIC_FILE_WRITER_H_
