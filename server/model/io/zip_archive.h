// A minimal, strict zip reader and writer for torch.save checkpoints: only "stored" (uncompressed)
// entries, ZIP64 supported, every offset and size checked against the file before use. The reader
// never copies entry data; entries are views into the (usually memory-mapped) file bytes.
#ifndef COLLABSERVE_SERVER_MODEL_IO_ZIP_ARCHIVE_H_
#define COLLABSERVE_SERVER_MODEL_IO_ZIP_ARCHIVE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/io/checkpoint.h"

namespace collabserve::model::io {

// CRC-32 (ISO-HDLC, as zip uses), continuing from `crc` (0 to start).
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

struct ZipEntry {
  std::string name;
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;  // first byte of the entry's data in the file
  uint64_t size = 0;         // bytes of data (stored: compressed size == uncompressed size)
  uint32_t crc32 = 0;
};

struct ZipReadOptions {
  uint64_t max_entries = uint64_t{1} << 20;
  // Verify each entry's CRC-32 against its data (reads every byte once; about 1 s per 2 GB).
  bool verify_crc32 = true;
};

// An opened archive. Immutable after Open; safe to share between threads.
class ZipArchive {
 public:
  // Parses and validates the archive in `bytes`: the end-of-central-directory record (and the ZIP64
  // locator and record when present or needed), the central directory, and every local header.
  // INVALID_ARGUMENT, prefixed with `name_for_errors`, when: the bytes are not a zip or are
  // truncated; the archive spans disks; the entry count or central directory size disagree with what
  // is there; an entry is encrypted or compressed (only method 0, stored, is supported); a local
  // header disagrees with its central record (name, method, sizes, CRC); a data descriptor disagrees;
  // an entry's range runs outside the file or into the central directory; two entries overlap; a
  // name is empty, absolute, has a backslash, NUL or a ".." component, or appears twice; a CRC-32
  // does not match (when verified).
  static absl::StatusOr<ZipArchive> Open(FileBytes bytes, std::string_view name_for_errors,
                                         const ZipReadOptions& options = ZipReadOptions());

  // Entries in central-directory order.
  const std::vector<ZipEntry>& entries() const { return entries_; }
  // The entry named exactly `name`, or nullptr.
  const ZipEntry* Find(std::string_view name) const;
  // The entry's bytes (a view into bytes()).
  std::string_view Contents(const ZipEntry& entry) const;
  const FileBytes& bytes() const { return bytes_; }

 private:
  FileBytes bytes_;
  std::vector<ZipEntry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

struct ZipWriteOptions {
  // Entry data starts at a multiple of this (torch uses 64), by padding the local header's extra
  // field with a "FB" record as torch's writer does. 1 disables padding.
  uint32_t alignment = 64;
  // Write ZIP64 extra fields and the ZIP64 end records even when nothing needs them (for tests).
  bool force_zip64 = false;
};

struct ZipSource {
  std::string name;
  std::string_view data;
};

// Takes the archive's bytes in order; an error stops the write and is returned.
using ZipSink = std::function<absl::Status(std::string_view bytes)>;

// Writes a complete archive of stored entries, in the given order, to `sink`; ZIP64 records are
// used where a size, an offset or the entry count needs them. Entry data goes to the sink straight
// from the caller's buffers (no copy). INVALID_ARGUMENT for a bad or duplicate name (before
// anything is written).
absl::Status WriteZip(const std::vector<ZipSource>& entries, const ZipWriteOptions& options,
                      const ZipSink& sink);

// The same archive as one string.
absl::StatusOr<std::string> BuildZip(const std::vector<ZipSource>& entries,
                                     const ZipWriteOptions& options = ZipWriteOptions());

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_ZIP_ARCHIVE_H_
