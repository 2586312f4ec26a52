// A listening TCP socket for the plain-socket HTTP servers (/metrics, the REST endpoint).
#ifndef COLLABSERVE_SERVER_UTIL_LISTEN_H_
#define COLLABSERVE_SERVER_UTIL_LISTEN_H_

#include <string>

#include "absl/status/statusor.h"

namespace collabserve::util {

struct ListeningSocket {
  int fd = -1;  // close-on-exec; the caller owns it
  int port = 0;  // the bound port (the one picked, for port 0)
};

// Binds and listens on host:port as gRPC's listeners do: an IPv6 literal may come in brackets
// ("[::]"), "::" takes IPv4 too (dual stack), an empty host is every address, port 0 picks one.
// Errors name `what` ("metrics", "HTTP") and the address: INVALID_ARGUMENT for an address that
// does not resolve, UNAVAILABLE for one that cannot be bound (in use, not local).
absl::StatusOr<ListeningSocket> ListenTcp(const std::string& host, int port, const std::string& what,
                                          int backlog = 128);

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_LISTEN_H_
