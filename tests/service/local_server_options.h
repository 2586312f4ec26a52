// The options every in-process test server starts from: a free port of 127.0.0.1, the given model
// repository, no metrics port, no repository polling or settling. Tests change what they exercise
// on top.
#ifndef COLLABSERVE_TESTS_SERVICE_LOCAL_SERVER_OPTIONS_H_
#define COLLABSERVE_TESTS_SERVICE_LOCAL_SERVER_OPTIONS_H_

#include <string>

#include "absl/time/time.h"
#include "server/service/server.h"

namespace collabserve::testing {

inline service::ServerOptions LocalServerOptions(const std::string& repository) {
  service::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_port = -1;
  o.model_repository = repository;
  o.poll_interval = absl::ZeroDuration();
  o.version_settle = absl::ZeroDuration();  // tests write whole versions before they load them
  return o;
}

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_SERVICE_LOCAL_SERVER_OPTIONS_H_
