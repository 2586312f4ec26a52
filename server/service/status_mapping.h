// The one place where absl::Status becomes grpc::Status (and back, for the client).
#ifndef COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_
#define COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace collabserve::service {

// Same code (the two enums share numbering), same message. OK maps to OK.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The inverse, for code that talks to the server through a stub.
absl::Status FromGrpcStatus(const grpc::Status& status);

// "OK", "INVALID_ARGUMENT", ...: the `code` label of collabserve_requests_total.
std::string CodeName(grpc::StatusCode code);

// Ends a unary callback call on the handler's own thread, for handlers that wait on nothing:
// `body()` fills the response and returns the call's status, so an early `return error;` in the
// body is the call's answer. Returns the reactor the handler must return to gRPC.
template <typename Body>
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, Body&& body) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::forward<Body>(body)());
  return reactor;
}

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_STATUS_MAPPING_H_
