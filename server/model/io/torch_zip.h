// Reader and writer for PyTorch's zip checkpoint format (torch.save since 1.6, pytorch_model.bin):
// a zip of stored entries <prefix>/data.pkl (the pickled state dict), <prefix>/data/<key> (one raw
// little-endian storage per key), <prefix>/version and optionally <prefix>/byteorder. No torch
// dependency and no Python: the pickle is interpreted by restricted_unpickler.h, which executes
// nothing.
#ifndef COLLABSERVE_SERVER_MODEL_IO_TORCH_ZIP_H_
#define COLLABSERVE_SERVER_MODEL_IO_TORCH_ZIP_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/io/checkpoint.h"

namespace collabserve::model::io {

// Memory-maps `path` and reads the state dict in it. Tensors view the mapping (torch storages may
// be shared by several tensors and strided; see RawTensor). The top-level object must be a dict
// (OrderedDict or dict) of str -> tensor; as a convenience, a dict whose only entry is another dict
// (e.g. {"state_dict": {...}} or {"model": {...}}) is unwrapped one level, and the unwrapping is
// logged. Parameters (torch._utils._rebuild_parameter) read as their tensors. The legacy (pre-1.6,
// non-zip) torch format is not supported. Checkpoint::metadata is empty.
// Errors: NOT_FOUND if missing; INVALID_ARGUMENT naming the file and the entry or tensor for every
// zip problem (see ZipArchive::Open), every pickle problem (see UnpickleStateDict; a disallowed
// global reads "<file>: data.pkl: global 'os.system' is not allowed in a state dict"), a missing
// data.pkl, version or storage entry, a big-endian byteorder, a storage entry smaller than its
// numel * element size, a value that is not a tensor or a key that is not a str.
absl::StatusOr<Checkpoint> ReadTorchZip(const std::string& path);

// The same on bytes in memory; tensors share ownership of `bytes`.
absl::StatusOr<Checkpoint> ParseTorchZip(std::shared_ptr<const std::string> bytes,
                                         std::string_view name_for_errors);
absl::StatusOr<Checkpoint> ParseTorchZipBytes(FileBytes bytes, std::string_view name_for_errors);

// Writes a pytorch_model.bin that torch.load (also with weights_only=True) and ReadTorchZip both
// read: a collections.OrderedDict of the tensors in the given order, with a `_metadata` attribute as
// Hugging Face save_pretrained writes it ({module prefix: {"version": 1}} for every prefix of every
// name, which is what nn.Module records for BERT's modules), one storage per tensor, each 64-byte
// aligned, zip top folder "archive", format version 3, byteorder "little". Written atomically
// (temp file + fsync + rename); the tensors stream from the caller's buffers into the temporary
// file, the writer holds only the pickle and the headers. INVALID_ARGUMENT for empty or
// duplicate names, negative or oversized dims, or null data for a non-empty tensor.
absl::Status WriteTorchZip(const std::string& path, const std::vector<TensorToWrite>& tensors);

// The bytes WriteTorchZip would write. `force_zip64` writes ZIP64 records even for small files.
absl::StatusOr<std::string> SerializeTorchZip(const std::vector<TensorToWrite>& tensors,
                                              bool force_zip64 = false);

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_TORCH_ZIP_H_
