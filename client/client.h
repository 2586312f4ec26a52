// C++ client for collabserve: a channel with the server's options and thin, deadline-bounded
// wrappers over the Inference and Health stubs. Errors come back as absl::Status with the server's
// code and message.
#ifndef COLLABSERVE_CLIENT_CLIENT_H_
#define COLLABSERVE_CLIENT_CLIENT_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/channel.h"

namespace collabserve::client {

struct ClientOptions {
  // "host:port".
  std::string address = "127.0.0.1:8500";
  // Deadline applied to each call unless the call gives its own.
  std::chrono::milliseconds default_deadline{10000};
  // Largest message sent or received (bytes).
  int max_message_bytes = 64 << 20;
  // TLS: if `use_tls`, `root_certs_pem` (empty = system roots) verifies the server.
  bool use_tls = false;
  std::string root_certs_pem;
  // Wait for the channel to connect in Create (up to default_deadline); UNAVAILABLE otherwise.
  bool wait_for_connection = false;
};

// Thread-safe: one Client may be used from many threads (gRPC channels and stubs are).
class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);

  // Each call uses `deadline` if non-zero, else options.default_deadline.
  absl::StatusOr<v1::ClassifyResponse> Classify(const v1::ClassifyRequest& request,
                                                std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request,
                                                std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::ListModelsResponse> ListModels(std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::ModelMetadata> GetModel(const std::string& model,
                                             std::chrono::milliseconds deadline = {}) const;
  // grpc.health.v1 Check for `service` ("" = the whole server). Returns true iff SERVING; an RPC
  // error (e.g. NOT_FOUND for an unknown service, UNAVAILABLE when unreachable) is returned as is.
  absl::StatusOr<bool> IsServing(const std::string& service = "",
                                 std::chrono::milliseconds deadline = {}) const;

  v1::Inference::Stub* stub() const { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const ClientOptions& options() const { return options_; }

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  void SetDeadline(grpc::ClientContext* context, std::chrono::milliseconds deadline) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};

}  // namespace collabserve::client

#endif  // COLLABSERVE_CLIENT_CLIENT_H_
