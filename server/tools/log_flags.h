#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace collabserve::tools {

// glog's verbose log as flags of the server's command line, which absl::ParseCommandLine reads
// (glog's own --v and --vmodule are gflags, unknown to it):
//   --v=N                    VLOG(n) for n <= N everywhere
//   --vmodule=PATTERN=N,...  per source file (basename without extension, * and ? allowed); the
//                            first pattern that matches wins, and a match overrides --v
// A flag left out keeps glog's environment setting (GLOG_v, GLOG_vmodule).
struct VerboseLogFlags {
  std::optional<int> v;
  std::optional<std::string> vmodule;
};

// The two flags, for glog's FLAGS_v and FLAGS_vmodule (set them before the first VLOG: glog reads
// FLAGS_vmodule once). The error names an entry of --vmodule that is not PATTERN=N, which glog
// would ignore without a word.
absl::StatusOr<VerboseLogFlags> GetVerboseLogFlags();

}  // namespace collabserve::tools
