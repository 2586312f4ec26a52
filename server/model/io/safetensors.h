// Reader and writer for the safetensors format: an 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then
// the data buffer that the offsets index. The reader treats the file as hostile: every field is
// type- and bounds-checked before any tensor view is made.
#ifndef COLLABSERVE_SERVER_MODEL_IO_SAFETENSORS_H_
#define COLLABSERVE_SERVER_MODEL_IO_SAFETENSORS_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/io/checkpoint.h"

namespace collabserve::model::io {

// Largest header accepted (as the reference implementation): 100 MB.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Memory-maps `path` (read-only, MAP_PRIVATE) and parses it; tensors view the mapping, which stays
// alive while any RawTensor does. NOT_FOUND if missing; INVALID_ARGUMENT naming the file, the tensor
// and the problem for anything malformed: header length over the limit or past the end of the file,
// header not a JSON object, an entry of the wrong type or with unknown fields, unknown dtype,
// negative or oversized dims, offsets outside the data buffer or reversed, ranges that overlap,
// byte length that is not DTypeSize * numel, empty or duplicate names.
// Holes between tensors are allowed (the data buffer need not be fully used).
absl::StatusOr<Checkpoint> ReadSafetensors(const std::string& path);

// The same checks on bytes in memory; tensors share ownership of `bytes`. `name_for_errors`
// prefixes every error message.
absl::StatusOr<Checkpoint> ParseSafetensors(std::shared_ptr<const std::string> bytes,
                                            std::string_view name_for_errors);
absl::StatusOr<Checkpoint> ParseSafetensorsBytes(FileBytes bytes, std::string_view name_for_errors);

// Writes `tensors` contiguously and `metadata` as "__metadata__" (omitted when empty), atomically
// (temp file + fsync + rename). As the reference implementation does, the header is space-padded to
// a multiple of 8 and the data is laid out by element size (largest first), then name, so every
// tensor starts at a multiple of its element size and the buffer has no holes. INVALID_ARGUMENT for empty, duplicate or reserved ("__metadata__")
// names, negative dims, or null data for a non-empty tensor. The tensors stream from the caller's
// buffers into the temporary file: the writer holds the header, never a copy of the data.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata);

// The bytes WriteSafetensors would write (for tests and in-memory use).
absl::StatusOr<std::string> SerializeSafetensors(const std::vector<TensorToWrite>& tensors,
                                                 const std::map<std::string, std::string>& metadata);

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_SAFETENSORS_H_
