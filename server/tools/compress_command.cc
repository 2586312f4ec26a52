#include "absl/status/status.h"
#include "server/tools/commands.h"

namespace collabserve::tools {

absl::Status Compress(int argc, char** argv) {
  return absl::UnimplementedError("compress is not built yet");
}

}  // namespace collabserve::tools
