// The error for text that is not valid JSON, naming where and what (nlohmann's parser message),
// shared by every loader that reads a JSON file or line.
#ifndef COLLABSERVE_SERVER_UTIL_JSON_ERROR_H_
#define COLLABSERVE_SERVER_UTIL_JSON_ERROR_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace collabserve::util {

// INVALID_ARGUMENT "`name`: not valid JSON: parse error at line 3, column 7: <what>" for `text`,
// which the caller found not to parse. For one-line text (a JSON-lines record) the position is
// "at column 7"; with an empty `name` the message starts at "not valid JSON". Parses `text` again,
// so call it only on the error path.
absl::Status JsonSyntaxError(absl::string_view text, absl::string_view name);

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_JSON_ERROR_H_
