#include "server/util/listen.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace collabserve::util {

absl::StatusOr<ListeningSocket> ListenTcp(const std::string& host, int port, const std::string& what,
                                          int backlog) {
  const std::string where = absl::StrCat(host, ":", port);
  // "[::]" as gRPC's addresses write it: getaddrinfo takes the literal without brackets.
  const std::string name = host.size() > 2 && host.front() == '[' && host.back() == ']'
                               ? host.substr(1, host.size() - 2)
                               : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  if (const int rc = ::getaddrinfo(name.empty() ? nullptr : name.c_str(), port_str.c_str(), &hints, &res);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " address ", where, ": ", ::gai_strerror(rc)));
  }
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    ::freeaddrinfo(res);
    return absl::UnavailableError(absl::StrCat(what, " socket: ", std::strerror(err)));
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (res->ai_family == AF_INET6) {
    int zero = 0;  // "::" takes IPv4 too, as gRPC's listener does
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  }
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
    const int err = errno;
    ::freeaddrinfo(res);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot serve ", what, " on ", where, ": ", std::strerror(err)));
  }
  ::freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  ListeningSocket out;
  out.fd = fd;
  out.port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return out;
}

}  // namespace collabserve::util
