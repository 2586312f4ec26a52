// Checkpoint tensors as torch-free views into the file's bytes, and the format-independent entry
// point ReadCheckpointFile(). The format readers and writers live in safetensors.h and torch_zip.h.
// Every function in io/ is thread-safe (no shared mutable state); readers treat files as hostile.
#ifndef COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_H_
#define COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/io/dtype.h"

namespace collabserve::model::io {

// A tensor view into a shared, immutable byte buffer (the file's bytes or an mmap of the file).
// `owner` keeps the buffer alive; copying a RawTensor shares it. Strides are in elements: row-major
// contiguous for safetensors, possibly strided (transposed, views into a shared storage) for torch
// files. Every reader guarantees, before returning, that each element the shape and strides can
// address lies inside [data, data + storage_bytes_available), so a consumer that walks
// data[sum(i_k * strides[k]) * DTypeSize(dtype)] for 0 <= i_k < shape[k] never reads out of bounds.
// `data` is not necessarily aligned to the element size (a hostile or odd file can place a tensor
// at any byte); files written by our writers and by torch.save are 64-byte aligned. Copy with
// memcpy, or check alignment before casting. Immutable, so safe to share between threads.
struct RawTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;  // points at element [0, ..., 0]
  size_t storage_bytes_available = 0;  // bytes from `data` to the end of its storage

  // Product of the dims (1 for a 0-dim tensor, 0 if any dim is 0).
  int64_t numel() const;
  // True if strides are the row-major strides of shape (dims of size 1 may have any stride).
  bool is_contiguous() const;
  // numel() * DTypeSize(dtype).
  size_t nbytes() const;
};

// Largest rank and dim any reader accepts for one tensor.
inline constexpr size_t kMaxTensorRank = 16;
inline constexpr int64_t kMaxTensorDim = int64_t{1} << 40;

using TensorMap = std::map<std::string, RawTensor>;  // ordered by name

struct Checkpoint {
  TensorMap tensors;
  // The safetensors "__metadata__" (string to string). Empty for torch files.
  std::map<std::string, std::string> metadata;
};

// A tensor to write: `data` points at numel * DTypeSize(dtype) contiguous row-major bytes owned by
// the caller for the duration of the write call.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Reads a checkpoint file of either format, chosen by content, not by name: a zip local-header or
// end-of-central-directory magic means a torch.save zip file (ReadTorchZip), anything else is tried
// as safetensors (ReadSafetensors). Errors: NOT_FOUND if missing; INVALID_ARGUMENT naming the file
// (and the tensor or entry) for any malformed content.
absl::StatusOr<Checkpoint> ReadCheckpointFile(const std::string& path);

// Row-major contiguous strides for `shape`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);

// Read-only bytes of a whole file, memory-mapped (MAP_PRIVATE, PROT_READ); `owner` unmaps when the
// last reference goes. An empty file gives size 0 and data == nullptr. NOT_FOUND if missing,
// FAILED_PRECONDITION if not a regular file or not mappable. The file must not be truncated in
// place while mapped (SIGBUS); our writers replace files by rename, which is safe.
struct FileBytes {
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;
  size_t size = 0;
};
absl::StatusOr<FileBytes> MapFileReadOnly(const std::string& path);

// True if `bytes` starts like a pre-1.6 torch.save file (a pickle, not a zip), which we refuse.
bool LooksLikeLegacyTorchSave(const uint8_t* data, size_t size);

// Wraps an in-memory string as FileBytes sharing its ownership.
FileBytes BytesOfString(std::shared_ptr<const std::string> bytes);

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_H_
