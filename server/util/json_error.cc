#include "server/util/json_error.h"

#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace collabserve::util {

absl::Status JsonSyntaxError(absl::string_view text, absl::string_view name) {
  std::string what;
  try {
    const nlohmann::json parsed = nlohmann::json::parse(text.begin(), text.end());
    static_cast<void>(parsed);
  } catch (const nlohmann::json::exception& e) {
    what = e.what();
  }
  // "[json.exception.parse_error.101] parse error at line 1, column 18: syntax error ...".
  if (absl::string_view(what).substr(0, 16) == "[json.exception.") {
    const size_t close = what.find("] ");
    if (close != std::string::npos) what.erase(0, close + 2);
  }
  if (text.find('\n') == absl::string_view::npos) {
    what = absl::StrReplaceAll(what, {{"at line 1, column ", "at column "}});
  }
  return absl::InvalidArgumentError(absl::StrCat(name, name.empty() ? "" : ": ", "not valid JSON",
                                                 what.empty() ? "" : ": ", what));
}

}  // namespace collabserve::util
