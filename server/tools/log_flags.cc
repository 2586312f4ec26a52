#include "server/tools/log_flags.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

// Not beside the other flags: glog/logging.h declares glog's own FLAGS_v and FLAGS_vmodule in the
// global namespace, where ABSL_FLAG must define these, so this file includes no glog header.
ABSL_FLAG(std::optional<int>, v, std::nullopt,
          "verbose log: VLOG(n) for n <= this (1: versions loaded and unloaded, refused requests; "
          "2: each batch, each CP-ALS sweep); left out: $GLOG_v, else 0");
ABSL_FLAG(std::optional<std::string>, vmodule, std::nullopt,
          "verbose log per source file: PATTERN=N,... (e.g. model_repository=2); the first match "
          "wins over --v; left out: $GLOG_vmodule");

namespace collabserve::tools {

absl::StatusOr<VerboseLogFlags> GetVerboseLogFlags() {
  VerboseLogFlags flags{absl::GetFlag(FLAGS_v), absl::GetFlag(FLAGS_vmodule)};
  for (absl::string_view entry : absl::StrSplit(flags.vmodule.value_or(""), ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    int level = 0;
    if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtoi(parts[1], &level)) {
      return absl::InvalidArgumentError(absl::StrCat("--vmodule=", *flags.vmodule, ": '", entry,
                                                     "' is not PATTERN=N (e.g. model_repository=2)"));
    }
  }
  return flags;
}

}  // namespace collabserve::tools
