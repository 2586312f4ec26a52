#include "server/model/io/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/model/io/safetensors.h"
#include "server/model/io/str_util.h"
#include "server/model/io/torch_zip.h"
#include "server/util/status_macros.h"

namespace collabserve::model::io {

using internal::Cat;

int64_t RawTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // readers reject shapes whose product overflows
  return n;
}

size_t RawTensor::nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }

bool RawTensor::is_contiguous() const {
  if (strides.size() != shape.size()) return false;
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) return true;
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

absl::StatusOr<FileBytes> MapFileReadOnly(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return absl::NotFoundError(Cat(path, ": no such file"));
    return absl::FailedPreconditionError(Cat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(Cat(path, ": not a regular file"));
  }
  FileBytes out;
  out.size = static_cast<size_t>(st.st_size);
  if (out.size == 0) {
    ::close(fd);
    return out;
  }
  void* addr = ::mmap(nullptr, out.size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (addr == MAP_FAILED) {
    return absl::FailedPreconditionError(Cat(path, ": mmap failed: ", std::strerror(err)));
  }
  size_t len = out.size;
  out.owner = std::shared_ptr<const void>(addr, [len](const void* p) {
    ::munmap(const_cast<void*>(p), len);
  });
  out.data = static_cast<const uint8_t*>(addr);
  return out;
}

FileBytes BytesOfString(std::shared_ptr<const std::string> bytes) {
  FileBytes out;
  out.data = reinterpret_cast<const uint8_t*>(bytes->data());
  out.size = bytes->size();
  out.owner = std::move(bytes);
  return out;
}

bool LooksLikeLegacyTorchSave(const uint8_t* data, size_t size) {
  // Protocol-2 pickle of the legacy magic number 0x1950a86a20f9469cfc6c (LONG1, 10 bytes).
  static const uint8_t kMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  return size >= sizeof(kMagic) && std::memcmp(data, kMagic, sizeof(kMagic)) == 0;
}

absl::StatusOr<Checkpoint> ReadCheckpointFile(const std::string& path) {
  ASSIGN_OR_RETURN(FileBytes bytes, MapFileReadOnly(path));
  if (bytes.size >= 4 && bytes.data[0] == 'P' && bytes.data[1] == 'K' &&
      ((bytes.data[2] == 3 && bytes.data[3] == 4) || (bytes.data[2] == 5 && bytes.data[3] == 6))) {
    return ParseTorchZipBytes(std::move(bytes), path);
  }
  if (LooksLikeLegacyTorchSave(bytes.data, bytes.size)) return ParseTorchZipBytes(std::move(bytes), path);
  return ParseSafetensorsBytes(std::move(bytes), path);
}

}  // namespace collabserve::model::io
