// Small file helpers shared by the loaders and writers: whole-file reads with clear errors, and
// atomic writes (temp file + fsync + rename) so that a reader never sees a half-written file.
#ifndef COLLABSERVE_SERVER_UTIL_FILES_H_
#define COLLABSERVE_SERVER_UTIL_FILES_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace collabserve::util {

// Reads the whole file. NOT_FOUND if it does not exist; FAILED_PRECONDITION if it is larger than
// `max_bytes`; the message names the path.
absl::StatusOr<std::string> ReadFile(const std::string& path, size_t max_bytes = size_t{1} << 34);

// Writes `contents` to `path` atomically: a temporary file in the same directory, fsync, rename.
absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents);

bool FileExists(const std::string& path);
// Whether `path` is there to read: false when nothing has that name, true for a regular file (or a
// link to one); INVALID_ARGUMENT naming it for anything else (a dangling link, a directory), which
// FileExists would report as absent, so that an optional file's defaults silently applied.
absl::StatusOr<bool> PresentFile(const std::string& path);
bool IsDirectory(const std::string& path);
std::string JoinPath(absl::string_view dir, absl::string_view name);
// `path` in lexically normal form without a trailing separator ("out/" and "./out/." give "out"),
// for a directory about to be created: its temporary sibling is `name + suffix` and it is renamed
// into place, which a trailing separator would turn into a child of the target.
std::string DirectoryName(const std::string& path);

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_FILES_H_
