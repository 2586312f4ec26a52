#include "server/util/atomic_file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace collabserve::util {

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(const std::string& path) {
  std::random_device rd;
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cannot create temporary file: ", std::strerror(errno)));
  }
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, std::move(tmp), fd));
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp, int fd)
    : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (done_) return;
  done_ = true;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
}

absl::Status AtomicFileWriter::Append(absl::string_view bytes) {
  if (done_) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer already finished"));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      Abandon();
      return absl::ResourceExhaustedError(absl::StrCat(path_, ": write failed: ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  bytes_written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (done_) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer already finished"));
  if (::fsync(fd_) != 0) {
    const int err = errno;
    Abandon();
    return absl::DataLossError(absl::StrCat(path_, ": fsync failed: ", std::strerror(err)));
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    Abandon();
    return absl::DataLossError(absl::StrCat(path_, ": close failed: ", std::strerror(err)));
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    Abandon();
    return absl::FailedPreconditionError(absl::StrCat(path_, ": rename failed: ", std::strerror(err)));
  }
  done_ = true;
  return absl::OkStatus();
}

}  // namespace collabserve::util
