// The one place where absl::Status becomes grpc::Status (and back, for the client).
#ifndef COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_
#define COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace collabserve::service {

// Same code (the two enums share numbering), same message. OK maps to OK.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The inverse, for code that talks to the server through a stub.
absl::Status FromGrpcStatus(const grpc::Status& status);

// "OK", "INVALID_ARGUMENT", ...: the `code` label of collabserve_requests_total.
std::string CodeName(grpc::StatusCode code);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_
