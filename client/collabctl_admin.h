// collabctl's admin commands (the collabserve.v1.Admin service):
//   upload --dir=D --name=N [--rank=R | --ratio=X | --max_error=E] [--min_agreement=A] [--wait]
//   jobs [JOB_ID] | cancel JOB_ID | watch JOB_ID
//   compress NAME [SOURCE_VERSION] (--rank=R | --ratio=X | --max_error=E) [--min_agreement=A] [--wait]
//   load NAME VERSION | unload NAME VERSION | delete NAME VERSION
// The bearer token comes from --token_file, else from the COLLABSERVE_TOKEN environment variable.
#ifndef COLLABSERVE_CLIENT_COLLABCTL_ADMIN_H_
#define COLLABSERVE_CLIENT_COLLABCTL_ADMIN_H_

#include <string>

#include "client/tls.h"

namespace collabserve::client {

// True for the commands above.
bool IsAdminCommand(const std::string& cmd);

// Where the Admin service listens and how to reach it.
struct AdminTarget {
  std::string address;         // HOST:PORT
  ClientTls tls;
};

// Runs admin command `cmd` against `target`. `argc`/`argv` are the positional arguments after
// the command (flags were parsed by the caller's absl::ParseCommandLine; the admin flags are
// defined in collabctl_admin.cc). Prints to stdout (results) and stderr (progress, errors).
// Returns the process exit code: 0 on success, 1 on a failed call or job, 2 on bad usage.
int RunAdminCommand(const std::string& cmd, int argc, char** argv, const AdminTarget& target);

// The same over a plaintext channel to `address`.
int RunAdminCommand(const std::string& cmd, int argc, char** argv, const std::string& address);

}  // namespace collabserve::client

#endif  // COLLABSERVE_CLIENT_COLLABCTL_ADMIN_H_
