// Subcommands of collabserve-model implemented in their own files.
#ifndef COLLABSERVE_SERVER_TOOLS_COMMANDS_H_
#define COLLABSERVE_SERVER_TOOLS_COMMANDS_H_

#include "absl/status/status.h"

namespace collabserve::tools {

// collabserve-model compress (compress_command.cc).
absl::Status Compress(int argc, char** argv);

}  // namespace collabserve::tools

#endif  // COLLABSERVE_SERVER_TOOLS_COMMANDS_H_
